"""Stop signals (Ctrl-C, SIGTERM): the one place that installs their handlers, and the state they share."""

from __future__ import annotations

import os
import signal
import sys

from clipcli.errors import ExitStatus, Terminated

# typing.TYPE_CHECKING without importing typing, which is a third of what runs before `__main__` installs the
# stop handlers (a stop until then is Python's: a traceback)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn

STOPS = (signal.SIGINT, signal.SIGTERM)

_received: list[int] = []  # the stop signals received (SIGINT, SIGTERM), first first
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
    _received.append(signum)
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
    for signum in STOPS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, stop)
    if not getattr(sys.unraisablehook, "quiet_stops", False):
        sys.unraisablehook = _quiet_stops(sys.unraisablehook)


def _quiet_stops(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """Python's hook for an exception it swallows (raised in a `__del__`, a weakref callback of the import
    machinery), without its "Exception ignored" traceback for a stop's: that one is remembered in `_received`
    and ends the command all the same."""

    def unraisable(unraisable: Any) -> None:
        if not (_received and isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated))):
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
        for signum in STOPS:
            signal.signal(signum, signal.SIG_IGN)


def stop_status() -> ExitStatus | None:
    """The exit status of the first stop signal received, or None."""
    if not _received:
        return None
    return ExitStatus.INTERRUPTED if _received[0] == signal.SIGINT else ExitStatus.TERMINATED


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


class StopsHeld:
    """Holds Ctrl-C and SIGTERM back while forking: the interpreter's after-fork hooks swallow the
    exception a handler raises in them (the clip would go on); held, the signal arrives just after,
    where it stops the command."""

    def __enter__(self) -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)

    def __exit__(self, *exc: object) -> None:
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def ignore_in_worker() -> None:  # pragma: no cover (in a worker)
    """In a forked worker: Ctrl-C and SIGTERM are the parent's to handle."""
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN)
