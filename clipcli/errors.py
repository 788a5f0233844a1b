"""The exit statuses and the one exception hierarchy of clipcli; standard library only."""

from __future__ import annotations

import enum
import os
import signal
import sys

# typing.TYPE_CHECKING without importing typing, which is a third of what runs before `__main__` installs the
# stop handlers (a stop until then is Python's: a traceback)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn


class ExitStatus(enum.IntEnum):
    """Every exit status of the `clipcli` command."""

    OK = 0
    CHECK_FAILED = 1  # --fail-above / --fail-nonfinite tripped, or a clip needs a norm that is not finite
    USAGE = 2  # a bad option or value (Click's own convention)
    BAD_INPUT = 3  # missing file, wrong file type, malformed checkpoint, unsupported dtype or conversion
    WRITE_FAILED = (
        4  # the output or the report (stdout closed, full) could not be written, or would overwrite the input
    )
    INTERNAL = 70  # a bug (EX_SOFTWARE)
    INTERRUPTED = 130  # Ctrl-C (SIGINT)
    TERMINATED = 143  # SIGTERM (what `timeout`, `kill` and a cancelled CI job send)


class Terminated(BaseException):
    """SIGTERM arrived: the command stops as on Ctrl-C, its temporary files removed."""


_stops: list[int] = []  # the stop signals received (SIGINT, SIGTERM), first first
_deferred = [0]  # > 0: a stop is remembered and raised later (`defer_stops`)
_committing = [False]  # an output is replacing its target: a stop is dropped (`commit_begins`)


def stop(signum: int, frame: Any = None) -> None:
    """The handler of SIGINT and SIGTERM (installed by the command line): raises KeyboardInterrupt or
    Terminated, and remembers the signal. Where Python swallows the exception (raised in an at-fork hook
    or a `__del__`), `raise_if_stopped` still keeps a write from being committed and the exit status says so.
    Where stops are deferred the exception comes later; once an output is being committed, never.
    """
    if _committing[0]:
        return
    _stops.append(signum)
    if not _deferred[0]:
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated


def defer_stops() -> Callable[[], None]:
    """Remembers a stop instead of raising it until the returned function is called, which raises it then:
    for code that must not be cut short (a temporary file's creation, before the `try` that removes it).
    A flag, not a signal mask: any thread may take a process's signal."""
    _deferred[0] += 1

    def resume() -> None:
        _deferred[0] -= 1
        raise_if_stopped()

    return resume


def install_stop_handlers() -> None:
    """Makes SIGINT and SIGTERM stop the command (`stop`), except one the process was started with ignored (a
    background job's SIGINT, `nohup`): that stays ignored, as for any program."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop)
    if not getattr(sys.unraisablehook, "quiet_stops", False):
        sys.unraisablehook = _quiet_stops(sys.unraisablehook)


def _quiet_stops(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """Python's hook for an exception it swallows (raised in a `__del__`, a weakref callback of the import
    machinery), without its "Exception ignored" traceback for a stop's: that one is remembered in `_stops`
    and ends the command all the same."""

    def unraisable(unraisable: Any) -> None:
        if not (_stops and isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated))):
            hook(unraisable)

    unraisable.quiet_stops = True  # type: ignore[attr-defined]
    return unraisable


def commit_begins() -> None:
    """From here on an output replaces its target: a stop can no longer undo the write, and may neither exit 130
    ("the target untouched") once a target is replaced nor leave some shards of an output replaced and others
    not. Stops are dropped from here to the exit (`ignore_stops_if_committed`); the command runs to its end.
    Only where the command line's handler is installed (a library's caller keeps Python's own)."""
    if stop in (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)):
        _committing[0] = True


def ignore_stops_if_committed() -> None:
    """At the command line's end: once an output was committed, stops are ignored to the exit (the
    interpreter's teardown resets handlers, and a stop there would end the process by the signal)."""
    if _committing[0]:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


def stop_status() -> ExitStatus | None:
    """The exit status of the first stop signal received, or None."""
    if not _stops:
        return None
    return ExitStatus.INTERRUPTED if _stops[0] == signal.SIGINT else ExitStatus.TERMINATED


def exit_stopped(announce: bool = True) -> NoReturn:
    """Says the command was stopped (one line on stderr, unless `announce` is false: said already), then ends
    the process by the stop signal itself, with its default action: a shell sees 130 or 143 and stops its loop
    or script as for any program (an exit status of 130 would let `for f in *; do clipcli ...; done` go on).
    """
    status = stop_status() or ExitStatus.INTERRUPTED
    signum = signal.SIGINT if status == ExitStatus.INTERRUPTED else signal.SIGTERM
    try:
        if announce:
            sys.stderr.write("clipcli: interrupted\n" if signum == signal.SIGINT else "clipcli: terminated\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # a closed or full stream must not keep the process from ending
        pass
    signal.signal(signum, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    sys.exit(status)  # not reached: the signal's default action ends the process


def raise_if_stopped() -> None:
    """Raises the stop signal's exception again if one arrived (before a write is committed)."""
    status = stop_status()
    if status is not None:
        raise KeyboardInterrupt if status == ExitStatus.INTERRUPTED else Terminated


class ClipcliError(Exception):
    """An error with a message for the user: `<file>[: tensor <name>]: <what went wrong>`."""

    status = ExitStatus.INTERNAL

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None, tensor: str | None = None):
        super().__init__(message)
        self.message = message
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor

    def __reduce__(self) -> tuple:  # crosses from a worker process to the parent whole
        return _rebuild, (type(self), self.message, self.path, self.tensor, self.__dict__)

    def __str__(self) -> str:
        where = [] if self.path is None else [shown_path(self.path)]
        if self.tensor is not None:
            where.append(f"tensor {self.tensor}")
        return printable(": ".join([*where, _one_line(self.message)]))  # no control character reaches a terminal


def _rebuild(cls: type, message: str, path: str | None, tensor: str | None, state: dict) -> ClipcliError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


def shown_path(path: str) -> str:
    """A path as it can be typed back: a relative one starting with '-' (typed `./-x.safetensors`, which pathlib
    shortens to `-x.safetensors`) gets its './' again, so that a command line does not take it for an option."""
    return f"./{path}" if path.startswith("-") and path != "-" else path


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def printable(text: str) -> str:
    """`text` with control and other non-printable characters escaped (`\\x1b`, `\\n`), never sent raw: the one
    escaping of every string that comes from a file (names, reasons, metadata, messages) before it is shown."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class UsageError(ClipcliError):
    """A command line that cannot mean what it says, found once the checkpoint is open (exit 2).

    `param` names the option at fault, if one is.
    """

    status = ExitStatus.USAGE

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None, param: str | None = None):
        super().__init__(message, path)
        self.param = param


class InputError(ClipcliError):
    """The input cannot be read as a checkpoint (exit 3)."""

    status = ExitStatus.BAD_INPUT


class MissingFileError(InputError):
    """The input path does not exist or cannot be opened."""


class FileTypeError(InputError):
    """The file is not what its name says (an LFS pointer, an HTML page, a pickle, ...)."""


class MalformedError(InputError):
    """The file claims the right format but breaks its rules."""


class UnsafePickleError(MalformedError):
    """A pickle asks for a global or an opcode that would run code; clipcli never runs it."""


class UnsupportedError(InputError):
    """A dtype or a conversion clipcli cannot carry out without losing information."""


class WriteError(ClipcliError):
    """The output could not be written, or writing it would destroy the input (exit 4)."""

    status = ExitStatus.WRITE_FAILED


class CheckFailedError(ClipcliError):
    """A check the user asked for failed, or a clip needs a finite norm (exit 1)."""

    status = ExitStatus.CHECK_FAILED
