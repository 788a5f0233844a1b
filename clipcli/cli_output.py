"""The command line's output: the report on stdout (in the terminal's encoding, or UTF-8 for programs), its
JSON in a file, the progress bar on stderr."""

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from clipcli.cli_options import Format

PROGRESS_MIN_BYTES = 256 << 20


def is_terminal(stream: Any) -> bool:
    return stream.isatty()


@contextlib.contextmanager
def progress(total: int, quiet: bool) -> Iterator[Any]:
    """A progress bar on stderr for long work, only when stderr is a terminal; it names each pass."""
    from clipcli.commands.passes import Progress

    if quiet or total < PROGRESS_MIN_BYTES or not is_terminal(sys.stderr):
        yield Progress()
        return
    from clipcli.report.progress import progress_bar

    with progress_bar(sys.stderr) as bar:
        yield bar


def write(text: str, for_programs: bool) -> None:
    """The report on stdout: JSON and CSV as UTF-8 whatever the locale (RFC 8259), the table in the
    terminal's encoding with what it cannot show escaped (a bar, a name, under cp1252 or ASCII)."""
    if sys.stdout is None:  # started with it closed (`>&-`, a daemon): Python gives no stream
        raise OSError(errno.EBADF, "closed")
    buffer = getattr(sys.stdout, "buffer", None)
    if for_programs and buffer is not None:
        sys.stdout.flush()
        buffer.write(text.encode("utf-8"))
        buffer.flush()
        return
    if not for_programs and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    sys.stdout.write(text)
    sys.stdout.flush()


lost_reports: list[Exception] = []  # a report `_emit` could not write, raised once the command's gates passed


def emit(report: Any, fmt: Format, quiet: bool, report_file: Path | None = None) -> None:
    """The report on stdout in `fmt` (unless `quiet`), and as JSON in `report_file`."""
    if report_file is not None:
        from clipcli.checkpoint.atomic import atomic_write

        with atomic_write(report_file) as f:
            f.write(report.to_json().encode("utf-8"))
    if quiet:
        return
    for_programs = fmt in (Format.json, Format.csv)
    if for_programs:
        text = report.to_json() if fmt is Format.json else report.to_csv()
    else:
        text = report.to_text(getattr(sys.stdout, "encoding", None) or "utf-8")
    try:
        write(text, for_programs)
    except OSError as e:  # a full disk under `> norms.json`, a reader gone: the report, not the checkpoint, is lost
        from clipcli.errors import WriteError

        with contextlib.suppress(OSError, AttributeError):  # what stays buffered must not fail again at exit (120)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        # The command's gates still decide first (a CI job must see a failed gate, `... --fail-above 1 | head`
        # too); `cli._errors` then says the report was lost.
        lost = WriteError(f"cannot write the report: {e.strerror or e}", "standard output")
        lost.__cause__ = e
        lost_reports.append(e if isinstance(e, BrokenPipeError) else lost)
