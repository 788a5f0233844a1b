"""NumPy arrays, dtypes and scalars pickled inside a torch.save file, decoded from their state without NumPy's
pickle code: arrays become tensors, scalars plain values; object and structured arrays stay placeholders."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from clipcli.checkpoint.formats._pickle import Constructor, Placeholder, Record, a_kind
from clipcli.errors import MalformedError

# the dtype strings decoded: booleans, integers, floats and complex numbers NumPy holds (no long double)
_PLAIN_DTYPE = re.compile(r"[biuf][1248]|c(8|16)|b1")
_BYTE_ORDERS = {"<": "<", ">": ">", "|": "|", "=": "<"}  # '=' is the writer's native order: NumPy writes '<'/'>'


class NumpyDtype(Record):
    """`numpy.dtype(code, align, copy)` and its BUILD state (byte order); `array` is None for a dtype clipcli
    does not decode (object, structured, strings, long double)."""

    def __init__(self, code: Any):
        self.code = code
        plain = type(code) is str and _PLAIN_DTYPE.fullmatch(code) is not None
        self.array: np.dtype | None = np.dtype(code) if plain else None

    def describe(self) -> str:
        return "numpy.dtype"

    def build(self, state: Any) -> None:
        # (version, byte order, subarray, names, fields, elsize, alignment, flags)
        if type(state) is not tuple or len(state) < 5 or state[1] not in _BYTE_ORDERS:
            raise MalformedError("the pickle sets a numpy.dtype's state to something NumPy never writes")
        if state[2] is not None or state[3] is not None or state[4] is not None:
            self.array = None  # a subarray or structured dtype
        elif self.array is not None and self.array.itemsize > 1:
            self.array = self.array.newbyteorder(_BYTE_ORDERS[state[1]])

    @property
    def text(self) -> str:
        """As NumPy names it (`float32`), or the code the pickle gave."""
        return self.array.name if self.array is not None else str(self.code)[:40]


class NumpyArray(Record):
    """An ndarray as `_reconstruct` and its BUILD state describe it: `data` holds its bytes in C order and
    native byte order once built; an array of another dtype keeps what the pickle gave as `placeholder`."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] = ()
        self.dtype: np.dtype | None = None
        self.data: bytes | None = None
        self.placeholder: Placeholder | None = None

    def describe(self) -> str:
        return "numpy.ndarray"

    def build(self, state: Any) -> None:
        # (version, shape, dtype, is_fortran, raw data): what ndarray.__reduce__ gives
        if type(state) is not tuple or len(state) != 5 or not isinstance(state[2], NumpyDtype):
            raise MalformedError("the pickle sets a numpy.ndarray's state to something NumPy never writes")
        _, shape, dtype, fortran, raw = state
        self.fill(shape, dtype, fortran is True, raw)

    def fill(self, shape: Any, dtype: NumpyDtype, fortran: bool, raw: Any) -> None:
        """The array's shape, dtype and values, checked (or, for a dtype not decoded, a placeholder)."""
        if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
            raise MalformedError("a pickled numpy.ndarray's shape is not a tuple of non-negative integers")
        if dtype.array is None or type(raw) is not bytes:
            self.placeholder = Placeholder("numpy.ndarray", (shape, dtype.text))
            if type(raw) is list:  # an object array: its items, as data
                self.placeholder.list_items = raw
            return
        if len(raw) != math.prod(shape) * dtype.array.itemsize:
            raise MalformedError(
                f"a pickled numpy.ndarray of shape {shape} and dtype {dtype.text} holds {len(raw)} bytes"
            )
        values = np.frombuffer(raw, dtype.array).reshape(shape, order="F" if fortran else "C")
        native = dtype.array.newbyteorder("=")
        self.shape, self.dtype = shape, native
        self.data = np.ascontiguousarray(values, native).tobytes()


class _Type(Record):
    def __init__(self, name: str):
        self.name = name

    def describe(self) -> str:
        return f"global {self.name}"


_NDARRAY = _Type("numpy.ndarray")


def _dtype(code: Any, align: Any = False, copy: Any = False) -> NumpyDtype:
    return NumpyDtype(code)


def _reconstruct(subtype: Any, shape: Any, dtype_code: Any) -> NumpyArray | Placeholder:
    if subtype is not _NDARRAY:  # a subclass (matrix, masked array): a placeholder, as any unknown class
        if not isinstance(subtype, Placeholder):
            raise MalformedError(f"numpy's _reconstruct is given {a_kind(subtype)} as the array type")
        return Placeholder(subtype.name, (shape, dtype_code))
    return NumpyArray()


def _scalar(dtype: Any, data: Any = None) -> Any:
    if not isinstance(dtype, NumpyDtype):
        raise MalformedError(f"numpy's scalar is given {a_kind(dtype)} as its dtype")
    if dtype.array is None or type(data) is not bytes or len(data) != dtype.array.itemsize:
        return Placeholder("numpy.generic", (dtype.text,))  # an object, string or structured scalar
    return np.frombuffer(data, dtype.array)[0].item()


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any) -> NumpyArray:
    # protocol 5, the buffer in band: what ndarray.__reduce_ex__(5) gives for a contiguous array
    if not isinstance(dtype, NumpyDtype) or order not in ("C", "F"):
        raise MalformedError("numpy's _frombuffer is given something other than a dtype and an order")
    array = NumpyArray()
    array.fill(shape, dtype, order == "F", buffer)
    return array


def numpy_globals() -> dict[str, Any]:
    """The NumPy globals a pickle of arrays, dtypes and scalars names (NumPy 1 and 2 spellings)."""
    found: dict[str, Any] = {"numpy.ndarray": _NDARRAY}
    for core in ("numpy.core", "numpy._core"):
        for name, func in (("_reconstruct", _reconstruct), ("scalar", _scalar)):
            found[f"{core}.multiarray.{name}"] = Constructor(f"{core}.multiarray.{name}", func)
        found[f"{core}.numeric._frombuffer"] = Constructor(f"{core}.numeric._frombuffer", _frombuffer)
    found["numpy.dtype"] = Constructor("numpy.dtype", _dtype)
    return found
