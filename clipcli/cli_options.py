"""The command line's options: their names, metavars and help, and the parsing of their values."""

# No `from __future__ import annotations` here: Typer reads the commands' annotations (these) at every run.

import importlib.util
import math
import os
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from clipcli import __version__


class Command(typer.core.TyperCommand):
    """Usage lines name arguments as words (`CKPT...`), without Typer's braces around required ones."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class Group(typer.core.TyperGroup):
    """`--show-completion [SHELL]` and `--install-completion [SHELL]`: an option's value that may be left out,
    which Typer's parser cannot say (Typer's own options are flags that ignore a shell named after them)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args[:1] in (["--show-completion"], ["--install-completion"]) and args[1:2] in ([], ["-h"], ["--help"]):
            args = [args[0], "", *args[1:]]  # no SHELL: the current shell
        return super().parse_args(ctx, args)


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


_URL = r"[A-Za-z][A-Za-z0-9+.-]+://"  # compiled at the first argument that holds "://"


def is_url(path: object) -> bool:
    """Whether a checkpoint argument is a URL (`https://...`, `hf://...`, `s3://...`), which stays text."""
    return isinstance(path, str) and "://" in path and re.match(_URL, path) is not None


def parse_path(text: str) -> Path:
    """A checkpoint's path as given, or its URL as text (`https://`, `hf://`, `s3://`...: read remotely). Not
    Click's Path type, which refuses a file it cannot read as a usage error (exit 2; the contract: exit 3, one
    line), and takes an empty path for the current directory. The arguments it parses are annotated `str`:
    Typer would make a `Path` (`https:/host/...`) of a URL returned for a `Path` argument."""
    if not text:
        raise typer.BadParameter("an empty path names no file")
    return text if is_url(text) else Path(text)  # type: ignore[return-value]


def parse_output(text: str) -> str:
    """-o OUT: a local path (clipcli reads URLs but writes only files)."""
    if is_url(text):
        raise typer.BadParameter(f"outputs are local paths, not URLs: {text}")
    return text


def parse_report_path(text: str) -> Path:
    """--report FILE. `-` is refused as `-o -` is: the JSON on stdout is `--format json`, and a second way there
    would need rules for `--format csv --report -` or `--quiet --report -`."""
    if text == "-":
        raise typer.BadParameter(
            "clipcli writes the report to a file, not standard output; for JSON on standard output use --format json"
        )
    return Path(parse_output(text)) if text else parse_path(text)


Checkpoints = Annotated[
    list[str],
    typer.Argument(
        metavar="CKPT...",
        parser=parse_path,
        help="Checkpoints: .safetensors, .npz, .npy or PyTorch (.pt, .pth, .bin, .ckpt) files, sharded indexes "
        "(*.safetensors.index.json, pytorch_model.bin.index.json), or directories (shards, or a "
        "torch.distributed.checkpoint); each a path or a URL (https://, hf://ORG/REPO/PATH, s3://, gs://: "
        "pip install 'clipcli[remote]').",
        show_default=False,
    ),
]
OneCheckpoint = Annotated[
    str,
    typer.Argument(
        metavar="CKPT",
        parser=parse_path,
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
UNSAFE_PICKLE_GATE: list[bool] = []  # set by --fail-unsafe-pickle while the command runs


def _gate_unsafe_pickle(value: bool) -> bool:
    UNSAFE_PICKLE_GATE[:] = [value]
    return value


FailUnsafePickle = Annotated[
    bool,
    typer.Option(
        "--fail-unsafe-pickle",
        callback=_gate_unsafe_pickle,
        help="Exit 1 when a PyTorch file's pickle would call a global outside torch's weights-only allowlist "
        "(clipcli never calls it): after the report, or, for a command that writes, before anything is written.",
    ),
]
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
        parser=parse_output,
        help="Where to write: a .safetensors/.npz/.npy/.pt file (the suffix "
        "picks the format) or, for sharded safetensors, a directory.",
    ),
]
InPlace = Annotated[bool, typer.Option("--in-place", help="Replace the input (atomically) instead of -o.")]
DropMetadata = Annotated[
    bool,
    typer.Option(
        "--drop-metadata",
        help="Write no metadata (an .npz or .npy has no place for it, a .pt none for placeholders such as an "
        "argparse.Namespace; without this, such metadata is refused there).",
    ),
]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Compute and report, write nothing.")]
ReportFile = Annotated[
    Path | None,
    typer.Option("--report", metavar="FILE", parser=parse_report_path, help="Also write the report as JSON to FILE."),
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


def examples(*lines: str) -> str:
    """A help epilog of examples, kept as written (Click rewraps other paragraphs)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  {line}" for line in lines)


def usage(message: str, param: str) -> NoReturn:
    raise typer.BadParameter(message, param_hint=param)


def parse_float(text: str, param: str) -> float:
    try:
        value = float(text)
    except ValueError:
        usage(f"{text!r} is not a number", param)
    if math.isnan(value):
        usage("must be a number, not NaN", param)
    return value


def parse_limit(text: str, param: str) -> float:
    """A gate's threshold: a number >= 0 (inf allowed: only a figure that is not finite fails)."""
    value = parse_float(text, param)
    if value < 0:
        usage(f"must be a number >= 0 (a norm is never negative), got {text}", param)
    return value


def positive_finite(value: float, text: str, param: str) -> None:
    if not (math.isfinite(value) and value > 0):
        usage(f"must be a finite number > 0, got {text}", param)


def parse_ord(text: str) -> float:
    if text.lower() in ("inf", "infinity"):
        return math.inf
    from clipcli.core.norms import MAX_ORDER

    value = parse_float(text, "--ord")
    if not value > 0:
        usage(f"must be 1, 2, inf or any p > 0, got {text}", "--ord")
    if value > MAX_ORDER:
        message = f"orders above {MAX_ORDER:g} are not supported (the norm is then the largest magnitude: --ord inf)"
        message += f", got {text}"
        usage(message, "--ord")
    return value


def parse_axes(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        axes = tuple(int(part) for part in text.split(","))
    except ValueError:
        usage(f"must be comma-separated integers such as 0,1 or -1, got {text!r}", "--axes")
    if len(set(axes)) != len(axes):
        usage(f"names an axis twice: {text}", "--axes")
    return axes


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_size(text: str, param: str) -> int:
    """A size such as 5GB (10**9 bytes, as Hugging Face counts), 500MiB (2**20) or 1000000 (bytes)."""
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        usage(f"must be a size such as 5GB, 500MiB or 1000000 (bytes), got {text!r}", param)
    if not math.isfinite(value):
        usage(f"must be a finite size, got {text}", param)
    if value < 1:
        usage(f"must be at least 1 byte, got {text}", param)
    return int(value)


def show_version(value: bool) -> None:
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

    shell = value or _current_shell()
    if not shell:  # no shell among the parents (a container's entry point, a job runner): say which to name
        usage("cannot tell the current shell; name one: bash, zsh, fish, powershell or pwsh", f"--{param.name}")
    callback = completion.show_callback if param.name == "show_completion" else completion.install_callback
    callback(ctx, param, shell)


def _current_shell() -> str | None:
    """The shell clipcli runs in, as Typer finds it among the parent processes, else $SHELL's name."""
    from typer._completion_shared import _get_shell_name

    return _get_shell_name() or os.path.basename(os.environ.get("SHELL", "")) or None


def completion_option(name: str, what: str) -> Any:
    return typer.Option(
        name,
        metavar="[SHELL]",
        callback=_completion,
        is_eager=True,
        expose_value=False,
        help=f"{what} completion for SHELL (bash, zsh, fish, powershell, pwsh; default: the current shell).",
    )


# --- Options of one command ---------------------------------------------------------------------

FailAbove = Annotated[
    str | None,
    typer.Option("--fail-above", metavar="X", help="Exit 1 if a global norm exceeds X or is not finite."),
]
FailNonfinite = Annotated[bool, typer.Option("--fail-nonfinite", help="Exit 1 if a selected tensor holds NaN or Inf.")]


def _clip_norm(what: str) -> Any:
    return typer.Option("--clip-norm", metavar="N", show_default=False, help=what)


Min = Annotated[
    str,
    typer.Option(
        "--min",
        metavar="A",
        show_default=False,
        help="Lower bound, rounded to each tensor's dtype as TensorFlow does (bfloat16 0.1 is 0.10009765625).",
    ),
]
Max = Annotated[
    str,
    typer.Option(
        "--max", metavar="B", show_default=False, help="Upper bound, rounded to each tensor's dtype likewise."
    ),
]
ClipNorm = Annotated[str, _clip_norm("The largest L2 norm a tensor (or slice) may keep; > 0.")]
Axes = Annotated[
    str | None,
    typer.Option(
        "--axes",
        metavar="AXES",
        help="Norm over these axes only, e.g. 0,1 or -1 for per-row norms (default: the whole tensor).",
    ),
]
GlobalClipNorm = Annotated[str, _clip_norm("The largest global L2 norm the tensors may keep; > 0.")]
UseNorm = Annotated[
    str | None,
    typer.Option("--use-norm", metavar="G", help="Use G (finite, >= 0) as the global norm instead of computing it."),
]
DiffA = Annotated[
    str, typer.Argument(metavar="A", parser=parse_path, help="The checkpoint compared against (the reference).")
]
DiffSort = Annotated[
    DiffSortKey | None,
    typer.Option(
        "--sort", metavar="KEY", help="Order the rows by name, norm (of A), size, diff or rel (largest first)."
    ),
]
DiffFailAbove = Annotated[
    str | None,
    typer.Option("--fail-above", metavar="X", help="Exit 1 if the global ‖A−B‖ exceeds X or is not finite."),
]
FailRelAbove = Annotated[
    str | None,
    typer.Option("--fail-rel-above", metavar="R", help="Exit 1 if the global ‖A−B‖/‖A‖ exceeds R or is not finite."),
]
FailDifferent = Annotated[
    bool,
    typer.Option(
        "--fail-different",
        help="Exit 1 if anything differs: values, names, shapes, dtypes or metadata (cmp for checkpoints).",
    ),
]
CountSharedOnce = Annotated[
    bool,
    typer.Option(
        "--count-shared-once",
        help="Count names on one storage (tied weights of a PyTorch file) once in the global norm, as "
        "torch.nn.utils.clip_grad_norm_(model.parameters()) does; each name keeps its row (and, clipped, is "
        "written, scaled by the one scale).",
    ),
]
CombinedOpt = Annotated[
    bool,
    typer.Option(
        "--combined",
        help="Also one global norm over the tensors of all the checkpoints, as if one (per-rank gradient files); "
        "--fail-above checks it. A tensor name in two checkpoints is a usage error.",
    ),
]
PrefixWithFile = Annotated[
    bool,
    typer.Option(
        "--prefix-with-file",
        help="With --combined: the checkpoints' tensors are different tensors even where names repeat; "
        "rows are named FILE/NAME.",
    ),
]
ClipCheckpoints = Annotated[
    list[str],
    typer.Argument(
        metavar="CKPT...",
        parser=parse_path,
        help="The checkpoint to clip (a .safetensors, .npz, .npy or PyTorch file, a sharded index or directory); "
        "several are clipped together with one scale, each into -o DIR/<its name>.",
        show_default=False,
    ),
]
ClipPrefixWithFile = Annotated[
    bool,
    typer.Option(
        "--prefix-with-file",
        help="With several checkpoints: they hold different tensors even where names repeat.",
    ),
]
Plot = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="FILE",
        parser=parse_path,
        help="Also draw the trajectory into FILE.png or FILE.svg (needs matplotlib: pip install 'clipcli[plot]').",
    ),
]
KeepOrder = Annotated[
    bool,
    typer.Option("--keep-order", help="Take the checkpoints in the order given, not in natural order of their names."),
]
Maps = Annotated[
    list[str] | None,
    typer.Option(
        "--map",
        metavar="A_PREFIX=B_PREFIX",
        help="Compare A's tensors whose names start with A_PREFIX with B's named B_PREFIX + the rest "
        "('state_dict.=' for a Lightning file against its bare state dict; repeatable: the first that fits).",
    ),
]
ConvertCheckpoint = Annotated[
    str,
    typer.Argument(
        metavar="CKPT", parser=parse_path, help="The checkpoint to convert (a file, sharded index or directory)."
    ),
]
ConvertOutput = Annotated[
    str,
    typer.Option(
        "--output",
        "-o",
        metavar="OUT",
        parser=parse_output,
        show_default=False,
        help="A .safetensors/.npz/.npy/.pt file (the suffix picks the format) or a directory of shards.",
    ),
]
MaxShardSize = Annotated[
    str | None,
    typer.Option(
        "--max-shard-size",
        metavar="SIZE",
        help="Write Hugging Face style shards of at most SIZE (5GB, 500MiB, bytes) and an index into OUT.",
    ),
]
DiffB = Annotated[str, typer.Argument(metavar="B", parser=parse_path, help="The checkpoint compared with A.")]
VerifyCheckpoint = Annotated[
    str,
    typer.Argument(
        metavar="CKPT",
        parser=parse_path,
        help="The checkpoint to verify (a file, a sharded index or directory, a distributed checkpoint).",
        show_default=False,
    ),
]
Manifest = Annotated[
    Path | None,
    typer.Option(
        "--manifest",
        metavar="FILE",
        parser=parse_path,
        help="Compare every tensor's content hash with this manifest (`clipcli hash CKPT --format json`).",
    ),
]
Values = Annotated[
    bool, typer.Option("--values", help="Also read the values: NaN, Inf and all-zero floating tensors are findings.")
]


class StatsSortKey(str, Enum):
    name = "name"
    size = "size"
    max_abs = "max_abs"
    std = "std"
    zeros = "zeros"
    nonfinite = "nonfinite"
    overflow = "overflow"


StatsSort = Annotated[
    StatsSortKey | None,
    typer.Option(
        "--sort",
        metavar="KEY",
        help="Order the rows by name, size, max_abs, std, zeros, nonfinite (NaN and Inf) or overflow (values that "
        "would overflow a cast target); all but name largest first.",
    ),
]
Cast = Annotated[
    str | None,
    typer.Option(
        "--cast",
        metavar="DTYPES",
        help="Cast targets to check, comma-separated among float16, bfloat16, float8_e4m3fn, float8_e5m2 (default: "
        "per tensor those narrower than its dtype).",
    ),
]
FailMaxAbs = Annotated[
    str | None,
    typer.Option("--fail-max-abs", metavar="X", help="Exit 1 if a selected floating tensor holds |x| > X, or NaN."),
]
FailCastOverflow = Annotated[
    str | None,
    typer.Option(
        "--fail-cast-overflow",
        metavar="DTYPE",
        help="Exit 1 if a value of a selected floating tensor would overflow a cast to DTYPE (measured for every "
        "floating tensor, whatever --cast says).",
    ),
]
FailAllZero = Annotated[
    bool, typer.Option("--fail-all-zero", help="Exit 1 if a selected floating tensor is all zeros (a broken adapter).")
]
