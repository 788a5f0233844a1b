"""The .npy format: its header parsed without eval or pickle, and written as `np.save` writes it."""

from __future__ import annotations

import ast
import io
import math
import re
import struct
import tokenize
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from clipcli.checkpoint.atomic import write_data
from clipcli.checkpoint.formats._common import shown
from clipcli.checkpoint.formats._pickle_audit import Audit, PickleAudit
from clipcli.checkpoint.plugin import Format, Opened
from clipcli.checkpoint.source import LOCAL, Store, size_of
from clipcli.checkpoint.tensor import MAX_COUNT, Span, TensorInfo
from clipcli.errors import ClipcliError, FileTypeError, MalformedError, UnsupportedError

MAGIC = b"\x93NUMPY"
MAX_HEADER = 10_000  # NumPy's own default `max_header_size`: longer headers are refused as unsafe to parse
_PORTABLE_KINDS = "biufc"
_ALIGN = 64
_GROWTH_DIGITS = 21
_MAX_BYTES = MAX_COUNT  # an array's size in bytes must fit NumPy's intp
_MAX_DIGITS = len(str(MAX_COUNT))  # of a decimal number in a header
MAX_PICKLE = 256 << 20  # bytes of an object array's pickle read, as of a torch.save file's (formats/torch.py)


class NpyHeader(NamedTuple):
    """A parsed .npy header: the data follows at `data_offset` bytes from the start of the member.

    `raw` is the header as stored (magic included); `numeric` is False for types clipcli carries as bytes
    (strings, structured records, float128, object arrays); `pickled` is True for an object array, whose data
    is a pickle of the whole array (`np.save` writes it so) of whatever length, never loaded here.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int
    raw: bytes = b""
    numeric: bool = True
    pickled: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def open_file(path: Path, store: Store = LOCAL, audit: Audit | None = None) -> tuple[dict[str, str], list[TensorInfo]]:
    """The one tensor of a .npy file, named after the file's stem; the pickle of an object array is counted
    in `audit`, never loaded."""
    name = path.name[: -len(".npy")] if path.name.endswith(".npy") else path.stem
    with store.open(path) as f:
        if f.read(6) != MAGIC:
            from clipcli.checkpoint import registry  # here: only a file that is no .npy needs every format

            f.seek(0)
            raise FileTypeError(f"not a .npy file: {registry.describe(f.read(registry.HEAD_BYTES))}", path)
        f.seek(0)
        header = read_npy_header(f)
        size = size_of(f)
        if header.pickled:
            try:
                audit_pickle(f, size - header.data_offset, Audit() if audit is None else audit)
            except ClipcliError as e:
                e.path, e.tensor = e.path or str(path), e.tensor or name
                raise
            return {}, [numpy_tensor(name, header, path, Span(header.data_offset), 0, size - header.data_offset)]
    if header.data_offset + header.nbytes != size:
        raise MalformedError(
            f"shape {header.shape} of {header.dtype.name} needs {header.nbytes} bytes of data, "
            f"the file holds {size - header.data_offset}",
            path,
        )
    return {}, [numpy_tensor(name, header, path, Span(header.data_offset))]


def open_audited(path: Path, store: Store = LOCAL) -> Opened:
    """`open_file`, with the pickle audit of an object array (none for other arrays)."""
    audit = Audit()
    metadata, tensors = open_file(path, store, audit)
    return Opened(metadata, tensors, [path], "npy", audits=pickle_audits(path, tensors, audit))


def pickle_audits(path: Path, tensors: list[TensorInfo], audit: Audit) -> tuple[PickleAudit, ...]:
    """The audit of a file's object arrays, if it holds any: calls beyond what NumPy calls to rebuild any object
    array are what `np.load(allow_pickle=True)` would run."""
    if not any(t.prefix and read_npy_header(io.BytesIO(t.prefix)).pickled for t in tensors):
        return ()
    return (audit.result(str(path), numpy_pickle_globals(), "np.load(allow_pickle=True)"),)


def read_npy_header(f: BinaryIO, head: bytes = b"") -> NpyHeader:
    """Reads and validates a .npy header from the current position of `f` (after `head`, read already).

    Raises:
        MalformedError: for a bad magic, version, length or dictionary.
        UnsupportedError: for raw bytes that hide a bfloat16 or float8 type.
    """
    prefix = head + f.read(8 - len(head))
    if not (prefix.startswith(MAGIC) or MAGIC.startswith(prefix)):
        raise MalformedError("not a .npy member (bad magic string)")
    if len(prefix) < 8:
        raise MalformedError("truncated .npy header")
    major, minor = prefix[6], prefix[7]
    if (major, minor) not in ((1, 0), (2, 0), (3, 0)):
        raise MalformedError(f"unknown .npy format version {major}.{minor}")
    size_bytes = f.read(2 if major == 1 else 4)
    if len(size_bytes) < (2 if major == 1 else 4):
        raise MalformedError("truncated .npy header")
    (n,) = struct.unpack("<H" if major == 1 else "<I", size_bytes)
    if n > MAX_HEADER:
        raise MalformedError(
            f"the .npy header is {n} bytes, more than the {MAX_HEADER} NumPy reads (its max_header_size): "
            "refused as unsafe to parse"
        )
    raw = f.read(n)
    if len(raw) < n:
        raise MalformedError("truncated .npy header")
    d = _literal(raw.decode("latin1" if major < 3 else "utf-8", "replace"), major)
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise MalformedError("the .npy header must be a dict with exactly 'descr', 'fortran_order' and 'shape'")
    shape, fortran, descr = d["shape"], d["fortran_order"], d["descr"]
    if not isinstance(shape, tuple) or not all(type(x) is int and 0 <= x < MAX_COUNT for x in shape):
        raise MalformedError(f"'shape' must be a tuple of non-negative integers below 2**63, got {shown(shape)}")
    if not isinstance(fortran, bool):
        raise MalformedError(f"'fortran_order' must be True or False, got {shown(fortran)}")
    dtype = _descr_dtype(descr)
    if math.prod(x for x in shape if x) * max(dtype.itemsize, 1) >= _MAX_BYTES:
        # NumPy's own limit, which it applies to the axes that are not 0 even when one is (np.load refuses)
        raise MalformedError(f"shape {shape} of {dtype.name} is larger than any array NumPy can hold")
    offset = 8 + len(size_bytes) + n
    return NpyHeader(dtype, shape, fortran, offset, prefix + size_bytes + raw, is_numeric(dtype), dtype.hasobject)


# The header `np.save` writes, read without `ast` (a tenth of the time: an .npz of thousands of members).
_PLAIN_HEADER = re.compile(
    r"\{'descr': '([<>|=]?[a-zA-Z]\d*)', 'fortran_order': (True|False), 'shape': \(([\d, ]*)\), \} *\n?"
)


def _literal(text: str, major: int) -> Any:
    """The header's dictionary, by `ast.literal_eval` (never eval); Python 2's `2L` integers read too."""
    plain = _PLAIN_HEADER.fullmatch(text)
    if plain is not None and (not plain[3] or "," in plain[3]):  # a tuple: empty, or with a comma
        dims = [d for d in plain[3].replace(" ", "").split(",")]
        if all(_decimal(d) for d in dims[:-1]) and (dims[-1] == "" or _decimal(dims[-1])):
            shape = tuple(int(d) for d in dims if d)
            return {"descr": plain[1], "fortran_order": plain[2] == "True", "shape": shape}
    try:
        _check_numbers(text)
        try:
            return ast.literal_eval(text)
        except SyntaxError:
            if major != 1:
                raise
            return ast.literal_eval(_without_long_suffixes(text))
    except (ValueError, SyntaxError, MemoryError, RecursionError, tokenize.TokenError) as e:
        raise MalformedError(f"the .npy header is not a Python literal ({type(e).__name__})") from e


def _decimal(digits: str) -> bool:
    return digits.isdecimal() and len(digits) <= _MAX_DIGITS


def _check_numbers(text: str) -> None:
    """Refuses a decimal number too long to be a dimension before Python converts it: a few thousand digits
    take quadratic time, and more than 4,300 raise a ValueError. (Hexadecimal converts in linear time and
    is checked once converted.)"""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        digits = token.string.rstrip("lL").replace("_", "")
        if token.type == tokenize.NUMBER and digits.isdecimal() and len(digits) > _MAX_DIGITS:
            raise MalformedError(f"the .npy header holds a number of {len(digits)} digits, more than any size needs")


def _without_long_suffixes(text: str) -> str:
    """Python 2 headers write long integers as `2L` (as NumPy does, drop the L after a number)."""
    tokens, after_number = [], False
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if not (after_number and token.type == tokenize.NAME and token.string in ("L", "l")):
            tokens.append(token)
        after_number = token.type == tokenize.NUMBER
    return tokenize.untokenize(tokens)


def _descr_dtype(descr: Any) -> np.dtype:
    if not isinstance(descr, (str, list)):
        raise MalformedError(f"'descr' must be a type string or a list of fields, got {descr!r}")
    try:
        dtype = np.lib.format.descr_to_dtype(descr)
    except Exception as e:  # NumPy parses type strings with its own grammar: "," raises SyntaxError
        raise MalformedError(f"unknown dtype {descr!r}") from e
    if dtype.kind == "V" and dtype.names is None and dtype.itemsize in (1, 2):
        raise UnsupportedError(f"dtype {descr!r} is raw bytes (bfloat16 or float8 saved without its type?)")
    return dtype


def is_numeric(dtype: np.dtype) -> bool:
    """Whether clipcli does arithmetic on the type (else it is listed and carried as bytes)."""
    return dtype.kind in _PORTABLE_KINDS and dtype.itemsize <= 16 and dtype not in (np.longdouble, np.clongdouble)


def type_name(dtype: np.dtype) -> str:
    """A dtype's name as reports show it: NumPy's name, or the type string for text and records."""
    if dtype.names is not None:
        return "structured"
    return dtype.str.lstrip("<>=|") if dtype.kind in "SUa" else dtype.name


def npy_header(dtype: np.dtype, shape: tuple[int, ...], fortran_order: bool = False) -> bytes:
    """The header `np.save` writes for an array of this dtype and shape (version 1.0, or 2.0 if large)."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran_order}, 'shape': {shape!r}, }}"
    if shape:  # NumPy leaves room to grow the first (or, in Fortran order, last) axis in place
        text += " " * (_GROWTH_DIGITS - len(repr(shape[-1 if fortran_order else 0])))
    for major, size_format in ((1, "<H"), (2, "<I")):
        prefix = 8 + struct.calcsize(size_format)
        pad = _ALIGN - (prefix + len(text) + 1) % _ALIGN
        body = (text + " " * pad + "\n").encode("latin1")
        if major == 2 or len(body) < 65536:
            return MAGIC + bytes([major, 0]) + struct.pack(size_format, len(body)) + body
    raise AssertionError("unreachable")


def check_portable(dtype: np.dtype | None, name: str) -> None:
    """Refuses a dtype that .npy cannot hold portably (bfloat16, float8, packed types)."""
    if dtype is None or dtype.kind not in _PORTABLE_KINDS or dtype.type.__module__ != "numpy":
        raise UnsupportedError(
            f"cannot write {'this dtype' if dtype is None else dtype.name} to .npy/.npz without losing it "
            "(NumPy has no portable type for it); "
            "write .safetensors instead",
            tensor=name,
        )


def write(
    f: BinaryIO,
    tensors: list[TensorInfo],
    metadata: dict[str, str],
    chunks: Callable[[TensorInfo], Iterable[np.ndarray]],
    expect: Callable[[TensorInfo, int], None],
    store: Store = LOCAL,
) -> None:
    """Writes one tensor as a .npy file (the metadata has nowhere to go)."""
    (t,) = tensors
    f.write(header(tensors, metadata))
    expect(t, write_data(f, chunks(t)))


def header(tensors: list[TensorInfo], metadata: dict[str, str]) -> bytes:
    """The header of a .npy file of the one tensor: as it was read, or as `np.save` writes it."""
    (t,) = tensors
    return t.prefix or npy_header(t.array_dtype, t.shape, t.fortran_order)


def audit_pickle(f: BinaryIO, size: int, audit: Audit) -> None:
    """Runs the pickle of an object array (`size` bytes from the current position of `f`) through clipcli's
    pickle machine, never NumPy's or Python's: what it names and would call is counted in `audit`; nothing
    is imported or called, and the array stays bytes carried whole.

    Bytes after the pickle's STOP are left alone, as `np.load(allow_pickle=True)` leaves them.

    Raises:
        UnsupportedError: for a pickle larger than clipcli reads.
        MalformedError: for a truncated or malformed pickle (UnsafePickleError: an opcode clipcli never runs).
    """
    from clipcli.checkpoint.formats._numpy_pickle import numpy_globals
    from clipcli.checkpoint.formats._pickle import unpickle_at

    if size > MAX_PICKLE:
        raise UnsupportedError(f"an object array pickled in {size:,} bytes, more than clipcli reads ({MAX_PICKLE:,})")
    data = f.read(size)
    if len(data) < size:
        raise MalformedError(f"the object array's pickle is truncated ({len(data)} of {size} bytes)")
    known = numpy_globals()
    unpickle_at(data, 0, lambda module, name: known.get(f"{module}.{name}"), audit=audit, placeholders=True)


def numpy_pickle_globals() -> frozenset[str]:
    """The NumPy globals that `np.load(allow_pickle=True)` calls for any object array (rebuilding the array and
    its dtype): the audit of an .npy or .npz warns only of calls beyond them."""
    from clipcli.checkpoint.formats._numpy_pickle import numpy_globals

    return frozenset(numpy_globals())


def numpy_tensor(
    name: str, header: NpyHeader, path: Path, location: Any, compression: int = 0, nbytes: int | None = None
) -> TensorInfo:
    """A tensor from a .npy header: numeric types in native byte order, others carried as bytes (`nbytes` of them:
    of an object array, its pickle's length)."""
    if not header.numeric:
        return TensorInfo(
            name, type_name(header.dtype), header.shape, header.nbytes if nbytes is None else nbytes, str(path), None,
            header.fortran_order, location, None, compression, header.raw,
        )  # fmt: skip
    native = header.dtype.newbyteorder("=")
    stored = None if header.dtype.isnative else header.dtype
    return TensorInfo(
        name, native.name, header.shape, header.nbytes, str(path), native, header.fortran_order, location, stored,
        compression,
    )  # fmt: skip


def carried_dtype(t: TensorInfo) -> np.dtype | None:
    """The NumPy type of a type carried as bytes (strings, records), from the .npy header it keeps, if any; None
    for an object array, whose bytes are a pickle that is never loaded."""
    header = read_npy_header(io.BytesIO(t.prefix)) if t.prefix else None
    return None if header is None or header.pickled else header.dtype


def byte_layout(t: TensorInfo) -> tuple[str, bool]:
    """How a type carried as bytes lies: its stored type (byte order included; "" where it has no .npy header)
    and whether in Fortran order (where the shape makes the orders differ). Two such tensors of one type whose
    layouts agree hold the same values exactly when they hold the same bytes."""
    dtype = read_npy_header(io.BytesIO(t.prefix)).dtype if t.prefix else None
    descr = "" if dtype is None else repr(dtype.descr)  # fields' names, order and byte orders too
    return descr, t.fortran_order and sum(n > 1 for n in t.shape) > 1


def check_tensor(t: TensorInfo) -> None:
    """Refuses a tensor that a .npy cannot hold (a type carried as bytes keeps the .npy header it had)."""
    if not (t.array_dtype is None and t.prefix):
        check_portable(t.array_dtype, t.name)


def check_metadata(target: Path, metadata: dict[str, str]) -> None:
    """Refuses metadata, which an .npz or .npy has no place for."""
    if metadata:
        n = len(metadata)
        keys = ", ".join(list(metadata)[:5]) + (", ..." if n > 5 else "")
        raise UnsupportedError(
            f"the metadata ({n:,} {'entry' if n == 1 else 'entries'}: {keys}) has no place in an .npz or .npy; "
            "write .safetensors to keep it, or give --drop-metadata",
            target,
        )


def _check_file(
    target: Path, tensors: list[TensorInfo], source_format: str, metadata: dict[str, str], store: Store = LOCAL
) -> None:
    """One tensor, named as the file (unless it came from a .npy), and no metadata."""
    if len(tensors) != 1:
        raise UnsupportedError(f"a .npy file holds one tensor, the checkpoint has {len(tensors)}", target)
    if source_format != "npy" and tensors[0].name != target.stem:
        raise UnsupportedError(
            f"an .npy holds no name: tensor {tensors[0].name!r} would be read back as {target.stem!r}; "
            f"name the output {tensors[0].name}.npy, or write .npz",
            target,
        )
    check_metadata(target, metadata)


FORMAT = Format(
    "npy",
    (".npy",),
    sniff=lambda head, f=None: head.startswith(MAGIC),
    describe=lambda head: "a NumPy .npy file" if head.startswith(MAGIC) else None,
    open_file=open_file,
    open=open_audited,
    write=write,
    header=header,
    check_tensor=check_tensor,
    check_file=_check_file,
)
