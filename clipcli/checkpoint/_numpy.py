"""The .npy format (parsed without eval or pickle) and .npz archives of .npy members."""

from __future__ import annotations

import ast
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from clipcli.errors import MalformedError, UnsupportedError

MAGIC = b"\x93NUMPY"
MAX_HEADER = 65536
_PORTABLE_KINDS = "biufc"
_ALIGN = 64
_GROWTH_DIGITS = 21


@dataclass(frozen=True)
class NpyHeader:
    """A parsed .npy header: the data follows at `data_offset` bytes from the start of the member."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_npy_header(f: BinaryIO) -> NpyHeader:
    """Reads and validates a .npy header from the current position of `f`.

    Raises:
        MalformedError: for a bad magic, version, length or dictionary.
        UnsupportedError: for object, structured, string or other non-numeric dtypes.
    """
    prefix = f.read(8)
    if len(prefix) < 8 or not prefix.startswith(MAGIC):
        raise MalformedError("not a .npy member (bad magic string)")
    major, minor = prefix[6], prefix[7]
    if (major, minor) not in ((1, 0), (2, 0), (3, 0)):
        raise MalformedError(f"unknown .npy format version {major}.{minor}")
    size_bytes = f.read(2 if major == 1 else 4)
    if len(size_bytes) < (2 if major == 1 else 4):
        raise MalformedError("truncated .npy header")
    (n,) = struct.unpack("<H" if major == 1 else "<I", size_bytes)
    if n > MAX_HEADER:
        raise MalformedError(f".npy header length {n} exceeds {MAX_HEADER} bytes")
    raw = f.read(n)
    if len(raw) < n:
        raise MalformedError("truncated .npy header")
    try:
        text = raw.decode("latin1" if major < 3 else "utf-8")
        d = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError) as e:
        raise MalformedError(f"the .npy header is not a Python literal ({type(e).__name__})") from e
    if not isinstance(d, dict) or set(d) != {"descr", "fortran_order", "shape"}:
        raise MalformedError("the .npy header must be a dict with exactly 'descr', 'fortran_order' and 'shape'")
    shape, fortran, descr = d["shape"], d["fortran_order"], d["descr"]
    if not isinstance(shape, tuple) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape
    ):
        raise MalformedError(f"'shape' must be a tuple of non-negative integers, got {shape!r}")
    if not isinstance(fortran, bool):
        raise MalformedError(f"'fortran_order' must be True or False, got {fortran!r}")
    return NpyHeader(_descr_dtype(descr), shape, fortran, (8 + (2 if major == 1 else 4) + n))


def _descr_dtype(descr: Any) -> np.dtype:
    if not isinstance(descr, str):
        raise UnsupportedError(f"structured dtype {descr!r} is not a tensor")
    try:
        dtype = np.dtype(descr)
    except Exception as e:  # NumPy parses type strings with its own grammar: "," raises SyntaxError
        raise MalformedError(f"unknown dtype {descr!r}") from e
    if dtype.kind == "O" or dtype.hasobject:
        raise UnsupportedError("object arrays are not supported (they would need unpickling)")
    if dtype.kind not in _PORTABLE_KINDS or dtype.itemsize > 16 or dtype in (np.longdouble, np.clongdouble):
        if dtype.kind == "V" and dtype.itemsize in (1, 2):
            raise UnsupportedError(f"dtype {descr!r} is raw bytes (bfloat16 or float8 saved without its type?)")
        raise UnsupportedError(f"dtype {descr!r} ({dtype.name}) is not a numeric tensor type clipcli handles")
    return dtype


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
            "cannot write this dtype to .npy/.npz without losing it (NumPy has no portable type for it); "
            "write .safetensors instead",
            tensor=name,
        )


def member_name(tensor: str) -> str:
    return f"{tensor}.npy"


def tensor_name(member: str) -> str:
    """The key `np.load` gives a member: its name without a `.npy` suffix."""
    return member[:-4] if member.endswith(".npy") else member


def zip_member_info(name: str, size: int) -> zipfile.ZipInfo:
    """A stored member with a fixed timestamp, so the same input gives the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    info.external_attr = 0o644 << 16
    return info
