"""What every report shares: the escaping of text from files, the plain table, strict JSON and CSV."""

from __future__ import annotations

import codecs
import functools
import io
import itertools
import json
import math
import re
import unicodedata
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import Any, ClassVar

from clipcli.errors import printable

SCHEMA = 1


class Report:
    """A command's report, rendered by its type: the subclass says what its JSON holds (`_json`), its CSV rows
    (`_csv`) and its table's blocks of lines (`_blocks`); this class writes them."""

    command: ClassVar[str]

    def _json(self) -> dict[str, Any]:
        raise NotImplementedError

    def _csv(self, w: Any) -> None:
        raise NotImplementedError

    def _blocks(self) -> list[list[str]]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The content of `to_json()`: plain dicts, lists, strings and numbers (non-finite ones as "nan",
        "inf", "-inf")."""
        return json.loads(self.to_json())

    def to_json(self) -> str:
        """The report as one strict JSON object (see the README for the schema)."""
        return _safe(_dumps(self._json())) + "\n"

    def to_csv(self) -> str:
        """A header row, then the report's rows; the last column, `kind`, says what a row is."""
        import csv  # (only a CSV report needs it: a run's start-up is most of a small checkpoint's time)

        buf = io.StringIO()
        self._csv(csv.writer(buf, lineterminator="\n"))
        return buf.getvalue()

    def to_text(self, encoding: str = "utf-8") -> str:
        """The report for a person: plain text, names escaped, no line wrapped; for an output in `encoding`,
        table cells hold only what it can show (escaped before the columns are measured) and bars are '#'s
        where it has no block characters."""
        token = _ENCODING.set(codecs.lookup(encoding).name)
        try:
            blocks = self._blocks()
        finally:
            _ENCODING.reset(token)
        # every line escaped whole: a reason, a metadata value or a mismatch comes from a file as much as a name
        return "\n\n".join("\n".join(b if "".join(b).isprintable() else map(printable, b)) for b in blocks) + "\n"


# --- Text -------------------------------------------------------------------------------------------


def plural(n: int, noun: str) -> str:
    """'1 tensor', '2 tensors'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def showing(shown: int, count: int, noun: str) -> list[str]:
    """The line 'showing K of N tensors' where --top shows fewer rows than there are; none where it does not."""
    return [f"showing {shown:,} of {plural(count, noun)}"] if shown < count else []


def fmt(x: float | None) -> str:
    """A number for the table: six significant digits, nan, inf, or - for none."""
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"


def size(n: int) -> str:
    """A byte count in binary units: '512 B', '32.0 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def shape_text(shape: tuple[int, ...]) -> str:
    """'256x64', or 'scalar'."""
    return "x".join(map(str, shape)) if shape else "scalar"


def ord_value(p: float) -> Any:
    """An order as the report writes it: 2, 1.5 or 'inf'."""
    return "inf" if math.isinf(p) else int(p) if p == int(p) else p


def shared_lines(shared: Sequence[Sequence[str]], written: bool, kept: Sequence[Sequence[str]] = ()) -> list[str]:
    """A line per group of tensors on one storage (tied weights in a PyTorch file); `kept`: the groups an output
    written keeps on one storage (a .pt's, of one view), the others written as separate copies."""
    together = {name for names in kept for name in names}
    lines = []
    for names in shared:
        if not written:
            what = "one storage in the file"
        elif set(names) <= together:
            what = "one storage in the output"
        elif set(names) & together:
            what = (
                "one storage in the output for " + ", ".join(n for n in names if n in together) + ", copies of the rest"
            )
        else:
            what = "written as separate copies"
        lines.append(f"tied: {', '.join(names)} ({what})")
    return lines


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


_LEVELS = " ▁▂▃▄▅▆▇█"
_ASCII_LEVELS = " .:-=+*#@"


def histogram(levels: Sequence[int]) -> str:
    """One character per level in [0, 8] (0: none), as rising blocks, or ASCII where the output cannot show them."""
    chars = _LEVELS if _holds(_ENCODING.get(), _LEVELS) else _ASCII_LEVELS
    return "".join(chars[n] for n in levels)


@functools.lru_cache
def _holds(encoding: str, text: str) -> bool:
    """Whether `encoding` holds `text`."""
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


_ASCII_SYMBOLS = str.maketrans({"‖": "|", "−": "-", "Δ": "delta"})


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


# --- JSON -------------------------------------------------------------------------------------------


def num(x: float | None) -> Any:
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


COMPACT = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": "))
string = json.encoder.encode_basestring  # the encoder's own escaping, as COMPACT (ensure_ascii=False) uses it


def _dumps(value: Any, indent: str = "") -> str:
    """Strict JSON, indented down to records (a row, a group), each of which takes one line.

    A list of records is written by one call of the C encoder; a report of 10,000 tensors is written
    about as fast as it is read (see `_records`).
    """
    inner = indent + "  "
    if isinstance(value, Rendered):
        return f"[\n{inner}" + f",\n{inner}".join(value) + f"\n{indent}]" if value else "[]"
    if isinstance(value, dict) and not _record(value):
        items = [f"{inner}{COMPACT.encode(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
        if isinstance(value[0], dict) and _record(value[0]):  # a list of rows: all alike
            return _records(value, inner, indent)
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in value) + f"\n{indent}]"
    return COMPACT.encode(value)


def _records(rows: list[dict[str, Any]], inner: str, indent: str) -> str:
    """Rows that share their first key (as every list of rows here does), one on each line.

    The C encoder writes the whole list on one line, rows joined by '}, {"key": '; that text cannot
    occur inside a JSON string (a quote there is escaped), so breaking the line there changes only the
    whitespace between values, whatever the rows hold.
    """
    key = COMPACT.encode(next(iter(rows[0]), ""))
    text = COMPACT.encode(rows)[1:-1].replace(f"}}, {{{key}: ", f"}},\n{inner}{{{key}: ")
    return f"[\n{inner}{text}\n{indent}]"


class Rendered(list):
    """Records already written as JSON objects, one per line (the rows of 10,000 tensors: `norms.tensor_json`)."""


@functools.lru_cache(maxsize=1024)  # tensors share shapes: the text of each is made once
def shape_json(shape: tuple[int, ...]) -> str:
    """A shape as the encoder writes the list."""
    return f"[{', '.join(map(str, shape))}]"


def number(x: float | None) -> str:
    """A float (or None) as the encoder writes `num(x)`."""
    if x is None:
        return "null"
    if math.isfinite(x):
        return float.__repr__(x)
    return f'"{num(x)}"'


def _record(value: dict[str, Any]) -> bool:
    """A dict of scalars and lists of scalars (a row): one line. A dict holding dicts or lists of them is not."""
    for v in value.values():
        if isinstance(v, (dict, Rendered)) or (isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v)):
            return False
    return True


# --- CSV --------------------------------------------------------------------------------------------


def cell(text: str) -> str:
    """A CSV text cell (a path, a name): escaped as for a terminal, and prefixed with ' where a spreadsheet would
    take it for a formula (it starts with = + - @). Number cells never come here: -1.5 stays a number."""
    text = printable(text)
    return "'" + text if text[:1] in ("=", "+", "-", "@") else text


def csv_num(x: float | None) -> str:
    """A number cell: its repr, or empty for none."""
    return "" if x is None else repr(float(x))
