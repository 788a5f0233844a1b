"""The safetensors format: a header validated by the reference rules, and a streamed writer."""

from __future__ import annotations

import functools
import math
import operator
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat, starmap
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from clipcli.checkpoint.formats._common import gc_paused
from clipcli.checkpoint.plugin import Finding, Format, defect
from clipcli.checkpoint.source import LOCAL, Store, size_of
from clipcli.checkpoint.tensor import MAX_COUNT, Span, TensorInfo
from clipcli.errors import FileTypeError, MalformedError, UnsupportedError

MAX_HEADER = 100_000_000
# Headers up to this length are read by `_compact` where they can be (fast; its parts of the text cost about 800
# bytes a tensor at the peak, 400 more than `_object`'s); longer ones by `_object` (a header may list a million)
COMPACT_HEADER = 4 << 20
SAFETENSORS = "a safetensors file"
_JSON_SPACE = b" \t\r\n"


class Dtype(NamedTuple):
    """A safetensors dtype: its code, its NumPy / ml_dtypes name, its bits, and an array type if any."""

    code: str
    name: str
    bits: int
    array: np.dtype | None  # None: packed sub-byte or scale-only types, carried as bytes


def _dtypes() -> dict[str, Dtype]:
    table = [
        ("BOOL", np.dtype(np.bool_)),
        ("U8", np.dtype(np.uint8)),
        ("I8", np.dtype(np.int8)),
        ("U16", np.dtype(np.uint16)),
        ("I16", np.dtype(np.int16)),
        ("U32", np.dtype(np.uint32)),
        ("I32", np.dtype(np.int32)),
        ("U64", np.dtype(np.uint64)),
        ("I64", np.dtype(np.int64)),
        ("F16", np.dtype(np.float16)),
        ("F32", np.dtype(np.float32)),
        ("F64", np.dtype(np.float64)),
        ("C64", np.dtype(np.complex64)),
    ]
    out = {code: Dtype(code, dt.name, dt.itemsize * 8, dt) for code, dt in table}
    # Newer types with no arithmetic here (packed sub-byte floats): carried as bytes.
    for code, name, bits in [
        ("F6_E2M3", "float6_e2m3fn", 6),
        ("F6_E3M2", "float6_e3m2fn", 6),
        ("F4", "float4_e2m1fn", 4),
    ]:
        out[code] = Dtype(code, name, bits, None)
    return out


# ml_dtypes' types, by their names there: added to DTYPES (and ml_dtypes imported) when a header first names one
_ML_CODES = {
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",  # the scale type: read as a PyTorch file's is
}
DTYPES = _dtypes()  # (those of ml_dtypes once `dtype_by_code` has added them)
BY_ARRAY_DTYPE = {d.array: d for d in DTYPES.values() if d.array is not None}
CODES = frozenset(DTYPES) | frozenset(_ML_CODES)  # every code a header may name


def dtype_by_code(code: str) -> Dtype | None:
    """The Dtype a header's code names, or None. ml_dtypes is imported (and its types added to DTYPES and
    BY_ARRAY_DTYPE) when a header first names one of its types: a file of NumPy's own types need not (5 ms)."""
    d = DTYPES.get(code)
    if d is None and code in _ML_CODES:
        _add_ml_dtypes()
        d = DTYPES.get(code)
    return d


@functools.cache
def _add_ml_dtypes() -> None:
    import ml_dtypes

    for code, name in _ML_CODES.items():
        array = np.dtype(getattr(ml_dtypes, name))
        DTYPES[code] = BY_ARRAY_DTYPE[array] = Dtype(code, array.name, array.itemsize * 8, array)


# One tensor of a header: (start, nbytes, name, dtype, shape), its data at `start` (absolute) for `nbytes`
# bytes. A plain tuple, ordered as the reference reader sorts (by start, then end: an empty tensor before
# one that starts there); a header may list 10,000 tensors.
Entry = tuple[int, int, str, Dtype, tuple[int, ...]]
# The same of every tensor, as five lists: their starts, sizes, names, dtypes and shapes.
Columns = tuple[list[int], list[int], list[str], list[Dtype], list[tuple[int, ...]]]
_DATA_ORDER = operator.itemgetter(0, 1)


class _Parsed(NamedTuple):
    """A tensor's object in the header as parsed (`_object`), well formed by the reference reader's rules of
    an entry (`_checked_entry` says what is wrong with any other): `shape` as a tuple, and `dtype` the shared
    Dtype of its code."""

    dtype: Dtype
    shape: tuple[Any, ...]
    begin: Any
    end: Any

    def as_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype.code, "shape": list(self.shape), "data_offsets": [self.begin, self.end]}


def _object(pairs: list[tuple[str, Any]]) -> Any:
    """A JSON object of the header: a well-formed tensor's, in the reference writer's key order, as a `_Parsed`
    (a fraction of a dict's memory, and a header may list a million), checked here in few steps, as the JSON
    parser hands it over; any other as a dict without duplicate keys."""
    if len(pairs) == 3:
        (k1, code), (k2, shape), (k3, offsets) = pairs
        if k1 == "dtype" and k2 == "shape" and k3 == "data_offsets" and type(shape) is list and type(offsets) is list:
            d = dtype_by_code(code) if type(code) is str else None
            if d is not None and len(offsets) == 2:
                begin, end = offsets
                if (
                    type(begin) is int
                    and type(end) is int
                    and 0 <= begin < end  # data, so no dimension is 0 and none overflows (see `_checked_entry`)
                    and _counts(shape)
                    and math.prod(shape) * d.bits == 8 * (end - begin)
                ):
                    return _Parsed(d, tuple(shape), begin, end)
    return _no_duplicates(pairs)


class _Repeated(dict):
    """A JSON object of the header that gives a key twice (the last value kept, as the reference reader keeps it
    where it takes one); `key` the first one given twice. Refused where it matters (`_refuse_repeated`)."""

    key: str


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        out = _Repeated(out)
        out.key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return out


_FIELDS = ("dtype", "shape", "data_offsets")


def _refuse_repeated(header: dict[str, Any]) -> None:
    """Refuses a key given twice where it matters: a tensor's name or `__metadata__`, a key of `__metadata__`
    (clipcli's choice: the reference reader keeps the last, one of two tensors or values silently), a field of a
    tensor's entry (the reference reader's "duplicate field"). Elsewhere (a key the reference reader ignores, and
    what its value holds) a repeated key is taken, as it takes it."""
    if type(header) is _Repeated:
        raise MalformedError(f"duplicate key {header.key!r} in the header")
    for name, value in header.items():
        if type(value) is _Repeated and (name == "__metadata__" or value.key in _FIELDS):
            raise MalformedError(f"duplicate key {value.key!r} in the header")


def read_header(path: Path, f: BinaryIO, size: int) -> tuple[dict[str, str], Columns]:
    """Parses and validates a safetensors header; returns the metadata and the tensors in data order, as columns.

    Raises:
        FileTypeError: when the file is evidently something else.
        MalformedError: when a reference rule is broken (naming its `defect` kind where the data's layout is).
    """
    n, metadata, header = _parse(path, f, size, compact=True)
    base = 8 + n
    if type(header) is tuple:  # `_compact`'s
        columns = header
    else:
        entries = [  # (`_entry`, its common case written out: a header may list a million)
            (base + info.begin, info.end - info.begin, name, info.dtype, info.shape)
            if type(info) is _Parsed
            else _checked_entry(path, name, info, base)
            for name, info in header.items()
        ]
        columns = tuple(map(list, zip(*entries, strict=True))) if entries else ([], [], [], [], [])
    columns = _in_data_order(columns)
    if not _contiguous(columns[0], columns[1], base, size):
        for error in _layout_defects(path, list(zip(*columns, strict=True)), base, size):
            raise error
    return metadata, columns


def _in_data_order(columns: Columns) -> Columns:
    """The columns of entries in data order: as the reference reader sorts them, by start, then end (an empty
    tensor before one that starts there)."""
    starts, sizes = columns[0], columns[1]
    if all(map(operator.lt, starts, starts[1:])):  # (as a writer lays them out)
        return columns
    order = sorted(range(len(starts)), key=lambda i: (starts[i], sizes[i]))
    return tuple([column[i] for i in order] for column in columns)  # type: ignore[return-value]


def findings(path: Path, store: Store = LOCAL) -> list[Finding]:
    """Every rule of `read_header` a file breaks: each tensor's entry, then the layout of their data (gaps,
    overlaps, a file truncated or with bytes after the data), from the header and the file's size.

    Raises:
        FileTypeError: when the file is evidently something else.
    """
    with store.open(path) as f, gc_paused():
        size = size_of(f)
        try:
            n, _, header = _parse(path, f, size)
        except FileTypeError:
            raise
        except (MalformedError, UnsupportedError) as e:  # no header to go on with
            return [Finding.of(e, "header", path)]
    out: list[Finding] = []
    entries: list[Entry] = []
    for name, info in header.items():
        try:
            entries.append(_entry(path, name, info, 8 + n))
        except (MalformedError, UnsupportedError) as e:
            out.append(Finding.of(e, "header", path))
            offsets = info.as_json() if type(info) is _Parsed else info
            offsets = offsets.get("data_offsets") if isinstance(offsets, dict) else None
            if type(offsets) is list and len(offsets) == 2 and _counts(offsets) and offsets[0] <= offsets[1]:
                entries.append((8 + n + offsets[0], offsets[1] - offsets[0], name, DTYPES["U8"], ()))  # its place
    entries.sort(key=_DATA_ORDER)
    return out + [Finding.of(d) for d in _layout_defects(path, entries, 8 + n, size)]


def _parse(
    path: Path, f: BinaryIO, size: int, compact: bool = False
) -> tuple[int, dict[str, str], dict[str, Any] | Columns]:
    """The header's length, metadata and tensors' objects (unchecked), by the reference rules of the length
    prefix, the JSON and `__metadata__`; with `compact`, the tensors' entries instead where `_compact` reads
    them (well formed, in the header's order)."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise _not_safetensors(path, f, f"only {size} bytes, too short for a safetensors header", "truncated")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER:
        raise _not_safetensors(path, f, f"header length {n} exceeds the limit of {MAX_HEADER} bytes")
    if 8 + n > size:
        raise _not_safetensors(path, f, f"header length {n} runs past the end of the file ({size} bytes)", "truncated")
    raw = f.read(n)
    if raw.lstrip(_JSON_SPACE)[:1] != b"{":  # the reference reader takes JSON whitespace before it
        raise _not_safetensors(path, f, "the header does not start with '{'")
    try:
        text = raw.decode("utf-8")
        found = _compact(raw, text, 8 + n) if compact and n <= COMPACT_HEADER else None
        if found is not None:  # (its numbers are digits alone, checked short)
            return n, *found
        from clipcli.checkpoint.formats import _strict_json  # (the rules of any other header, by the checking parse)

        del raw  # (up to 100 MB: not held beside its text and what it parses into)
        header = _strict_json.loads(text, _object)
        del text
        if isinstance(header, dict):
            _refuse_repeated(header)
        if type(header) is _Parsed:  # the whole header is one object of the keys a tensor's has
            header = header.as_json()
    except MalformedError as e:
        raise MalformedError(e.message, path) from e
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedError(f"the header is not valid UTF-8 JSON ({_short(e)})", path) from e
    if not isinstance(header, dict):
        raise MalformedError("the header is not a JSON object", path)
    metadata = header.pop("__metadata__", None)
    if type(metadata) is _Parsed:
        metadata = metadata.as_json()
    if metadata is None:  # absent, or null as the reference reader takes it
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise MalformedError("__metadata__ must map strings to strings", path)
    return n, metadata, header


_NUMBER = "(?:0|[1-9][0-9]{0,18})"  # JSON's integers without a sign, below 10**19 (longer: the checking parse)
_OFFSET = "(?:0|[1-9][0-9]{0,17})"  # and below 10**18, so below MAX_COUNT, also times 8
_PAIRS = re.compile(rf"(?::\[{_OFFSET},{_OFFSET}\]\}},)*")  # every tensor's data offsets, as a header has them
_SHAPE = re.compile(rf":\[(?:{_NUMBER}(?:,{_NUMBER})*)?\],")  # the text between "shape" and "data_offsets"
_ESCAPED = bytes(range(32)) + b"\\"  # what a JSON string holds only escaped, and the escapes
_HEAD = operator.itemgetter(slice(2))
_BITS, _NAME, _ARRAY = map(operator.attrgetter, ("bits", "name", "array"))


def _compact(raw: bytes, text: str, base: int) -> tuple[dict[str, str], Columns] | None:
    """The metadata and entries (their data from `base`; `Columns` in the header's order) of a header (`raw`,
    decoded as `text`) laid out as the reference writer lays it out: no space but the padding at its end,
    `__metadata__` (of strings) first if at all, each tensor's object of its three keys in their order, no escape
    in any string, no key twice; every entry well formed as `_object` checks one. None for any other header,
    which `_object`'s parse then reads, refuses or names the duplicate key of.

    Found in a few passes over all of them, not a call per tensor (a header may list 10,000 tiny ones): with no
    escape, every `"` opens or closes a string, so splitting the text at them gives the strings at odd places
    and the text between them at even ones, each tensor's ten of them at fixed places.
    """
    if len(raw.translate(None, _ESCAPED)) != len(raw):
        return None
    parts = text.rstrip(" ").split('"')
    metadata: dict[str, str] = {}
    first = 1  # the place of the first tensor's name
    if parts[0] != "{" or len(parts) < 11:
        return None
    if parts[1] == "__metadata__":
        if parts[2] in (":{},", ":null,"):
            first = 3
        elif parts[2] == ":{":  # pairs of strings: key, ":", value, "," (after the last "},")
            i = 4
            while i + 2 < len(parts) and parts[i] == ":" and parts[i + 2] == ",":
                i += 4
            if i + 2 >= len(parts) or parts[i] != ":" or parts[i + 2] != "},":
                return None
            metadata = dict(zip(parts[3 : i + 1 : 4], parts[5 : i + 3 : 4], strict=True))
            if len(metadata) != i // 4:  # a key twice
                return None
            first = i + 3
        else:
            return None
    count, rest = divmod(len(parts) - first, 10)
    if rest or not count:
        return None
    fixed = [(1, ":{"), (2, "dtype"), (3, ":"), (5, ","), (6, "shape"), (8, "data_offsets")]
    if any(set(parts[first + i :: 10]) != {want} for i, want in fixed):
        return None
    names, codes, shapes, offsets = (parts[first + i :: 10] for i in (0, 4, 7, 9))
    if not offsets[-1].endswith("]}}"):
        return None
    offsets[-1] = offsets[-1][:-1] + ","  # (as the others end)
    # Every one starts ":[" and, joined, they are units ":[begin,end]},": then each is one unit (the joined text
    # holds as many ":[" as units, one at each one's start)
    pairs = "".join(offsets)
    if set(map(_HEAD, offsets)) != {":["} or _PAIRS.fullmatch(pairs) is None:
        return None
    alike = {}  # each shape's text parsed once (a header holds few)
    for shape in set(shapes):
        if _SHAPE.fullmatch(shape) is None:
            return None
        alike[shape] = tuple(map(int, shape[2:-2].split(","))) if shape != ":[]," else ()
    dtypes = list(map(DTYPES.get, codes))
    if None in dtypes:  # (ml_dtypes' types, added when first named)
        dtypes = list(map(dtype_by_code, codes))
    if None in dtypes or len(set(names)) < count or "__metadata__" in names:
        return None
    counts = {written: math.prod(shape) for written, shape in alike.items()}
    if not all(map(_counts, alike.values())) or max(counts.values()) >= 1 << 56:  # (times bits: within int64)
        return None
    numbers = np.fromstring(pairs[2:-3].replace("]},:[", ","), np.int64, sep=",")  # (the digits checked above)
    if numbers.size != 2 * count:
        return None
    begins, sizes = numbers[0::2], numbers[1::2] - numbers[0::2]
    bits = np.fromiter(map(operator.mul, map(counts.__getitem__, shapes), map(_BITS, dtypes)), np.int64, count)
    # data, so no dimension is 0 and none overflows (see `_checked_entry`)
    if sizes.min() <= 0 or not np.array_equal(bits, 8 * sizes):
        return None
    return metadata, ((begins + base).tolist(), sizes.tolist(), names, dtypes, list(map(alike.__getitem__, shapes)))


def _contiguous(starts: list[int], sizes: list[int], base: int, size: int) -> bool:
    """Whether entries (in data order: their starts and sizes) break none of `_layout_defects`' rules: each starts
    where the one before ends, the first at `base`, the last ends at `size`."""
    if not starts:
        return base == size
    ends = list(map(operator.add, starts, sizes))
    return starts[0] == base and ends[-1] == size and starts[1:] == ends[:-1]


def _layout_defects(path: Path, entries: list[Entry], base: int, size: int) -> Iterator[MalformedError]:
    """The reference rules of the data's layout that entries (in data order, their data from `base`) break,
    in order: each tensor starts where the one before ends (`gap`, `overlap`), the first at 0, and the data
    ends at the end of the file (`truncated`, `trailing-bytes`)."""
    end = base
    for start, nbytes, name, _, _ in entries:
        if start != end:
            message = (
                f"data offsets {start - base}..{start - base + nbytes} are not contiguous with "
                f"the previous tensor (expected to start at {end - base})"
                if end > base
                else f"data offsets {start - base}..{start - base + nbytes}: the first tensor's data must start at 0"
            )
            yield defect("gap" if start > end else "overlap", message, path, name)
        end = max(end, start + nbytes)
    if end != size:
        message = f"the tensors' data ends at byte {end - base} but the file holds {size - base} bytes of data"
        yield defect("truncated" if end > size else "trailing-bytes", message, path)


def open_file(path: Path, store: Store = LOCAL) -> tuple[dict[str, str], list[TensorInfo]]:
    """The metadata and tensors of a .safetensors file, from its header alone."""
    with store.open(path) as f, gc_paused():
        metadata, (starts, sizes, names, dtypes, shapes) = read_header(path, f, size_of(f))
        # (made by maps, in C but for each TensorInfo's __init__: a header may list 10,000 tiny tensors)
        spans = map(tuple.__new__, repeat(Span), zip(starts, repeat(None)))  # Span(start), without a call each
        file = repeat(str(path))
        fields = names, map(_NAME, dtypes), shapes, sizes, file, map(_ARRAY, dtypes), repeat(False), spans
        return metadata, list(starmap(TensorInfo, zip(*fields, strict=False)))  # (`repeat`s end with the rest)


def write(
    f: BinaryIO,
    tensors: list[TensorInfo],
    metadata: dict[str, str],
    chunks: Callable[[TensorInfo], Iterable[np.ndarray]],
    expect: Callable[[TensorInfo, int], None],
    store: Store = LOCAL,
) -> None:
    """Writes a header for the tensors, then their data in C order, in the order given."""
    from clipcli.checkpoint.atomic import write_data  # (the writing side: not imported by a run that only reads)

    f.write(header(tensors, metadata))
    for t in tensors:
        expect(t, write_data(f, chunks(t)))


def header(tensors: list[TensorInfo], metadata: dict[str, str]) -> bytes:
    """The header of a file of these tensors, laid out in order."""
    return header_bytes([(t.name, dtype_of(t), t.shape, t.nbytes) for t in tensors], metadata)


def dtype_of(t: TensorInfo) -> Dtype:
    """The safetensors dtype of a tensor: of its array type, or by name for types carried as bytes.

    Raises:
        UnsupportedError: when safetensors has no such type.
    """
    if t.array_dtype is not None:
        return dtype_for(t.array_dtype)
    for d in DTYPES.values():
        if d.name == t.dtype:
            return d
    raise UnsupportedError(f"safetensors has no dtype for {t.dtype}")


def _short(e: Exception) -> str:
    return str(e).split("\n")[0][:120]


def _not_safetensors(path: Path, f: BinaryIO, reason: str, kind: str = "header") -> Exception:
    """A FileTypeError naming what the file really is, or a MalformedError of defect `kind` when it is nothing else."""
    from clipcli.checkpoint import registry  # here: only a file that is no safetensors needs every format

    f.seek(0)
    what = registry.describe(f.read(registry.HEAD_BYTES))
    if what in (SAFETENSORS, registry.UNKNOWN):
        return defect(kind, reason, path)
    return FileTypeError(f"not a safetensors file: {what}", path)


def _entry(path: Path, name: str, info: Any, base: int) -> Entry:
    """A tensor's entry, checked as the reference reader checks it: a `_Parsed` was (by `_object`),
    `_checked_entry` says what is wrong with any other."""
    if type(info) is _Parsed:
        return base + info.begin, info.end - info.begin, name, info.dtype, info.shape
    return _checked_entry(path, name, info, base)


def _checked_entry(path: Path, name: str, info: Any, base: int) -> Entry:
    if not isinstance(info, dict):
        raise MalformedError("the tensor's entry is not a JSON object", path, name)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise MalformedError("missing or non-string 'dtype'", path, name)
    d = dtype_by_code(dtype)
    if d is None:
        raise UnsupportedError(f"unknown dtype {dtype!r}", path, name)
    if type(shape) is not list or not _counts(shape):
        raise MalformedError(f"'shape' must be a list of integers from 0 to 2**63 - 1, got {_shown(shape)}", path, name)
    if not (type(offsets) is list and len(offsets) == 2 and _counts(offsets)):
        got = _shown(offsets)
        raise MalformedError(f"'data_offsets' must be two integers from 0 to 2**63 - 1, got {got}", path, name)
    begin, end = offsets
    if end < begin:
        raise MalformedError(f"data offsets {begin}..{end} end before they begin", path, name)
    if _overflows(shape, d.bits):
        raise MalformedError(
            f"shape {tuple(shape)} of {dtype} overflows 64 bits, as the reference reader counts it", path, name
        )
    bits = math.prod(shape) * d.bits
    if bits % 8 or bits // 8 != end - begin:
        raise MalformedError(
            f"shape {tuple(shape)} of {dtype} needs {bits // 8 if bits % 8 == 0 else bits / 8} bytes but data "
            f"offsets {begin}..{end} "
            f"hold {end - begin}",
            path,
            name,
        )
    return base + begin, end - begin, name, d, tuple(shape)


def _shown(value: Any) -> str:
    """A header's value as JSON, cut short (a number may have 4,000 digits)."""
    import json  # (for a message: a run that reads a well-formed header does not import it)

    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def _counts(values: Sequence[Any]) -> bool:
    """Whether every value is an int from 0 to 2**63 - 1 (JSON's integers; not a bool, not a float). The
    reference reader takes up to 2**64 - 1, but no tensor library holds a dimension past 2**63 (NumPy's intp,
    torch's int64), nor a file an offset."""
    for x in values:  # noqa: SIM110 - a loop is twice as fast as all() over a generator (twice per tensor)
        if type(x) is not int or not 0 <= x < MAX_COUNT:
            return False
    return True


_U64 = 1 << 64


def _overflows(shape: list[int], bits: int) -> bool:
    """Whether the element count, multiplied out left to right, or its bits pass 64 bits on the way: the
    reference reader refuses such a shape even when a later 0 makes it empty."""
    n = 1
    for x in shape:
        n *= x
        if n >= _U64:
            return True
    return n * bits >= _U64


def header_bytes(entries: Sequence[tuple[str, Dtype, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header for tensors (name, dtype, shape, nbytes) laid out in order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype.code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    import json  # (the writing side: not imported by a run that only reads)

    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # as the reference writer does: data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def dtype_for(array_dtype: np.dtype) -> Dtype:
    """The safetensors dtype of a NumPy / ml_dtypes array type."""
    native = np.dtype(array_dtype).newbyteorder("=")
    if native.num >= 256:  # a type NumPy does not know itself (NPY_USERDEF on): ml_dtypes'
        _add_ml_dtypes()
    d = BY_ARRAY_DTYPE.get(native)
    if d is None:
        raise UnsupportedError(f"safetensors has no dtype for {np.dtype(array_dtype).name}")
    return d


def _sniff(head: bytes, f: BinaryIO | None = None) -> bool:
    """A little-endian header length below 4 GiB, then a JSON object (after JSON whitespace)."""
    return len(head) >= 9 and head[8:].lstrip(_JSON_SPACE)[:1] == b"{" and int.from_bytes(head[:8], "little") < 1 << 32


def _describe_head(head: bytes) -> str | None:
    return SAFETENSORS if _sniff(head) else None


FORMAT = Format(
    "safetensors",
    (".safetensors",),
    sniff=_sniff,
    describe=_describe_head,
    open_file=open_file,
    write=write,
    header=header,
    check_tensor=dtype_of,
    c_order=True,
    layout_keys=frozenset({"format"}),
    findings=findings,
)
