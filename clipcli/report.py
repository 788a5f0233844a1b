"""The report as plain frozen dataclasses, and its table, JSON and CSV renderings."""

from __future__ import annotations

import codecs
import csv
import functools
import io
import itertools
import json
import math
import operator
import re
import unicodedata
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from clipcli.errors import printable, shown_path

SCHEMA = 1


@dataclass(unsafe_hash=True)  # never changed once made; not frozen: made per tensor, 4 times as fast
class TensorRow:
    """One selected tensor: its norm, largest magnitude, non-finite counts and share of the global norm**p."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    norm: float
    max_abs: float
    nan: int
    inf: int
    share: float | None
    norm_after: float | None = None
    max_abs_after: float | None = None


@dataclass(frozen=True)
class Skipped:
    """A tensor left out of the norms (and passed through unchanged by the clip commands)."""

    name: str
    dtype: str
    reason: str


@dataclass(frozen=True)
class Group:
    """Tensors whose names share their first N dot-separated parts."""

    name: str
    tensors: int
    norm: float
    share: float | None


@dataclass(frozen=True)
class InspectRow:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Summary:
    """Figures over every selected tensor of a checkpoint, whichever rows --sort and --top show."""

    tensors: int
    max_abs: float = 0.0
    nan: int = 0
    inf: int = 0
    largest: TensorRow | None = None  # the row with the largest share (None for --ord inf, or no row)
    max_abs_after: float | None = None
    elements: int = 0
    nbytes: int = 0
    nonfinite: tuple[TensorRow, ...] = ()  # the rows holding NaN or Inf


@dataclass(frozen=True)
class CheckpointReport:
    """The report of one checkpoint; the clip fields are set by the clip commands only.

    `tensors` (and `listing`, `groups`) are the rows shown, after --sort and --top; `summary` and
    `global_norm` cover every selected tensor.
    """

    path: str
    summary: Summary
    global_norm: float = math.nan
    tensors: tuple[TensorRow, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    groups: tuple[Group, ...] | None = None
    group_count: int = 0  # the groups there are (--top may show fewer)
    format: str | None = None
    metadata: dict[str, str] | None = None
    listing: tuple[InspectRow, ...] = ()
    clip: dict[str, float] = field(default_factory=dict)
    scale: float | None = None
    global_norm_after: float | None = None
    output: str | None = None
    files: tuple[str, ...] = ()  # the files a conversion writes (or would, on a dry run)
    shared: tuple[tuple[str, ...], ...] = ()  # names on one storage (tied weights in a PyTorch file)

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "path", shown_path(self.path))
        if self.output is not None:
            object.__setattr__(self, "output", shown_path(self.output))


@dataclass(unsafe_hash=True)  # never changed once made; not frozen: made per tensor, 5 times as fast
class DiffRow:
    """One tensor of both checkpoints: how far B's values are from A's."""

    name: str
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    nbytes: int
    identical: bool  # same dtype, shape and bytes
    norm_a: float | None = None
    norm_b: float | None = None
    diff_norm: float | None = None
    rel: float | None = None
    cosine: float | None = None
    max_abs_diff: float | None = None
    changed: int | None = None
    share: float | None = None
    reason: str | None = None  # why a pair is compared for sameness only

    @classmethod
    def other(cls, a: Any, b: Any, identical: bool, same_values: bool, reason: str) -> DiffRow:
        """The row of a pair compared only for being the same (integers, types carried as bytes): `changed`
        is 0 where the values are the same (in another dtype, too), None where some differ."""
        changed = 0 if same_values else None
        return cls(a.name, a.shape, a.dtype, b.dtype, a.nbytes, identical, changed=changed, reason=reason)


@dataclass(frozen=True)
class DiffGroup:
    """Compared tensors whose names share their first N dot-separated parts."""

    name: str
    tensors: int
    diff_norm: float
    norm_a: float
    rel: float | None
    share: float | None


@dataclass(frozen=True)
class Mismatch:
    """A name in both checkpoints whose tensors cannot be compared (shapes differ, no values)."""

    name: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class DiffReport:
    """The difference of two checkpoints: `stats` over every compared tensor, `shown` after --sort/--top."""

    a: str
    b: str
    stats: Any  # DiffStats over all compared floating tensors, as if concatenated
    tensors: tuple[DiffRow, ...]
    shown: tuple[DiffRow, ...]
    others: tuple[DiffRow, ...]
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]
    metadata_differs: tuple[str, ...] = ()  # metadata keys whose values differ or that one side alone has
    groups: tuple[DiffGroup, ...] | None = None
    group_count: int = 0  # the groups there are (--top may show fewer)

    def __post_init__(self) -> None:  # paths as they can be typed back (`shown_path`), in every format
        object.__setattr__(self, "a", shown_path(self.a))
        object.__setattr__(self, "b", shown_path(self.b))

    @property
    def different(self) -> list[str]:
        """What differs, in words (empty when the checkpoints hold the same names, shapes, dtypes, values and
        metadata)."""
        out = []
        changed = [r.name for r in self.tensors if r.changed] + [r.name for r in self.others if r.changed is None]
        # the same values in another dtype (float32 against bfloat16 of bfloat16 values): said apart
        retyped = [r.name for r in (*self.tensors, *self.others) if r.changed == 0 and r.dtype_a != r.dtype_b]
        differ = "tensor differs" if len(changed) == 1 else "tensors differ"
        dtypes = "tensor differs in dtype only" if len(retyped) == 1 else "tensors differ in dtype only"
        keys = "metadata key differs" if len(self.metadata_differs) == 1 else "metadata keys differ"
        for names, what in (
            (changed, differ), (retyped, dtypes), (self.only_a, "only in A"), (self.only_b, "only in B"),
            (self.metadata_differs, keys),
        ):  # fmt: skip
            if names:
                more = ", ..." if len(names) > 1 else ""
                out.append(f"{len(names):,} {what} ({printable(names[0])}{more})")
        if self.mismatched:
            m = self.mismatched[0]
            out.append(f"{len(self.mismatched):,} not comparable ({printable(m.name)}: {m.reason})")
        return out


@dataclass(frozen=True)
class Report:
    command: str
    ord: float
    checkpoints: tuple[CheckpointReport, ...] = ()
    diff: DiffReport | None = None


def summarize(rows: Sequence[TensorRow], max_abs_after: float | None = None) -> Summary:
    """The summary of all selected tensors' rows."""
    shares = [-1.0 if r.share is None or math.isnan(r.share) else r.share for r in rows]
    top = max(shares, default=-1.0)
    nan, inf = sum(map(_NAN, rows)), sum(map(_INF, rows))
    return Summary(
        tensors=len(rows),
        max_abs=max(map(_MAX_ABS, rows), default=0.0),
        nan=nan,
        inf=inf,
        largest=rows[shares.index(top)] if top >= 0 else None,
        max_abs_after=max_abs_after,
        elements=sum(math.prod(r.shape) for r in rows),
        nbytes=sum(map(_NBYTES, rows)),
        nonfinite=tuple(r for r in rows if r.nan or r.inf) if nan or inf else (),
    )


_NAN, _INF, _MAX_ABS, _NBYTES = (operator.attrgetter(f) for f in ("nan", "inf", "max_abs", "nbytes"))


# --- JSON -------------------------------------------------------------------------------------------


def _num(x: float | None) -> Any:
    """A number for strict JSON: non-finite values become the strings 'nan', 'inf', '-inf'."""
    if type(x) is float and math.isfinite(x):  # the common case first: three a row, 10,000 rows
        return x
    if x is None:
        return None
    if isinstance(x, int):
        return x
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _ord(p: float) -> Any:
    return "inf" if math.isinf(p) else int(p) if p == int(p) else p


def to_json(report: Report) -> str:
    """The report as one strict JSON object (see the README for the schema)."""
    if report.diff is not None:
        return _safe(_dumps(_diff_json(report.ord, report.diff))) + "\n"
    out: dict[str, Any] = {"schema": SCHEMA, "command": report.command}
    if report.command not in ("inspect", "convert"):
        out["ord"] = _ord(report.ord)
    out["checkpoints"] = [_checkpoint_json(report.command, c) for c in report.checkpoints]
    return _safe(_dumps(out)) + "\n"


@functools.cache
def _unsafe() -> re.Pattern[str]:
    """What `_safe` looks at: compiled on first use (10 ms of charset optimizing, for a rare report)."""
    return re.compile("[\x7f-\U0010ffff]")


def _safe(text: str) -> str:
    """JSON text with what a terminal should not get raw written as \\u escapes, which decode to the same string:
    non-printable characters beyond ASCII's controls (which the encoder escapes): C1 controls, bidi overrides,
    and the lone surrogates a path that is not UTF-8 holds (Python's surrogateescape; UTF-8 cannot encode them).
    """
    if text.isascii():
        return text
    return _unsafe().sub(_escape_unsafe, text)


def _escape_unsafe(m: re.Match[str]) -> str:
    c = m.group()
    if c.isprintable():
        return c
    code = ord(c)
    if code > 0xFFFF:  # as a UTF-16 surrogate pair, as JSON writes it
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def _diff_json(p: float, d: DiffReport) -> dict[str, Any]:
    s = d.stats
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "command": "diff",
        "ord": _ord(p),
        "a": d.a,
        "b": d.b,
        "diff_norm": _num(s.diff_norm),
        "norm_a": _num(s.norm_a),
        "norm_b": _num(s.norm_b),
        "rel": _num(s.rel),
        "cosine": _num(s.cosine),
        "max_abs_diff": _num(s.max_abs_diff),
        "changed": s.changed,
        "tensor_count": len(d.tensors),
        "identical_count": sum(r.identical for r in d.tensors),
        "different": d.different,
    }
    out["tensors"] = [
        {
            "name": r.name,
            "shape": list(r.shape),
            "dtype_a": r.dtype_a,
            "dtype_b": r.dtype_b,
            "norm_a": _num(r.norm_a),
            "norm_b": _num(r.norm_b),
            "diff_norm": _num(r.diff_norm),
            "rel": _num(r.rel),
            "cosine": _num(r.cosine),
            "max_abs_diff": _num(r.max_abs_diff),
            "changed": r.changed,
            "identical": r.identical,
            "share": _num(r.share),
        }
        for r in d.shown
    ]
    out["skipped"] = [
        {"name": r.name, "dtype_a": r.dtype_a, "dtype_b": r.dtype_b, "identical": r.identical,
         "reason": f"{r.reason}: compared for being the same only"}
        for r in d.others
    ]  # fmt: skip
    out["only_a"] = list(d.only_a)
    out["only_b"] = list(d.only_b)
    out["mismatched"] = [
        {"name": m.name, "shape_a": list(m.shape_a), "shape_b": list(m.shape_b), "reason": m.reason}
        for m in d.mismatched
    ]
    out["metadata_differs"] = list(d.metadata_differs)
    if d.groups is not None:
        out["groups"] = [
            {"name": g.name, "tensors": g.tensors, "diff_norm": _num(g.diff_norm), "norm_a": _num(g.norm_a),
             "rel": _num(g.rel), "share": _num(g.share)}
            for g in d.groups
        ]  # fmt: skip
        out["group_count"] = d.group_count
    return out


_COMPACT = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": "))
_string = json.encoder.encode_basestring  # the encoder's own escaping, as _COMPACT (ensure_ascii=False) uses it


def _dumps(value: Any, indent: str = "") -> str:
    """Strict JSON, indented down to records (a row, a group), each of which takes one line.

    A list of records is written by one call of the C encoder; a report of 10,000 tensors is written
    about as fast as it is read (see `_records`).
    """
    inner = indent + "  "
    if isinstance(value, _Rendered):
        return f"[\n{inner}" + f",\n{inner}".join(value) + f"\n{indent}]" if value else "[]"
    if isinstance(value, dict) and not _record(value):
        items = [f"{inner}{_COMPACT.encode(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        if isinstance(value[0], dict) and _record(value[0]):  # a list of rows: all alike
            return _records(value, inner, indent)
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in value) + f"\n{indent}]"
    return _COMPACT.encode(value)


def _records(rows: list[dict[str, Any]], inner: str, indent: str) -> str:
    """Rows that share their first key (as every list of rows here does), one on each line.

    The C encoder writes the whole list on one line, rows joined by '}, {"key": '; that text cannot
    occur inside a JSON string (a quote there is escaped), so breaking the line there changes only the
    whitespace between values, whatever the rows hold.
    """
    key = _COMPACT.encode(next(iter(rows[0]), ""))
    text = _COMPACT.encode(rows)[1:-1].replace(f"}}, {{{key}: ", f"}},\n{inner}{{{key}: ")
    return f"[\n{inner}{text}\n{indent}]"


class _Rendered(list):
    """Records already written as JSON objects, one per line (the rows of 10,000 tensors: see `_tensor_json`)."""


def _tensor_json(t: TensorRow, clip: bool) -> str:
    """A tensor's row as the encoder writes `{"name": ..., "dtype": ..., ...}`, a third faster than a dict through it.

    Every value is written as the encoder writes it: strings by its own escaping, finite floats by their
    repr, non-finite ones as strings, None as null (a test compares the two on arbitrary rows).
    """
    row = (
        f'{{"name": {_string(t.name)}, "dtype": {_string(t.dtype)}, "shape": {_shape_json(t.shape)}, '
        f'"norm": {_number(t.norm)}, "max_abs": {_number(t.max_abs)}, "nan": {t.nan:d}, "inf": {t.inf:d}, '
        f'"share": {_number(t.share)}'
    )
    if clip:
        row += f', "norm_after": {_number(t.norm_after)}, "max_abs_after": {_number(t.max_abs_after)}'
    return row + "}"


@functools.lru_cache(maxsize=1024)  # tensors share shapes: the text of each is made once
def _shape_json(shape: tuple[int, ...]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _number(x: float | None) -> str:
    """A float (or None) as the encoder writes `_num(x)`."""
    if x is None:
        return "null"
    if math.isfinite(x):
        return float.__repr__(x)
    return f'"{_num(x)}"'


def _record(value: dict[str, Any]) -> bool:
    """A dict of scalars and lists of scalars (a row): one line. A dict holding dicts or lists of them is not."""
    for v in value.values():
        if isinstance(v, (dict, _Rendered)) or (isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v)):
            return False
    return True


def _checkpoint_json(command: str, c: CheckpointReport) -> dict[str, Any]:
    s = c.summary
    if command in ("inspect", "convert"):
        out = {"path": c.path, "format": c.format, "metadata": c.metadata or {}}
        if command == "convert":
            out.update({"output": c.output, "files": list(c.files)})
        out.update({"tensor_count": s.tensors, "elements": s.elements, "nbytes": s.nbytes})
        out["tensors"] = [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "elements": t.elements,
                "nbytes": t.nbytes,
                "file": t.file,
            }
            for t in c.listing
        ]
        if command == "convert":
            out["left_out"] = [s.name for s in c.skipped]
        out["shared_storage"] = [list(names) for names in c.shared]
        return out
    clip = command != "global-norm"
    out: dict[str, Any] = {
        "path": c.path,
        "global_norm": _num(c.global_norm),
        "tensor_count": s.tensors,
        "max_abs": _num(s.max_abs),
        "nan": s.nan,
        "inf": s.inf,
    }
    out["tensors"] = _Rendered(_tensor_json(t, clip) for t in c.tensors)
    out["skipped"] = [{"name": s.name, "dtype": s.dtype, "reason": s.reason} for s in c.skipped]
    out["shared_storage"] = [list(names) for names in c.shared]
    if c.groups is not None:
        out["groups"] = [
            {"name": g.name, "tensors": g.tensors, "norm": _num(g.norm), "share": _num(g.share)} for g in c.groups
        ]
        out["group_count"] = c.group_count  # the groups there are: --top may list fewer
    if clip:
        out.update({k: _num(v) for k, v in c.clip.items()})
        if command == "clip-global-norm":
            out["scale"] = _num(c.scale)
        out["global_norm_after"] = _num(c.global_norm_after)
        out["max_abs_after"] = _num(s.max_abs_after)
        out["output"] = c.output
    return out


# --- CSV --------------------------------------------------------------------------------------------


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def to_csv(report: Report) -> str:
    """A header row, then per checkpoint one row per tensor shown, per group, and one for the whole.

    The last column, `kind`, says which: `tensor`, `group` or `global` (the global norm and the figures
    over every selected tensor; for `inspect`, the totals).
    """
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if report.diff is not None:
        _diff_csv(w, report.diff)
        return buf.getvalue()
    if report.command in ("inspect", "convert"):
        w.writerow(["path", "name", "dtype", "shape", "elements", "nbytes", "file", "kind"])
        for c in report.checkpoints:
            for t in c.listing:
                row = [_text(c.path), _text(t.name), t.dtype, _shape_text(t.shape), t.elements, t.nbytes]
                w.writerow([*row, _text(t.file), "tensor"])
            w.writerow([_text(c.path), "", "", "", c.summary.elements, c.summary.nbytes, "", "global"])
        return buf.getvalue()
    clip = report.command != "global-norm"
    w.writerow(
        ["path", "name", "dtype", "shape", "norm", "max_abs", "nan", "inf", "share"]
        + (["norm_after", "max_abs_after"] if clip else [])
        + ["kind"]
    )
    for c in report.checkpoints:
        for t in c.tensors:
            nums = [_csv_num(t.norm), _csv_num(t.max_abs), t.nan, t.inf]
            row = [_text(c.path), _text(t.name), t.dtype, _shape_text(t.shape), *nums]
            row.append(_csv_num(t.share))
            w.writerow(row + ([_csv_num(t.norm_after), _csv_num(t.max_abs_after)] if clip else []) + ["tensor"])
        for g in c.groups or ():
            w.writerow(
                [_text(c.path), _text(g.name), "", "", _csv_num(g.norm), "", "", "", _csv_num(g.share)]
                + ["", ""] * clip
                + ["group"]
            )
        s = c.summary
        total = [_text(c.path), "", "", "", _csv_num(c.global_norm), _csv_num(s.max_abs), s.nan, s.inf, ""]
        w.writerow(total + ([_csv_num(c.global_norm_after), _csv_num(s.max_abs_after)] if clip else []) + ["global"])
    return buf.getvalue()


def _diff_csv(w: Any, d: DiffReport) -> None:
    """A row per compared tensor shown, per group, per tensor compared for sameness only, per metadata key
    that differs (kind `metadata`, the key as its name), and the whole.

    The global row's `identical` is 1 when nothing differs at all (what --fail-different checks).
    """
    numbers = ["norm_a", "norm_b", "diff_norm", "rel", "cosine", "max_abs_diff"]
    w.writerow(["name", "shape", "dtype_a", "dtype_b", *numbers, "changed", "identical", "share", "kind"])
    for r in d.shown:
        nums = [r.norm_a, r.norm_b, r.diff_norm, r.rel, r.cosine, r.max_abs_diff]
        row = [_text(r.name), _shape_text(r.shape), r.dtype_a, r.dtype_b, *map(_csv_num, nums), r.changed]
        w.writerow([*row, int(r.identical), _csv_num(r.share), "tensor"])
    blank = [""] * 4
    for g in d.groups or ():
        nums = [_csv_num(g.norm_a), "", _csv_num(g.diff_norm), _csv_num(g.rel)]
        w.writerow([_text(g.name), "", "", "", *nums, *blank[:3], "", _csv_num(g.share), "group"])
    for r in d.others:
        row = [_text(r.name), _shape_text(r.shape), r.dtype_a, r.dtype_b]
        w.writerow([*row, *blank, *blank[:3], int(r.identical), "", "skipped"])
    for key in d.metadata_differs:
        w.writerow([printable(key), *[""] * 10, 0, "", "metadata"])
    s = d.stats
    nums = [s.norm_a, s.norm_b, s.diff_norm, s.rel, s.cosine, s.max_abs_diff]
    w.writerow([*blank, *map(_csv_num, nums), s.changed, int(not d.different), "", "global"])


def _text(text: str) -> str:
    """A CSV text cell (a path, a name): escaped as for a terminal, and prefixed with ' where a spreadsheet would
    take it for a formula (it starts with = + - @). Number cells never come here: -1.5 stays a number."""
    text = printable(text)
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


def _csv_num(x: float | None) -> str:
    return "" if x is None else repr(float(x))


# --- Text -------------------------------------------------------------------------------------------


def plural(n: int, noun: str) -> str:
    """'1 tensor', '2 tensors'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_BLOCKS = " ▏▎▍▌▋▊▉█"
# The encoding the table is rendered for: what it cannot hold is escaped before columns are measured
_ENCODING: ContextVar[str] = ContextVar("encoding", default="utf-8")


def share_bar(share: float | None, width: int = 8) -> str:
    """A bar of eighth blocks for a share in [0, 1] ('#'s where the output cannot show blocks), then the
    percentage."""
    if share is None or math.isnan(share):
        return "-"
    fraction = min(max(share, 0.0), 1.0)
    if not _holds(_ENCODING.get(), _BLOCKS):
        return f"{'#' * round(fraction * width):<{width}} {share * 100:5.1f}%"
    eighths = round(fraction * width * 8)
    bar = "█" * (eighths // 8) + (_BLOCKS[eighths % 8] if eighths % 8 else "")
    return f"{bar:<{width}} {share * 100:5.1f}%"


@functools.lru_cache
def _holds(encoding: str, text: str) -> bool:
    """Whether `encoding` holds `text`."""
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


_ASCII_SYMBOLS = str.maketrans({"‖": "|", "−": "-"})


def symbols(text: str, encoding: str | None = None) -> str:
    """The report's own symbols (‖A−B‖) as `encoding` (default: the output's) can show them: |A-B| in ASCII."""
    return text if _holds(encoding or _ENCODING.get(), text) else text.translate(_ASCII_SYMBOLS)


def _shown(text: str) -> str:
    """`text` as the output's encoding can show it: what it cannot hold escaped (`\\u2588`)."""
    if text.isascii():
        return text
    encoding = _ENCODING.get()
    return text.encode(encoding, "backslashreplace").decode(encoding)


def _width(text: str) -> int:
    """The columns `text` takes on a terminal (East Asian wide characters take two, combining ones none)."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], right: Iterable[int] = ()) -> list[str]:
    """Lines of a plain table: columns one space apart, never wrapped or cut (a long line overflows).

    Cells are escaped (`printable`) before they are measured; columns in `right` are right-aligned.
    """
    body = [list(headers), *(list(r) for r in rows)]
    if not "".join(itertools.chain.from_iterable(body)).isprintable():  # one test for the common case
        body = [list(map(printable, row)) for row in body]
    if _ENCODING.get() != "utf-8":
        body = [[_shown(cell) for cell in row] for row in body]
    widths = [max(_width(row[i]) for row in body) for i in range(len(headers))]
    aligned = set(right)
    lines = []
    for row in body:
        cells = []
        for i, cell in enumerate(row):
            pad = " " * (widths[i] - _width(cell))
            cells.append(pad + cell if i in aligned else cell + pad)
        lines.append(" ".join(cells).rstrip())
    return lines


def headline(command: str, c: CheckpointReport, p: float) -> str:
    """The one line a person reads first (names in it escaped)."""
    s = c.summary
    norm_name = "global norm" if p == 2 else f"global {_ord(p)}-norm"
    counted = plural(s.tensors, "tensor")
    skipped = f", {len(c.skipped):,} skipped" if c.skipped else ""
    path = c.path
    if command == "global-norm":
        top = s.largest
        largest = f"; largest share: {top.name} ({(top.share or 0) * 100:.1f}%)" if top and s.tensors > 1 else ""
        return f"{path}: {norm_name} {_fmt(c.global_norm)} over {counted}{skipped}{largest}"
    target = "dry run, nothing written" if c.output is None else f"written to {c.output}"
    after = f"{_fmt(c.global_norm)} -> {_fmt(c.global_norm_after)}"
    if command == "clip-global-norm":
        what = f"{norm_name} {after} (scale {_fmt(c.scale)})"
    elif command == "clip-value":
        what = f"clipped to [{_fmt(c.clip.get('min'))}, {_fmt(c.clip.get('max'))}]: {norm_name} {after}"
    else:
        what = f"clip norm {_fmt(c.clip.get('clip_norm'))}: {norm_name} {after}"
    return f"{path}: {what} over {counted}{skipped}; {target}"


def render_text(report: Report, encoding: str = "utf-8") -> str:
    """The report for a person: plain text, names escaped, no line wrapped; for an output in `encoding`,
    table cells hold only what it can show (escaped before the columns are measured) and bars are '#'s
    where it has no block characters."""
    token = _ENCODING.set(codecs.lookup(encoding).name)
    try:
        return _render_text(report)
    finally:
        _ENCODING.reset(token)


def _render_text(report: Report) -> str:
    if report.diff is not None:
        blocks = [_diff_lines(report.diff, report.ord)]
    elif report.command in ("inspect", "convert"):
        blocks = [_inspect_lines(c, report.command) for c in report.checkpoints]
    elif len(report.checkpoints) > 1:
        blocks = [_several_lines(report)]
    else:
        blocks = [_checkpoint_lines(report.command, report.checkpoints[0], report.ord)]
    # every line escaped whole: a reason, a metadata value or a mismatch comes from a file as much as a name
    return "\n\n".join("\n".join(b if "".join(b).isprintable() else map(printable, b)) for b in blocks) + "\n"


def _inspect_lines(c: CheckpointReport, command: str = "inspect") -> list[str]:
    s = c.summary
    counts = f"{plural(s.tensors, 'tensor')}, {plural(s.elements, 'parameter')}, {_size(s.nbytes)}"
    if command == "convert":
        target = "dry run, nothing written" if c.output is None else f"written to {c.output}"
        shards = [f for f in c.files if not f.endswith(".index.json")]
        files = f" in {plural(len(shards), 'shard')} and an index" if len(shards) < len(c.files) else ""
        lines = [f"{c.path}: {c.format} -> {counts}{files}; {target}"]
    else:
        lines = [f"{c.path}: {c.format}, {counts}"]
        lines += [f"  metadata {k} = {v}" for k, v in (c.metadata or {}).items()]
    if len(c.listing) < s.tensors:
        lines.append(f"showing {len(c.listing):,} of {plural(s.tensors, 'tensor')}")
    several = len(c.files) > 1 if command == "convert" else c.format in ("sharded", "sharded-torch", "distcp")
    headers = ["tensor", "dtype", "shape", "elements", "size"] + (["file"] if several else [])
    rows = (
        [t.name, t.dtype, _shape_text(t.shape), f"{t.elements:,}", _size(t.nbytes)] + ([t.file] if several else [])
        for t in c.listing
    )
    lines += table(headers, rows, right=(3, 4))
    if command == "convert" and c.skipped:
        lines.append(f"{plural(len(c.skipped), 'tensor')} left out by --include/--exclude (listed in --format json)")
    return lines + _shared_lines(c)


def _shared_lines(c: CheckpointReport) -> list[str]:
    what = "one storage in the file" if c.output is None else "written as separate copies"
    return [f"tied: {', '.join(names)} ({what})" for names in c.shared]


def _several_lines(report: Report) -> list[str]:
    headers = ["checkpoint", "global norm", "tensors", "skipped", "max |x|", "nan", "inf"]
    rows = []
    for c in report.checkpoints:
        s = c.summary
        counts = [f"{s.tensors:,}", f"{len(c.skipped):,}", _fmt(s.max_abs), f"{s.nan:,}", f"{s.inf:,}"]
        rows.append([c.path, _fmt(c.global_norm), *counts])
    lines = table(headers, rows, right=range(1, 7))
    for c in report.checkpoints:
        if c.groups is not None:
            lines += ["", f"{c.path}: groups", *_group_lines(c.groups, c.group_count)]
    return lines


def _group_lines(groups: Sequence[Group], count: int) -> list[str]:
    rows = ([g.name, f"{g.tensors:,}", _fmt(g.norm), share_bar(g.share)] for g in groups)
    return _showing_groups(groups, count) + table(["group", "tensors", "norm", "share"], rows, right=(1, 2))


def _showing_groups(groups: Sequence[Any], count: int) -> list[str]:
    return [f"showing {len(groups):,} of {plural(count, 'group')}"] if len(groups) < count else []


def _checkpoint_lines(command: str, c: CheckpointReport, p: float) -> list[str]:
    lines = [headline(command, c, p)]
    clip = command != "global-norm"
    if len(c.tensors) < c.summary.tensors:
        lines.append(f"showing {len(c.tensors):,} of {plural(c.summary.tensors, 'tensor')}")
    headers = ["tensor", "dtype", "shape", "norm"]
    headers += ["norm after", "max |x|", "max |x| after"] if clip else ["share", "max |x|"]
    headers += ["nan", "inf"]
    rows = []
    for t in c.tensors:
        cells = [t.name, t.dtype, _shape_text(t.shape), _fmt(t.norm)]
        if clip:
            cells += [_fmt(t.norm_after), _fmt(t.max_abs), _fmt(t.max_abs_after)]
        else:
            cells += [share_bar(t.share), _fmt(t.max_abs)]
        rows.append([*cells, f"{t.nan:,}", f"{t.inf:,}"])
    right = (3, 4, 5, 6, 7, 8) if clip else (3, 5, 6, 7)
    if rows:  # no column headings over no rows (a checkpoint of step counters)
        lines += table(headers, rows, right=right)
    if c.groups is not None:
        lines += _group_lines(c.groups, c.group_count)
    lines += _shared_lines(c)
    unselected = [s for s in c.skipped if s.reason.startswith(("not selected", "excluded"))]
    lines += _skipped_lines([s for s in c.skipped if s not in unselected])
    if unselected:
        n = len(unselected)
        lines.append(f"{plural(n, 'tensor')} left out by --include/--exclude (listed in --format json)")
    return lines


def _skipped_lines(skipped: Sequence[Skipped], most: int = 10) -> list[str]:
    """A line per skipped tensor; beyond `most`, a line per reason with a count and the first names."""
    if len(skipped) <= most:
        return [f"skipped {s.name} ({s.dtype}): {s.reason}" for s in skipped]
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s.reason, []).append(s.name)
    lines = []
    for reason, names in by_reason.items():
        first = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        lines.append(f"skipped {plural(len(names), 'tensor')} ({first}): {reason}")
    return [*lines, "(every skipped tensor is listed in --format json)"]


def _percent(x: float | None) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return _fmt(x)
    return f"{x * 100:.3g}%"


def _cosine(c: float | None) -> str:
    """A cosine; one close to 1 as 1-ε, so nearly parallel tensors still read apart."""
    if c is None or not math.isfinite(c) or c < 0.9999 or c == 1.0:
        return _fmt(c)
    return f"1-{1 - c:.2g}"


def _diff_lines(d: DiffReport, p: float) -> list[str]:
    s = d.stats
    name = symbols("‖A−B‖" if p == 2 else f"‖A−B‖{_ord(p)}")
    identical = sum(r.identical for r in d.tensors)
    head = f"{printable(d.a)} -> {printable(d.b)}: {name} {_fmt(s.diff_norm)}"
    head += f" (rel {_percent(s.rel)}, cosine {_cosine(s.cosine)}) over {plural(len(d.tensors), 'tensor')}"
    head += f", {identical:,} identical" if identical else ""
    lines = [head]
    different = [r for r in d.shown if not r.identical]
    hidden = len(d.tensors) - identical - len(different)
    if different:
        headers = ["tensor", "dtype", "shape", "|A|", "|A-B|", "rel", "share", "cosine", "max |a-b|", "changed"]
        rows = []
        for r in different:
            dtype = r.dtype_a if r.dtype_a == r.dtype_b else f"{r.dtype_a}/{r.dtype_b}"
            rows.append([
                printable(r.name), dtype, _shape_text(r.shape), _fmt(r.norm_a), _fmt(r.diff_norm), _percent(r.rel),
                share_bar(r.share), _cosine(r.cosine), _fmt(r.max_abs_diff), f"{r.changed:,}",
            ])  # fmt: skip
        lines += table(headers, rows, right=(3, 4, 5, 7, 8, 9))
    if hidden > 0:
        lines.append(
            f"{plural(hidden, 'other tensor')} that {'differs' if hidden == 1 else 'differ'} not shown (--top)"
        )
    if identical:
        listed = " (listed in --format json)" if any(r.identical for r in d.shown) else ""
        lines.append(f"{plural(identical, 'tensor')} identical, bit for bit{listed}")
    if d.groups is not None:
        rows = (
            [
                printable(g.name),
                f"{g.tensors:,}",
                _fmt(g.norm_a),
                _fmt(g.diff_norm),
                _percent(g.rel),
                share_bar(g.share),
            ]
            for g in d.groups
        )
        lines += _showing_groups(d.groups, d.group_count)
        lines += table(["group", "tensors", "|A|", "|A-B|", "rel", "share"], rows, right=(1, 2, 3, 4))
    for r in d.others:
        state = "the same" if r.identical else "different" if r.changed is None else "the same values"
        dtypes = r.dtype_a if r.dtype_a == r.dtype_b else f"{r.dtype_a} vs {r.dtype_b}"
        lines.append(f"compared for sameness only: {printable(r.name)} ({dtypes}): {state}")
    if d.only_a:
        lines.append(f"only in A: {', '.join(printable(n) for n in d.only_a)}")
    if d.only_b:
        lines.append(f"only in B: {', '.join(printable(n) for n in d.only_b)}")
    if d.metadata_differs:
        lines.append(f"metadata differs: {', '.join(printable(k) for k in d.metadata_differs)}")
    for m in d.mismatched:
        lines.append(
            f"not compared: {printable(m.name)} ({_shape_text(m.shape_a)} vs {_shape_text(m.shape_b)}): {m.reason}"
        )
    return lines
