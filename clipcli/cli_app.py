"""The `clipcli` app and what every command shares: its errors mapped to exit statuses, gates, workers, selections.

The commands register on `app` in `cli_commands` and `cli_trust`; `cli.main` runs it."""

# No `from __future__ import annotations` here: Typer reads the commands' annotations at every run, and
# as strings it would evaluate each of them (450 evals, a tenth of the 10,000-tiny-tensor run's start-up).

import contextlib
import copy
import errno
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Annotated, Any, NoReturn

import typer
import typer.main

from clipcli import cli_options as opts
from clipcli._stops import defer_stops, stop_status
from clipcli.cli_output import lost_reports as _lost_reports
from clipcli.errors import ClipcliError, ExitStatus, Terminated, printable

app = typer.Typer(
    name="clipcli",
    cls=opts.Group,
    help="Inspect checkpoint tensors, report their norms, and clip them exactly as TensorFlow does.",
    no_args_is_help=True,
    add_completion=False,  # ours take a SHELL (`opts.completion_option`): Typer's gave bash's script for zsh
    pretty_exceptions_show_locals=False,  # a crash must never dump tensors
    rich_markup_mode=None,  # plain help and usage errors: rich is imported only to draw a report
    context_settings={"help_option_names": ["-h", "--help"]},
)

typer.completion.completion_init()  # the shells the completion scripts call back with (add_completion did it)


def app_for(args: list[str]) -> typer.Typer:
    """The app with only the command that `args` name registered; the whole app when they name none (no
    arguments, an option first, a name that is no command) or the shell's completion is at work.

    Typer builds every registered command's Click parameters from its signature at each run: a tenth of the
    start-up of a run over 10,000 tiny tensors, where the command that runs is the only one it needs.
    """
    if not args or os.environ.get("_CLIPCLI_COMPLETE"):
        return app
    named = [c for c in app.registered_commands if _command_name(c) == args[0]]
    if len(named) != 1:
        return app
    one = copy.copy(app)
    one.registered_commands = named
    return one


def _command_name(info: Any) -> str:
    return info.name or typer.main.get_command_name(info.callback.__name__)  # as Typer names it


ISSUES_URL = "https://github.com/clipcli/clipcli/issues"


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=opts.show_version, is_eager=True, help="Show the version and exit.")
    ] = False,
    install_completion: Annotated[str | None, opts.completion_option("--install-completion", "Install")] = None,
    show_completion: Annotated[str | None, opts.completion_option("--show-completion", "Show")] = None,
) -> None:
    """Inspect checkpoint tensors, report their norms, and clip them exactly as TensorFlow does.

    Exit status: 0 success, 1 a check failed (a --fail-* gate, a clip whose norm is not finite, a defect or
    difference verify found), 2 usage error, 3 unreadable input, 4 output or report not written, 70 internal
    error; Ctrl-C and SIGTERM end it by the signal (130, 143 in a shell).
    """


# --- Error handling ---------------------------------------------------------------------------------


def _fail(message: str, status: int) -> NoReturn:
    typer.echo(f"clipcli: error: {printable(message)}", err=True)
    raise typer.Exit(status)


def _stopped(status: ExitStatus) -> NoReturn:
    typer.echo("clipcli: interrupted" if status == ExitStatus.INTERRUPTED else "clipcli: terminated", err=True)
    raise typer.Exit(status)


@contextlib.contextmanager
def handled_errors(debug: bool, command: str, writes: bool = False) -> Iterator[None]:
    """Maps clipcli's errors to one stderr line and their exit status; anything else is a bug (70).

    `command`: the module of `clipcli.commands` the command runs, imported first (`_import_command`); `writes`:
    whether it writes files (then --fail-unsafe-pickle fails before any output, else after the report).
    """
    try:
        _import_command(command)
        _lost_reports.clear()
        with _pickles_vetted(before_output=writes):
            yield
        if _lost_reports:  # no gate failed: the lost report is the outcome
            raise _lost_reports.pop()
    except KeyboardInterrupt:
        _stopped(ExitStatus.INTERRUPTED)
    except Terminated:
        _stopped(ExitStatus.TERMINATED)
    except Exception as e:
        status = stop_status()
        if status is not None:  # a stop's exception turned into another on its way (NumPy's import: an ImportError)
            _stopped(status)
        # A failed gate decides the status; a report lost meanwhile is said too, unless nobody was to read it (a
        # reader gone, `| head`; stdout closed on purpose, `>&-`).
        lost = [r for r in _lost_reports if getattr(r.__cause__, "errno", None) not in (None, errno.EBADF)]
        if lost and getattr(e, "status", None) == ExitStatus.CHECK_FAILED:
            typer.echo(f"clipcli: warning: {printable(str(lost[0]))}", err=True)
        _failed(e, debug)
    finally:
        opts.UNSAFE_PICKLE_GATE.clear()


@contextlib.contextmanager
def _pickles_vetted(before_output: bool) -> Iterator[None]:
    """Warns once per file whose pickle would call a global outside torch's weights-only allowlist, as each
    checkpoint opens; with --fail-unsafe-pickle, fails (exit 1): `before_output`, there, before any output is
    made (a command that writes files); else once the command is done, its report (which carries the audit)
    out, ahead of the command's own gates (a vetting step gets the report, then the status)."""
    from clipcli.checkpoint.reader import OPEN_HOOKS
    from clipcli.errors import CheckFailedError, shown_path

    seen: set[str] = set()
    failed: list[tuple[str, str]] = []  # (file, what would call what) of each unsafe file, for the gate's line

    def gate() -> CheckFailedError:
        """The gate's one line: every unsafe file with its calls (as its warning has them), the first as the
        line's file."""
        others = "".join(f"; {printable(shown_path(file))}: {printable(calls)}" for file, calls in failed[1:])
        return CheckFailedError(f"{printable(failed[0][1])}{others} (--fail-unsafe-pickle)", failed[0][0])

    def vet(ckpt: Any) -> None:
        for audit in ckpt.pickle_audits:
            if audit.unsafe_calls and audit.file not in seen:
                seen.add(audit.file)
                calls = f"{audit.loader} would call {', '.join(audit.unsafe_calls)}"
                typer.echo(
                    f"clipcli: warning: {printable(f'{shown_path(audit.file)}: {calls}')} (never called here)", err=True
                )
                if any(opts.UNSAFE_PICKLE_GATE):
                    failed.append((audit.file, calls))
                    if before_output and not _OPENING_SEVERAL:
                        raise gate()

    OPEN_HOOKS.append(vet)
    _VETTED[:] = [lambda: failed and gate()]
    try:
        yield
    except CheckFailedError:  # another gate failed after the report: the unsafe pickle is the line to show
        if failed:
            raise gate() from None
        raise
    finally:
        OPEN_HOOKS.remove(vet)
        _VETTED.clear()
    if failed:
        raise gate()


_OPENING_SEVERAL: list[bool] = []  # a writer opens its inputs (`opening_several`): its gate waits for the last
_VETTED: list[Any] = []  # the gate's failure of the command running, if any (`_pickles_vetted`)


@contextlib.contextmanager
def opening_several() -> Iterator[None]:
    """For a writing command that opens several checkpoints before any output: --fail-unsafe-pickle fails once
    they are all open, naming every unsafe file (as a reading command's gate does), not at the first."""
    _OPENING_SEVERAL.append(True)
    try:
        yield
    finally:
        _OPENING_SEVERAL.pop()
    failure = _VETTED[0]() if _VETTED else None
    if failure:
        raise failure


def _import_command(command: str) -> None:
    """Imports a command's module, and NumPy with it, with stops held until the import is done: a
    KeyboardInterrupt raised inside NumPy's import comes out as an ImportError after NumPy's C code printed its
    traceback."""
    resume = defer_stops()
    try:
        importlib.import_module(f"clipcli.commands.{command}")
    finally:
        resume()


def _failed(e: Exception, debug: bool) -> NoReturn:
    """Called in the `except` of `e`: its one line and exit status, or Click's usage block for a usage error
    that names its option (a usage error found in the checkpoint, such as nothing to clip, is one line)."""
    if isinstance(e, BrokenPipeError):
        # The reader of stdout went away (`clipcli ... | head`): not an error of ours.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(ExitStatus.OK) from None
    if type(e).__module__.split(".")[0] in ("typer", "click"):
        raise  # Typer's own exits and usage errors
    if debug:  # the traceback, then the same line and status as without --debug
        import traceback

        traceback.print_exception(e)
    if isinstance(e, ClipcliError):
        if e.status == ExitStatus.USAGE and getattr(e, "param", None):
            raise typer.BadParameter(str(e), param_hint=e.param) from None
        _fail(str(e), e.status)
    detail = " ".join(f"{type(e).__name__}: {e}".split())
    _fail(
        f"internal error ({detail}); this is a bug, please report it at {ISSUES_URL} with the output of --debug",
        ExitStatus.INTERNAL,
    )


def exit_on_gate(failure: str | None) -> None:
    """Exits 1 with the line of a failed gate (after the report is out)."""
    if failure is not None:
        from clipcli.errors import CheckFailedError

        raise CheckFailedError(failure)


def worker_count(jobs: int | None) -> int:
    from clipcli.commands.passes import workers

    return workers(jobs)


def selection_of(include: list[str] | None, exclude: list[str] | None, *ckpts: Any) -> Any:
    """The --include/--exclude selection; warns on stderr of a pattern that matches no tensor of `ckpts`.

    (A selection left empty is refused later, by the command, with a usage error instead.)
    """
    from clipcli.commands.select import Selection

    selection = Selection(tuple(include or ()), tuple(exclude or ()))
    if (include or exclude) and any(selection.listed(t) for c in ckpts for t in c.tensors):
        for option in selection.unmatched(*ckpts):
            typer.echo(f"clipcli: warning: {option} matches no tensor", err=True)
    return selection
