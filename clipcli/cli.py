"""The `clipcli` command: parse options, call the layers below, map errors to exit statuses."""

# No `from __future__ import annotations` here: Typer reads the commands' annotations at every run, and
# as strings it would evaluate each of them (450 evals, a tenth of the 10,000-tiny-tensor run's start-up).

import contextlib
import errno
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from clipcli import __version__
from clipcli.errors import (
    ClipcliError,
    ExitStatus,
    Terminated,
    defer_stops,
    exit_stopped,
    ignore_stops_if_committed,
    install_stop_handlers,
    printable,
    stop_status,
)

if TYPE_CHECKING:
    from clipcli.report import CheckpointReport


class _Command(typer.core.TyperCommand):
    """Usage lines name arguments as words (`CKPT...`), without Typer's braces around required ones."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class _Group(typer.core.TyperGroup):
    """`--show-completion [SHELL]` and `--install-completion [SHELL]`: an option's value that may be left out,
    which Typer's parser cannot say (Typer's own options are flags that ignore a shell named after them)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args[:1] in (["--show-completion"], ["--install-completion"]) and args[1:2] in ([], ["-h"], ["--help"]):
            args = [args[0], "", *args[1:]]  # no SHELL: the current shell
        return super().parse_args(ctx, args)


app = typer.Typer(
    name="clipcli",
    cls=_Group,
    help="Inspect checkpoint tensors, report their norms, and clip them exactly as TensorFlow does.",
    no_args_is_help=True,
    add_completion=False,  # ours take a SHELL (`_completion`): Typer's gave bash's script for `--show-completion zsh`
    pretty_exceptions_show_locals=False,  # a crash must never dump tensors
    rich_markup_mode=None,  # plain help and usage errors: rich is imported only to draw a report
    context_settings={"help_option_names": ["-h", "--help"]},
)

typer.completion.completion_init()  # the shells the completion scripts call back with (add_completion did it)

ISSUES_URL = "https://github.com/clipcli/clipcli/issues"
PROGRESS_MIN_BYTES = 256 << 20


class Format(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


class SortKey(str, Enum):
    name = "name"
    norm = "norm"
    size = "size"


class InspectSortKey(str, Enum):
    name = "name"
    size = "size"


class DiffSortKey(str, Enum):
    name = "name"
    norm = "norm"
    size = "size"
    diff = "diff"
    rel = "rel"


def _version(value: bool) -> None:
    if value:
        # Whether the install compiled clipcli/_fused.c: found without importing NumPy, which it needs.
        built = importlib.util.find_spec("clipcli._fused") is not None
        typer.echo(f"clipcli {__version__} ({'compiled loops' if built else 'no compiled loops: NumPy and BLAS'})")
        raise typer.Exit()


def _completion(ctx: typer.Context, param: Any, value: str | None) -> None:
    """--show-completion [SHELL] and --install-completion [SHELL]: Typer's own, for SHELL or, without one, for
    the shell clipcli runs in."""
    if value is None or ctx.resilient_parsing:
        return
    from typer import completion

    callback = completion.show_callback if param.name == "show_completion" else completion.install_callback
    callback(ctx, param, value or True)  # True: Typer finds the current shell


def _completion_option(name: str, what: str) -> Any:
    return typer.Option(
        name,
        metavar="[SHELL]",
        callback=_completion,
        is_eager=True,
        expose_value=False,
        help=f"{what} completion for SHELL (bash, zsh, fish, powershell, pwsh; default: the current shell).",
    )


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
    install_completion: Annotated[str | None, _completion_option("--install-completion", "Install")] = None,
    show_completion: Annotated[str | None, _completion_option("--show-completion", "Show")] = None,
) -> None:
    """Inspect checkpoint tensors, report their norms, and clip them exactly as TensorFlow does.

    Exit status: 0 success, 1 a check failed (--fail-above, --fail-nonfinite, a clip whose norm is not
    finite), 2 usage error, 3 unreadable input, 4 output or report not written, 70 internal error; Ctrl-C and
    SIGTERM end it by the signal (130, 143 in a shell).
    """


# --- Option types shared by the commands ------------------------------------------------------------


def _path(text: str) -> Path:
    """A checkpoint's path as given. Not Click's Path type, which refuses a file it cannot read as a usage error
    (exit 2; the contract: exit 3, one line), and takes an empty path for the current directory."""
    if not text:
        raise typer.BadParameter("an empty path names no file")
    return Path(text)


def _report_path(text: str) -> Path:
    """--report FILE. `-` is refused as `-o -` is: the JSON on stdout is `--format json`, and a second way there
    would need rules for `--format csv --report -` or `--quiet --report -`."""
    if text == "-":
        raise typer.BadParameter(
            "clipcli writes the report to a file, not standard output; for JSON on standard output use --format json"
        )
    return _path(text)


Checkpoints = Annotated[
    list[Path],
    typer.Argument(
        metavar="CKPT...",
        parser=_path,
        help="Checkpoints: .safetensors, .npz, .npy or PyTorch (.pt, .pth, .bin, .ckpt) files, sharded indexes "
        "(*.safetensors.index.json, pytorch_model.bin.index.json), or directories (shards, or a "
        "torch.distributed.checkpoint).",
        show_default=False,
    ),
]
OneCheckpoint = Annotated[
    Path,
    typer.Argument(
        metavar="CKPT",
        parser=_path,
        help="The checkpoint to clip (a .safetensors, .npz, .npy or PyTorch file, a sharded index or directory).",
        show_default=False,
    ),
]
Include = Annotated[
    list[str] | None,
    typer.Option(
        "--include",
        metavar="GLOB",
        help="Only tensors whose names match (repeatable; fnmatch syntax, e.g. 'model.layers.*.mlp.*').",
    ),
]
Exclude = Annotated[
    list[str] | None,
    typer.Option("--exclude", metavar="GLOB", help="Leave out tensors whose names match (repeatable)."),
]
FormatOpt = Annotated[Format, typer.Option("--format", metavar="FORMAT", help="Report format: table, json or csv.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No report on stdout; errors still go to stderr.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
Sort = Annotated[
    SortKey | None,
    typer.Option("--sort", metavar="KEY", help="Order the rows by name, norm or size (norm and size: largest first)."),
]
Ord = Annotated[str, typer.Option("--ord", metavar="P", help="The norms' order: 2, 1, inf or any p in (0, 1e15].")]
Depth = Annotated[
    int | None,
    typer.Option(
        "--depth", min=1, metavar="N", help="Also group tensors by the first N dot-separated parts of their names."
    ),
]
InspectSort = Annotated[
    InspectSortKey | None,
    typer.Option("--sort", metavar="KEY", help="Order the rows by name or size (size: largest first)."),
]
Top = Annotated[
    int | None,
    typer.Option("--top", min=1, metavar="K", help="Show only the first K rows (the summary still covers all)."),
]
Output = Annotated[
    str | None,
    typer.Option(
        "--output",
        "-o",
        metavar="OUT",
        help="Where to write: a .safetensors/.npz/.npy file (the suffix "
        "picks the format) or, for sharded safetensors, a directory.",
    ),
]
InPlace = Annotated[bool, typer.Option("--in-place", help="Replace the input (atomically) instead of -o.")]
DropMetadata = Annotated[
    bool,
    typer.Option(
        "--drop-metadata",
        help="Write no metadata (an .npz or .npy has no place for it; without this, a checkpoint with metadata "
        "is refused there).",
    ),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Compute and report, write nothing.")]
ReportFile = Annotated[
    Path | None,
    typer.Option("--report", metavar="FILE", parser=_report_path, help="Also write the report as JSON to FILE."),
]
Jobs = Annotated[
    int | None,
    typer.Option(
        "--jobs", "-j", min=1, metavar="N", help="Workers reading and computing (default and most: the cores)."
    ),
]
AllowNonfinite = Annotated[
    bool,
    typer.Option(
        "--allow-nonfinite",
        help="Clip even when a norm is NaN or Inf, giving NaN outputs as TensorFlow does (default: refuse, exit 1).",
    ),
]


def _examples(*lines: str) -> str:
    """A help epilog of examples, kept as written (Click rewraps other paragraphs)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


# --- Error handling ---------------------------------------------------------------------------------


def _fail(message: str, status: int) -> NoReturn:
    typer.echo(f"clipcli: error: {printable(message)}", err=True)
    raise typer.Exit(status)


def _stopped(status: ExitStatus) -> NoReturn:
    typer.echo("clipcli: interrupted" if status == ExitStatus.INTERRUPTED else "clipcli: terminated", err=True)
    raise typer.Exit(status)


@contextlib.contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """Maps clipcli's errors to one stderr line and their exit status; anything else is a bug (70)."""
    try:
        _import_commands()
        _lost_reports.clear()
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
        _failed(e, debug)


def _import_commands() -> None:
    """Imports the commands, and NumPy with them, with stops held until the import is done: a KeyboardInterrupt
    raised inside NumPy's import comes out as an ImportError after NumPy's C code printed its traceback."""
    resume = defer_stops()
    try:
        import clipcli.commands  # noqa: F401
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
    if debug or type(e).__module__.split(".")[0] in ("typer", "click"):
        raise  # Typer's own exits and usage errors
    if isinstance(e, ClipcliError):
        if e.status == ExitStatus.USAGE and getattr(e, "param", None):
            raise typer.BadParameter(str(e), param_hint=e.param) from None
        _fail(str(e), e.status)
    detail = " ".join(f"{type(e).__name__}: {e}".split())
    _fail(
        f"internal error ({detail}); this is a bug, please report it at {ISSUES_URL} with the output of --debug",
        ExitStatus.INTERNAL,
    )


def _usage(message: str, param: str) -> NoReturn:
    raise typer.BadParameter(message, param_hint=param)


def _parse_float(text: str, param: str) -> float:
    try:
        value = float(text)
    except ValueError:
        _usage(f"{text!r} is not a number", param)
    if math.isnan(value):
        _usage("must be a number, not NaN", param)
    return value


def _parse_limit(text: str, param: str) -> float:
    """A gate's threshold: a number >= 0 (inf allowed: only a figure that is not finite fails)."""
    value = _parse_float(text, param)
    if value < 0:
        _usage(f"must be a number >= 0 (a norm is never negative), got {text}", param)
    return value


def _over(value: float, limit: float) -> bool:
    """Whether a gate fails: the figure is above its threshold, or not a finite number (the spec), even under inf."""
    return not (math.isfinite(value) and value <= limit)


def _positive_finite(value: float, text: str, param: str) -> None:
    if not (math.isfinite(value) and value > 0):
        _usage(f"must be a finite number > 0, got {text}", param)


def _parse_ord(text: str) -> float:
    if text.lower() in ("inf", "infinity"):
        return math.inf
    from clipcli.core import MAX_ORDER

    value = _parse_float(text, "--ord")
    if not value > 0:
        _usage(f"must be 1, 2, inf or any p > 0, got {text}", "--ord")
    if value > MAX_ORDER:
        message = f"orders above {MAX_ORDER:g} are not supported (the norm is then the largest magnitude: --ord inf)"
        message += f", got {text}"
        _usage(message, "--ord")
    return value


def _parse_axes(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        axes = tuple(int(part) for part in text.split(","))
    except ValueError:
        _usage(f"must be comma-separated integers such as 0,1 or -1, got {text!r}", "--axes")
    if len(set(axes)) != len(axes):
        _usage(f"names an axis twice: {text}", "--axes")
    return axes


# --- Output -----------------------------------------------------------------------------------------


def _is_terminal(stream: Any) -> bool:
    return stream.isatty()


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Any]:
    """A progress bar on stderr for long work, only when stderr is a terminal; it names each pass."""
    from clipcli.commands import Progress

    if quiet or total < PROGRESS_MIN_BYTES or not _is_terminal(sys.stderr):
        yield Progress()
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    from rich.progress import Progress as RichProgress

    console = Console(file=sys.stderr, no_color="NO_COLOR" in os.environ, highlight=False, markup=False)
    with RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    ) as bar:

        class Bar(Progress):
            task: Any = None

            def phase(self, label: str, total: int) -> None:
                if self.task is not None:
                    bar.remove_task(self.task)
                self.task = bar.add_task(label, total=total)

            def advance(self, n: int) -> None:
                bar.advance(self.task, n)

        yield Bar()


def _write(text: str, for_programs: bool) -> None:
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


_lost_reports: list[Exception] = []  # a report `_emit` could not write, raised once the command's gates passed


def _emit(
    command: str,
    p: float,
    reports: list["CheckpointReport"],
    fmt: Format,
    quiet: bool,
    report_file: Path | None = None,
    diff: Any = None,
) -> None:
    from clipcli import report as render
    from clipcli.checkpoint.atomic import atomic_write

    rep = render.Report(command, p, tuple(reports), diff)
    if report_file is not None:
        with atomic_write(report_file) as f:
            f.write(render.to_json(rep).encode("utf-8"))
    if quiet:
        return
    for_programs = fmt in (Format.json, Format.csv)
    if for_programs:
        text = render.to_json(rep) if fmt is Format.json else render.to_csv(rep)
    else:
        text = render.render_text(rep, getattr(sys.stdout, "encoding", None) or "utf-8")
    try:
        _write(text, for_programs)
    except OSError as e:  # a full disk under `> norms.json`, a reader gone: the report, not the checkpoint, is lost
        from clipcli.errors import WriteError

        with contextlib.suppress(OSError, AttributeError):  # what stays buffered must not fail again at exit (120)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        # The command's gates still decide first (a CI job must see a failed gate, `... --fail-above 1 | head`
        # too); `_errors` then says the report was lost.
        lost = WriteError(f"cannot write the report: {e.strerror or e}", "standard output")
        lost.__cause__ = e
        _lost_reports.append(e if isinstance(e, BrokenPipeError) else lost)


def _jobs(jobs: int | None) -> int:
    """--jobs, or the cores this process may run on: never more workers than cores (more would only
    contend for them, and each takes memory)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(jobs, cores) if jobs else cores


def _selection(include: list[str] | None, exclude: list[str] | None, *ckpts: Any) -> Any:
    """The --include/--exclude selection; warns on stderr of a pattern that matches no tensor of `ckpts`.

    (A selection left empty is refused later, by the command, with a usage error instead.)
    """
    from clipcli.commands import Selection

    selection = Selection(tuple(include or ()), tuple(exclude or ()))
    if any(selection.listed(t) for c in ckpts for t in c.tensors):
        for option in selection.unmatched(*ckpts):
            typer.echo(f"clipcli: warning: {option} matches no tensor", err=True)
    return selection


# --- Commands ---------------------------------------------------------------------------------------


@app.command(
    cls=_Command,
    epilog=_examples(
        "clipcli inspect model.safetensors",
        "clipcli inspect shards/ --sort size --top 10",
        "clipcli inspect optimizer.npz --include 'state.*' --format json",
    ),
)
def inspect(
    checkpoints: Checkpoints,
    sort: InspectSort = None,
    top: Top = None,
    include: Include = None,
    exclude: Exclude = None,
    fmt: FormatOpt = Format.table,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """List tensor names, dtypes, shapes, element counts, sizes and the file's metadata, from the headers."""
    with _errors(debug):
        from clipcli import commands
        from clipcli.checkpoint import open_checkpoint

        opened = [open_checkpoint(path) for path in checkpoints]
        selection = _selection(include, exclude, *opened)
        reports = []
        for ckpt in opened:
            with ckpt:
                reports.append(commands.inspect(ckpt, selection, sort and sort.value, top))
        _emit("inspect", 2.0, reports, fmt, quiet)


@app.command(
    "global-norm",
    cls=_Command,
    epilog=_examples(
        "clipcli global-norm grads.safetensors --sort norm --top 10",
        "clipcli global-norm grads.safetensors --depth 3 --format csv > layers.csv",
        "clipcli global-norm grads.safetensors --fail-above 100 --fail-nonfinite --quiet",
    ),
)
def global_norm(
    checkpoints: Checkpoints,
    ord: Ord = "2",
    depth: Depth = None,
    sort: Sort = None,
    top: Top = None,
    fail_above: Annotated[
        str | None,
        typer.Option("--fail-above", metavar="X", help="Exit 1 if a global norm exceeds X or is not finite."),
    ] = None,
    fail_nonfinite: Annotated[
        bool, typer.Option("--fail-nonfinite", help="Exit 1 if a selected tensor holds NaN or Inf.")
    ] = False,
    jobs: Jobs = None,
    include: Include = None,
    exclude: Exclude = None,
    fmt: FormatOpt = Format.table,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Per-tensor norms, max |x|, NaN/Inf counts and shares, and the global norm (tf.linalg.global_norm).

    A gate (--fail-above, --fail-nonfinite) never passes because nothing was measured: a checkpoint with no
    floating tensor selected is a usage error (exit 2) when a gate is given.
    """
    with _errors(debug):  # --ord's limit comes from the core, which imports NumPy: under `_errors`
        p = _parse_ord(ord)
        limit = None if fail_above is None else _parse_limit(fail_above, "--fail-above")
        gated = limit is not None or fail_nonfinite
        from clipcli import commands
        from clipcli.checkpoint import open_checkpoint
        from clipcli.errors import CheckFailedError, UsageError

        opened = [open_checkpoint(path) for path in checkpoints]
        selection = _selection(include, exclude, *opened)
        total = sum(t.nbytes for c in opened for t in c.tensors)
        reports = []
        with _progress(total, quiet) as progress:
            for ckpt in opened:
                with ckpt:
                    sort_key = sort and sort.value
                    report = commands.global_norm(ckpt, selection, p, depth, sort_key, top, progress, _jobs(jobs))
                    if gated and not report.summary.tensors:
                        gate = "--fail-above" if limit is not None else "--fail-nonfinite"
                        message = "no floating tensor is selected, so the gate has nothing to check"
                        raise UsageError(message, ckpt.path, gate)
                    reports.append(report)
        _emit("global-norm", p, reports, fmt, quiet)
        failures: list[CheckFailedError] = []  # every checkpoint that fails a gate, named in one line
        for r in reports:
            try:
                if fail_nonfinite:
                    commands.check_nonfinite(r.path, r.summary.nonfinite)
                if limit is not None and _over(r.global_norm, limit):
                    raise CheckFailedError(_exceeds("global norm", r.global_norm, "--fail-above", fail_above), r.path)
            except CheckFailedError as e:
                failures.append(e)
        if len(failures) == 1:
            raise failures[0]
        if failures:
            listed = "; ".join(map(str, failures))
            raise CheckFailedError(f"{len(failures)} of {len(reports)} checkpoints fail their gates: {listed}")


def _exceeds(what: str, value: float, gate: str, limit: str) -> str:
    """'global norm 6.1 exceeds --fail-above 1', or 'global norm is nan, not finite (--fail-above 1)'."""
    if math.isfinite(value):
        return f"{what} {value!r} exceeds {gate} {limit}"
    return f"{what} is {value!r}, not finite ({gate} {limit})"


def _clip(ctx: typer.Context, run: Callable[..., "CheckpointReport"], passes: int = 2) -> None:
    """The part the clip commands share, from their parsed options (`ctx.params`, by parameter name).

    `passes`: how many times the command reads the checkpoint, for the progress bar.
    """
    from clipcli import commands
    from clipcli.checkpoint import check_output, check_plan, check_report, open_checkpoint

    o = ctx.params  # Click's values: paths may be strings, enums their values
    in_place, dry_run = o["in_place"], o["dry_run"]
    if in_place and o["output"] is not None:
        _usage("give either -o/--output or --in-place, not both", "--in-place")
    if o["output"] is None and not (in_place or dry_run):
        _usage("missing; give -o OUT, --in-place or --dry-run", "-o/--output")
    with open_checkpoint(Path(o["checkpoint"])) as ckpt:
        if o["drop_metadata"]:
            ckpt.metadata = {}
        target = None
        if not dry_run or in_place or o["output"] is not None:
            param = "--in-place" if in_place else "-o"
            target = check_output(ckpt.path if in_place else o["output"], ckpt, param=param)
        if dry_run and target is not None:
            check_plan(ckpt, target, in_place)  # what the write would refuse, refused on a dry run too
            target = None
        if o["report_file"] is not None:
            check_report(o["report_file"], ckpt, target)
        job = commands.ClipJob(
            target,
            in_place,
            o.get("allow_nonfinite", False),
            _jobs(o["jobs"]),
            getattr(o["sort"], "value", o["sort"]),
            o["top"],
        )
        with _progress(passes * sum(t.nbytes for t in ckpt.tensors), o["quiet"]) as progress:
            result = run(ckpt, _selection(o["include"], o["exclude"], ckpt), job, progress=progress)
    report = None if o["report_file"] is None else Path(o["report_file"])
    _emit(ctx.info_name or "", 2.0, [result], Format(o["fmt"]), o["quiet"], report)


@app.command(
    "clip-value",
    cls=_Command,
    epilog=_examples(
        "clipcli clip-value grads.safetensors -o clipped.safetensors --min -1 --max 1",
        "clipcli clip-value grads.npz -o clipped.npz --min -0.01 --max 0.01 --include 'model.norm.*'",
        "clipcli clip-value grads.safetensors --in-place --min -5 --max 5 --quiet",
    ),
)
def clip_value(
    ctx: typer.Context,
    checkpoint: OneCheckpoint,
    min_: Annotated[
        str,
        typer.Option(
            "--min",
            metavar="A",
            show_default=False,
            help="Lower bound, rounded to each tensor's dtype as TensorFlow does (bfloat16 0.1 is 0.10009765625).",
        ),
    ],
    max_: Annotated[
        str,
        typer.Option(
            "--max", metavar="B", show_default=False, help="Upper bound, rounded to each tensor's dtype likewise."
        ),
    ],
    output: Output = None,
    in_place: InPlace = False,
    dry_run: DryRun = False,
    drop_metadata: DropMetadata = False,
    report_file: ReportFile = None,
    sort: Sort = None,
    top: Top = None,
    jobs: Jobs = None,
    include: Include = None,
    exclude: Exclude = None,
    fmt: FormatOpt = Format.table,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """tf.clip_by_value on every selected real floating tensor: NaN stays NaN, +-inf is clipped to the bounds.

    --min and --max are rounded to each tensor's dtype first, as TensorFlow does: a bfloat16 tensor
    clipped at 0.1 is clipped at 0.10009765625.
    """
    lo, hi = _parse_float(min_, "--min"), _parse_float(max_, "--max")
    if lo > hi:
        _usage(f"--min {min_} exceeds --max {max_}", "--min")
    with _errors(debug):
        from clipcli import commands

        _clip(ctx, lambda *a, **k: commands.clip_value(*a, lo, hi, **k), passes=1)


@app.command(
    "clip-norm",
    cls=_Command,
    epilog=_examples(
        "clipcli clip-norm grads.safetensors -o clipped.safetensors --clip-norm 1",
        "clipcli clip-norm grads.safetensors -o rows.safetensors --clip-norm 1 --axes -1",
        "clipcli clip-norm grads.safetensors --dry-run --clip-norm 1 --sort norm --top 5",
    ),
)
def clip_norm(
    ctx: typer.Context,
    checkpoint: OneCheckpoint,
    clip_norm: Annotated[
        str,
        typer.Option(
            "--clip-norm",
            metavar="N",
            show_default=False,
            help="The largest L2 norm a tensor (or slice) may keep; > 0.",
        ),
    ],
    axes: Annotated[
        str | None,
        typer.Option(
            "--axes",
            metavar="AXES",
            help="Norm over these axes only, e.g. 0,1 or -1 for per-row norms (default: the whole tensor).",
        ),
    ] = None,
    output: Output = None,
    in_place: InPlace = False,
    dry_run: DryRun = False,
    drop_metadata: DropMetadata = False,
    report_file: ReportFile = None,
    allow_nonfinite: AllowNonfinite = False,
    sort: Sort = None,
    top: Top = None,
    jobs: Jobs = None,
    include: Include = None,
    exclude: Exclude = None,
    fmt: FormatOpt = Format.table,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """tf.clip_by_norm on each selected floating or complex tensor separately, optionally along axes.

    A tensor whose rank is too small for --axes is passed through and listed as skipped.
    """
    c = _parse_float(clip_norm, "--clip-norm")
    _positive_finite(c, clip_norm, "--clip-norm")
    ax = _parse_axes(axes)
    with _errors(debug):
        from clipcli import commands

        _clip(ctx, lambda *a, **k: commands.clip_norm(*a, c, ax, **k))


@app.command(
    "clip-global-norm",
    cls=_Command,
    epilog=_examples(
        "clipcli clip-global-norm grads.safetensors -o clipped.safetensors --clip-norm 5",
        "clipcli clip-global-norm shards/ -o clipped/ --clip-norm 5 --report report.json",
        "clipcli clip-global-norm grads.safetensors --dry-run --clip-norm 5 --format json",
    ),
)
def clip_global_norm(
    ctx: typer.Context,
    checkpoint: OneCheckpoint,
    clip_norm: Annotated[
        str,
        typer.Option(
            "--clip-norm", metavar="N", show_default=False, help="The largest global L2 norm the tensors may keep; > 0."
        ),
    ],
    use_norm: Annotated[
        str | None,
        typer.Option(
            "--use-norm", metavar="G", help="Use G (finite, >= 0) as the global norm instead of computing it."
        ),
    ] = None,
    output: Output = None,
    in_place: InPlace = False,
    dry_run: DryRun = False,
    drop_metadata: DropMetadata = False,
    report_file: ReportFile = None,
    allow_nonfinite: AllowNonfinite = False,
    sort: Sort = None,
    top: Top = None,
    jobs: Jobs = None,
    include: Include = None,
    exclude: Exclude = None,
    fmt: FormatOpt = Format.table,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """tf.clip_by_global_norm over all selected floating and complex tensors together: one common scale.

    Reports the global norm before, the scale applied and the norm after.
    """
    c = _parse_float(clip_norm, "--clip-norm")
    _positive_finite(c, clip_norm, "--clip-norm")
    g = None if use_norm is None else _parse_float(use_norm, "--use-norm")
    if g is not None and not (math.isfinite(g) and g >= 0):
        _usage(f"must be a finite number >= 0, got {use_norm}", "--use-norm")
    with _errors(debug):
        from clipcli import commands

        _clip(ctx, lambda *a, **k: commands.clip_global_norm(*a, c, g, **k))


@app.command(
    cls=_Command,
    epilog=_examples(
        "clipcli diff step-1000.safetensors step-2000.safetensors --sort diff --top 10",
        "clipcli diff pytorch_model.bin model.safetensors --fail-different",
        "clipcli diff base/ finetuned/ --depth 3 --fail-rel-above 0.05 --format json",
    ),
)
def diff(
    a: Annotated[
        Path, typer.Argument(metavar="A", parser=_path, help="The checkpoint compared against (the reference).")
    ],
    b: Annotated[Path, typer.Argument(metavar="B", parser=_path, help="The checkpoint compared with A.")],
    ord: Ord = "2",
    depth: Depth = None,
    sort: Annotated[
        DiffSortKey | None,
        typer.Option(
            "--sort", metavar="KEY", help="Order the rows by name, norm (of A), size, diff or rel (largest first)."
        ),
    ] = None,
    top: Top = None,
    fail_above: Annotated[
        str | None,
        typer.Option("--fail-above", metavar="X", help="Exit 1 if the global ‖A−B‖ exceeds X or is not finite."),
    ] = None,
    fail_rel_above: Annotated[
        str | None,
        typer.Option(
            "--fail-rel-above", metavar="R", help="Exit 1 if the global ‖A−B‖/‖A‖ exceeds R or is not finite."
        ),
    ] = None,
    fail_different: Annotated[
        bool,
        typer.Option(
            "--fail-different",
            help="Exit 1 if anything differs: values, names, shapes, dtypes or metadata (cmp for checkpoints).",
        ),
    ] = False,
    jobs: Jobs = None,
    include: Include = None,
    exclude: Exclude = None,
    fmt: FormatOpt = Format.table,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """How far checkpoint B is from A: ‖A−B‖, ‖A‖, ‖B‖, ‖A−B‖/‖A‖, cosine, max |a−b| and changed elements.

    Tensors are matched by name; tensors of different dtypes are compared by value (how much did the
    bfloat16 conversion change the weights?); bit-identical tensors are summed up in one line; tensors
    in one checkpoint only, and shape mismatches, are listed. Without a gate the exit status is 0 whatever
    differs, as with `git diff`.
    """
    with _errors(debug):  # --ord's limit comes from the core, which imports NumPy: under `_errors`
        p = _parse_ord(ord)
        limit = None if fail_above is None else _parse_limit(fail_above, "--fail-above")
        rel_limit = None if fail_rel_above is None else _parse_limit(fail_rel_above, "--fail-rel-above")
        from clipcli import commands
        from clipcli.checkpoint import open_checkpoint
        from clipcli.errors import CheckFailedError, UsageError

        with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
            total = sum(t.nbytes for t in ca.tensors) + sum(t.nbytes for t in cb.tensors)
            with _progress(total, quiet) as progress:
                result = commands.diff(
                    ca,
                    cb,
                    _selection(include, exclude, ca, cb),
                    p,
                    depth,
                    sort and sort.value,
                    top,
                    progress,
                    _jobs(jobs),
                )
        if (limit is not None or rel_limit is not None) and not result.tensors:
            gate = "--fail-above" if limit is not None else "--fail-rel-above"
            raise UsageError("no floating tensor is in both checkpoints, so the gate has nothing to check", a, gate)
        _emit("diff", p, [], fmt, quiet, diff=result)
        s = result.stats
        if fail_different and result.different:
            raise CheckFailedError(f"{'; '.join(result.different)} (--fail-different)", f"{a} vs {b}")
        if limit is not None and _over(s.diff_norm, limit):
            raise CheckFailedError(_exceeds("‖A−B‖", s.diff_norm, "--fail-above", fail_above), f"{a} vs {b}")
        if rel_limit is not None:
            rel = s.rel if s.rel is not None else (0.0 if s.diff_norm == 0 else math.inf)
            if _over(rel, rel_limit):
                raise CheckFailedError(_exceeds("‖A−B‖/‖A‖", rel, "--fail-rel-above", fail_rel_above), f"{a} vs {b}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def _parse_size(text: str, param: str) -> int:
    """A size such as 5GB (10**9 bytes, as Hugging Face counts), 500MiB (2**20) or 1000000 (bytes)."""
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        _usage(f"must be a size such as 5GB, 500MiB or 1000000 (bytes), got {text!r}", param)
    if not math.isfinite(value):
        _usage(f"must be a finite size, got {text}", param)
    if value < 1:
        _usage(f"must be at least 1 byte, got {text}", param)
    return int(value)


@app.command(
    cls=_Command,
    epilog=_examples(
        "clipcli convert pytorch_model.bin -o model.safetensors",
        "clipcli convert model.safetensors -o shards/ --max-shard-size 5GB",
        "clipcli convert shards/ -o merged.safetensors --dry-run",
    ),
)
def convert(
    ctx: typer.Context,
    checkpoint: Annotated[
        Path,
        typer.Argument(
            metavar="CKPT", parser=_path, help="The checkpoint to convert (a file, sharded index or directory)."
        ),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="OUT",
            show_default=False,
            help="A .safetensors/.npz/.npy file (the suffix picks the format) or a directory of shards.",
        ),
    ],
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="Write Hugging Face style shards of at most SIZE (5GB, 500MiB, bytes) and an index into OUT.",
        ),
    ] = None,
    dry_run: DryRun = False,
    drop_metadata: DropMetadata = False,
    report_file: ReportFile = None,
    sort: InspectSort = None,
    top: Top = None,
    jobs: Jobs = None,
    include: Include = None,
    exclude: Exclude = None,
    fmt: FormatOpt = Format.table,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """The same tensors in another format or layout: every value, dtype, shape, name and the metadata kept,
    or an error that says what would be lost.

    PyTorch files (read without torch, never unpickled) become .safetensors or .npz; sharded checkpoints
    merge into one file; one file splits into shards with --max-shard-size. Tensors that share storage in
    a PyTorch file (tied weights) become separate copies, and the report says so. Tensors left out by
    --include/--exclude are not written.
    """
    max_shard = None if max_shard_size is None else _parse_size(max_shard_size, "--max-shard-size")
    with _errors(debug):
        from clipcli import commands
        from clipcli.checkpoint import check_output, check_report, open_checkpoint

        with open_checkpoint(checkpoint) as ckpt:
            if drop_metadata:
                ckpt.metadata = {}
            target = check_output(output, ckpt, resharding=max_shard is not None, command="convert")
            if report_file is not None:
                check_report(report_file, ckpt, None if dry_run else target)
            job = commands.ClipJob(None if dry_run else target, False, False, _jobs(jobs), sort and sort.value, top)
            with _progress(sum(t.nbytes for t in ckpt.tensors), quiet) as progress:
                selection = _selection(include, exclude, ckpt)
                result = commands.convert(ckpt, selection, target, job, max_shard, progress)
        _emit("convert", 2.0, [result], fmt, quiet, report_file)


def main(argv: list[str] | None = None) -> None:
    """The console script (and `python -m clipcli`): runs the app; exits with the contract's status.

    Ctrl-C and SIGTERM stop a command with its temporary files removed and the target untouched, wherever they
    arrive before the output starts to replace its target: a signal whose exception Python swallowed on the way
    (in an at-fork hook, a `__del__`) or turned into another (an import's) still keeps the write from being
    committed. The process then ends by the signal itself (`exit_stopped`). From the commit on a stop is held and
    dropped: the command runs to its end.
    """
    install_stop_handlers()
    announced = False
    try:
        app(args=argv, prog_name="clipcli")
    except SystemExit as e:
        announced = e.code == stop_status()  # the command's `_errors` said it
        if stop_status() is None:
            raise
    except BaseException:  # before a command started or after it ended, or as an import's error
        if stop_status() is None:
            raise
    finally:
        ignore_stops_if_committed()  # the output is in place: a stop on the way out must not end it by the signal
    if stop_status() is not None:
        exit_stopped(announce=not announced)
