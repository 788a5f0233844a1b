"""The exit statuses and the one exception hierarchy of clipcli; standard library only."""

from __future__ import annotations

import enum
import os
import re


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


def split_query(url: str) -> tuple[str, str]:
    """An `http(s)://` URL without its query and fragment, and its query (`?...`, or ""): the query (a presigned
    URL's signature, a token) goes with each request and is never shown; the fragment is not sent, as by curl."""
    base, _, query = url.partition("#")[0].partition("?")
    return base, f"?{query}" if query else ""


def shown_path(path: str) -> str:
    """A path as it can be typed back: a relative one starting with '-' (typed `./-x.safetensors`, which pathlib
    shortens to `-x.safetensors`) gets its './' again, so that a command line does not take it for an option; a
    URL, which pathlib shortens to `https:/host/...`, its `//` again; an `http(s)://` URL without its query (a
    credential: `split_query`)."""
    if ":/" in path:  # a URL, or one pathlib shortened (the patterns are compiled at the first such path)
        if re.match(_HTTP_URL, path):
            return split_query(path)[0]
        url = re.match(_PATH_OF_URL, path)
        if url:
            return f"{url.group(1)}/{path[url.end() :]}"
    return f"./{path}" if path.startswith("-") and path != "-" else path


# a scheme of one letter would be a Windows drive; `file:/tmp/a` is a file URL as it is
_PATH_OF_URL = r"(?![Ff][Ii][Ll][Ee]:)([A-Za-z][A-Za-z0-9+.-]+:/)(?!/)"
_HTTP_URL = r"[Hh][Tt][Tt][Pp][Ss]?://"


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
