"""PyTorch `torch.save` files, zip and legacy, read without torch: tensors and where their bytes lie.

A `torch.save` file is a pickle whose tensors point at storages stored beside it: members
`<prefix>/data/<key>` of a zip archive (torch >= 1.6), or, in the legacy format, raw storages after the
pickle stream, each behind its element count. The pickle runs on clipcli's restricted machine
(`_pickle`) with an allowlist of the globals torch writes, each resolved to one of the constructors
below; they build descriptions of tensors, never tensors. Nothing here reads a tensor's data.

Names: nested dicts, lists and tuples flatten to dotted names (`state.0.exp_avg`); list and tuple items
are named by their index; a dict key that is not a string is written as its decimal (ints) or as a
Python literal (`None`, `1.5`, `(1, 'a')`). A tensor saved on its own (not in a container) is named
after the file's stem, as a .npy file is. Leaves that are not tensors become metadata: strings as they
are, other values as Python literals (`0.001`, `True`, `None`, `b'ab'`, `(1-2j)`, sets with their
members sorted, `{1, 2}`), dtypes and devices as torch prints them (`torch.float16`, `cuda:0`), empty
containers below the top as `{}`, `[]` and `()`. An OrderedDict's attributes (a state dict's
`_metadata` of module versions) are not metadata: torch.load does not show them as entries either.
"""

from __future__ import annotations

import copy
import lzma
import math
import os
import struct
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from clipcli.checkpoint.formats._common import first_zip_member
from clipcli.checkpoint.formats._pickle import (
    MAX_DEPTH,
    PLAIN_GLOBALS,
    Constructor,
    PickleTruncatedError,
    Record,
    kind,
    unpickle,
    unpickle_at,
)
from clipcli.checkpoint.plugin import Format
from clipcli.checkpoint.source import LOCAL, Store, size_of
from clipcli.checkpoint.tensor import Piece, Pieces, Span, TensorInfo, check_elements
from clipcli.checkpoint.zipmember import zip_data_start
from clipcli.errors import (
    ClipcliError,
    FileTypeError,
    InputError,
    MalformedError,
    MissingFileError,
    UnsupportedError,
    printable,
)

__all__ = [
    "TorchTensor",
    "dtype_of",
    "is_contiguous",
    "open_file",
    "read_torch",
    "resolve_global",
    "shared_storages",
    "view_byte_range",
]


# Bytes of pickle clipcli reads: a state dict of 10^5 tensors takes ~10 MB; unpickled, a pickle can take
# up to ~100 times its size (an EMPTY_DICT opcode is 1 byte, a dict 64).
MAX_PICKLE = 256 << 20
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # the first pickle of a legacy torch.save file
PROTOCOL_VERSION = 1001  # its second
_MAX_INDEX = 1 << 63  # shapes, strides and offsets are int64 in torch
_MAX_KEY_DEPTH = 100  # nesting of a tuple used as a dict key, as rendered in a name
# The budget of names a pickle may flatten to (see _flatten): a tensor torch writes takes 60 bytes of pickle
# or more (rebuild call, persistent id, size, stride), a metadata leaf 2 or more, and a memo GET names a
# shared container or tensor again for 2 bytes. A tensor's name costs far more than a leaf's afterwards (its
# records, ~1.5 KB, and a read of its storage by every command that reads values).
_NAME_UNITS = 65536
_NAME_UNITS_PER_BYTE = 16
_TENSOR_UNITS = 32
_FIRST_WINDOW = 1 << 20  # bytes of a legacy file read first to find its pickles (grown 8-fold as needed)


@dataclass(frozen=True)
class TorchTensor:
    """One tensor of a torch.save file: its name, type, view and where its storage's bytes lie.

    Tensors with the same `storage_key` share one storage (tied weights, views). A tensor with a
    `skip_reason` is listed but must not be read; its `dtype` is None unless its type has one, and its
    storage fields are empty (`storage_key` "", offsets and sizes 0) when it has no storage in the file
    (sparse, meta and nested tensors).
    """

    name: str  # dotted name
    dtype: np.dtype | None  # native-order NumPy / ml_dtypes dtype; None when skipped
    dtype_name: str  # NumPy / ml_dtypes name ('float32', 'bfloat16'), or torch's for types without one
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    storage_offset: int  # in elements
    storage_key: str  # tensors with the same key share storage (tied weights)
    file_offset: int  # absolute byte offset of the storage's first byte in the file
    storage_nbytes: int  # bytes the storage holds
    big_endian: bool  # storage bytes are big-endian
    skip_reason: str | None  # why it is listed but not read (sparse, quantized, meta), else None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def is_contiguous(t: TorchTensor) -> bool:
    """Whether the view is C-contiguous: its elements lie in row-major order with no gaps."""
    if t.numel == 0:
        return True
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def view_byte_range(t: TorchTensor) -> tuple[int, int]:
    """The absolute [start, end) bytes of the file that hold the tensor's elements (start == end if empty).

    For a non-contiguous view the range includes the gaps between elements.

    Raises:
        ValueError: for a tensor without a dtype or without storage (skipped).
    """
    if t.dtype is None or not t.storage_key:
        raise ValueError(f"tensor {t.name} has no readable storage")
    start = t.file_offset + t.storage_offset * t.dtype.itemsize
    if t.numel == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.strides, strict=True))
    return start, start + (last + 1) * t.dtype.itemsize


def shared_storages(tensors: Iterable[TorchTensor]) -> dict[str, list[str]]:
    """The names of the tensors on each storage that more than one tensor uses, by storage key."""
    by_key: dict[str, list[str]] = {}
    for t in tensors:
        if t.storage_key:
            by_key.setdefault(t.storage_key, []).append(t.name)
    return {key: names for key, names in by_key.items() if len(names) > 1}


# -- dtypes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Dtype:
    """A torch dtype: its name in torch, its NumPy / ml_dtypes type if any, and its element size."""

    torch_name: str
    itemsize: int
    array: np.dtype | None

    @property
    def name(self) -> str:
        return self.torch_name if self.array is None else self.array.name


def _dtype_table() -> dict[str, _Dtype]:
    arrays = {
        "bool": np.bool_,
        "uint8": np.uint8,
        "int8": np.int8,
        "uint16": np.uint16,
        "int16": np.int16,
        "uint32": np.uint32,
        "int32": np.int32,
        "uint64": np.uint64,
        "int64": np.int64,
        "float16": np.float16,
        "bfloat16": ml_dtypes.bfloat16,
        "float32": np.float32,
        "float64": np.float64,
        "complex64": np.complex64,
        "complex128": np.complex128,
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
        "float8_e5m2": ml_dtypes.float8_e5m2,
        "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
        "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
        "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    }
    table = {name: _Dtype(name, np.dtype(t).itemsize, np.dtype(t)) for name, t in arrays.items()}
    # Listed and skipped: types that neither NumPy nor ml_dtypes holds (complex32, a pair of float16s;
    # float4_e2m1fn_x2, two 4-bit floats a byte, where ml_dtypes' float4_e2m1fn takes a byte each), quantized
    # integers, and the bits types (bytes without a meaning).
    others = {"complex32": 4, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1}
    others.update({"float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2})
    others.update({"bits1x8": 1, "bits2x4": 1, "bits4x2": 1})
    others.update({f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)})
    table.update({name: _Dtype(name, size, None) for name, size in others.items()})
    return table


_DTYPES = _dtype_table()
_UINT8 = _DTYPES["uint8"]

# The legacy typed storage classes torch still writes in persistent ids, by the dtype they hold.
_STORAGE_CLASSES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QUInt8Storage": "quint8",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
_QUANTIZED_STORAGE = {"QUInt8Storage", "QInt8Storage", "QInt32Storage", "QUInt4x2Storage", "QUInt2x4Storage"}

# -- what the pickle builds ----------------------------------------------------------------------


class _Named(Record):
    """A torch object a pickle passes by name: a dtype, a layout, a quantization scheme, a tensor type."""

    def __init__(self, name: str, dtype: _Dtype | None = None):
        self.name = name  # "torch.float32"
        self.dtype = dtype

    def describe(self) -> str:
        return f"global {self.name}"


class _StorageType(Record):
    """A storage class named in a persistent id; `dtype` is None for UntypedStorage (bytes)."""

    def __init__(self, name: str, dtype: _Dtype | None):
        self.name = name
        self.dtype = dtype

    def describe(self) -> str:
        return f"global {self.name}"


class _Device(Record):
    def __init__(self, text: str):
        self.text = text

    def describe(self) -> str:
        return "torch.device"


class _Storage(Record):
    """A storage named by a persistent id: `numel` elements of `dtype` (bytes for UntypedStorage).

    A legacy storage view covers `nbytes` bytes from `base` bytes into the storage `root`.
    """

    def __init__(self, key: str, dtype: _Dtype, numel: int):
        self.key = key
        self.dtype = dtype
        self.numel = numel
        self.root = self
        self.base = 0
        self.nbytes = numel * dtype.itemsize
        self.file_offset = -1  # set once the storage is found in the file

    def describe(self) -> str:
        return "storage"


class _Tensor(Record):
    """A tensor as a rebuild function describes it; checked, with its name, by `_describe`."""

    def __init__(
        self,
        storage: Any,
        offset: Any,
        shape: Any,
        strides: Any,
        dtype: _Dtype | None = None,
        skip: str | None = None,
    ):
        self.storage = storage
        self.offset = offset
        self.shape = shape
        self.strides = strides
        self.dtype = dtype  # None: the storage's
        self.skip = skip

    def describe(self) -> str:
        return "tensor"


def _storage_arg(storage: Any, func: str) -> _Storage:
    if not isinstance(storage, _Storage):
        raise MalformedError(f"{func} is given a {kind(storage)} where a storage belongs")
    return storage


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> _Tensor:
    _storage_arg(storage, "torch._utils._rebuild_tensor")
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> _Tensor:
    _storage_arg(storage, "torch._utils._rebuild_tensor_v2")
    return _Tensor(storage, storage_offset, size, stride, skip=_metadata_skip(metadata))


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> _Tensor:
    _storage_arg(storage, "torch._utils._rebuild_tensor_v3")
    return _Tensor(storage, storage_offset, size, stride, _dtype_arg(dtype), _metadata_skip(metadata))


def _metadata_skip(metadata: Any) -> str | None:
    """Why a tensor with these flags cannot be read as stored, if it cannot.

    torch writes only its conj and neg bits here (torch._utils.get_tensor_metadata); a flag it never writes
    is a file clipcli does not understand, named in the reason only in part and escaped (it is the file's).
    """
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise MalformedError(f"tensor metadata is a {kind(metadata)}, not a dict")
    flags = [k for k, v in metadata.items() if v]
    unknown = [k for k in flags if k not in _TENSOR_FLAGS]
    if unknown:
        return f"tensor flags that torch never writes ({_flag_names(unknown)})"
    if not flags:
        return None
    flags.sort()
    views, actions = " and ".join(_TENSOR_FLAGS[k] for k in flags), " and ".join(_FLAG_ACTIONS[k] for k in flags)
    return f"{views} view: torch {actions} the stored values on load"


_TENSOR_FLAGS = {"conj": "conjugate", "neg": "negative"}
_FLAG_ACTIONS = {"conj": "conjugates", "neg": "negates"}
_SHOWN_FLAGS = 3
_FLAG_CHARS = 40


def _flag_names(keys: list[Any]) -> str:
    shown = [printable(k[:_FLAG_CHARS]) if type(k) is str else f"a {kind(k)}" for k in keys[:_SHOWN_FLAGS]]
    more = len(keys) - _SHOWN_FLAGS
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _dtype_arg(dtype: Any) -> _Dtype:
    if not isinstance(dtype, _Named) or dtype.dtype is None:
        raise MalformedError(f"a {kind(dtype)} where a torch dtype belongs")
    return dtype.dtype


def _tensor_arg(data: Any, func: str) -> _Tensor:
    if not isinstance(data, _Tensor):
        raise MalformedError(f"{func} is given a {kind(data)} where a tensor belongs")
    return data


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> _Tensor:
    return _tensor_arg(data, "torch._utils._rebuild_parameter")


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> _Tensor:
    return _tensor_arg(data, "torch._utils._rebuild_parameter_with_state")


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> _Tensor:
    # A tensor with Python attributes (or a Parameter subclass): rebuilt by one of the functions above.
    if not (isinstance(func, Constructor) and func.name in _TENSOR_REBUILDERS):
        raise MalformedError(f"torch._tensor._rebuild_from_type_v2 is given a {kind(func)} to call")
    if not (isinstance(new_type, _Named) and new_type.name in _TENSOR_TYPES):
        raise MalformedError(f"torch._tensor._rebuild_from_type_v2 is given a {kind(new_type)} as the tensor type")
    if type(args) is not tuple:
        raise MalformedError(f"torch._tensor._rebuild_from_type_v2 is given a {kind(args)} of arguments")
    return _tensor_arg(func.func(*args), "torch._tensor._rebuild_from_type_v2")


def _rebuild_qtensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    quantizer_params: Any,
    requires_grad: Any,
    backward_hooks: Any,
) -> _Tensor:
    _storage_arg(storage, "torch._utils._rebuild_qtensor")
    scheme = quantizer_params[0] if type(quantizer_params) is tuple and quantizer_params else None
    if not (isinstance(scheme, _Named) and scheme.name in _QSCHEMES):
        raise MalformedError(f"torch._utils._rebuild_qtensor is given a {kind(scheme)} as quantization scheme")
    return _Tensor(storage, storage_offset, size, stride, skip=f"quantized tensor ({scheme.name})")


def _rebuild_sparse_tensor(layout: Any, data: Any) -> _Tensor:
    if not (isinstance(layout, _Named) and layout.name in _SPARSE_LAYOUTS):
        raise MalformedError(f"torch._utils._rebuild_sparse_tensor is given a {kind(layout)} as layout")
    coo = layout.name == "torch.sparse_coo"  # (indices, values, size[, coalesced]); else 2 index tensors first
    if type(data) is not tuple or len(data) not in ((3, 4) if coo else (4,)):
        raise MalformedError("torch._utils._rebuild_sparse_tensor is given malformed data")
    values, size = (data[1], data[2]) if coo else (data[2], data[3])
    dtype = _tensor_arg(values, "torch._utils._rebuild_sparse_tensor").dtype
    if dtype is None and isinstance(values.storage, _Storage):
        dtype = values.storage.dtype
    return _Tensor(None, 0, size, (), dtype, f"sparse tensor ({layout.name})")


def _rebuild_meta_tensor_no_storage(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> _Tensor:
    return _Tensor(None, 0, size, stride, _dtype_arg(dtype), "meta tensor: no data")


def _rebuild_nested_tensor(buffer: Any, sizes: Any, strides: Any, storage_offsets: Any) -> _Tensor:
    values = _tensor_arg(buffer, "torch._utils._rebuild_nested_tensor")
    dtype = values.dtype or (values.storage.dtype if isinstance(values.storage, _Storage) else None)
    return _Tensor(None, 0, (), (), dtype, "nested tensor (ragged, no single shape)")


def _size(dims: Any = ()) -> tuple[int, ...]:
    if type(dims) not in (tuple, list) or not all(type(d) is int for d in dims):
        raise MalformedError("torch.Size is given something other than integers")
    return tuple(dims)


def _device(kind_: Any, index: Any = None) -> _Device:
    if type(kind_) is not str or not (index is None or type(index) is int):
        raise MalformedError("torch.device is given something other than a name and an index")
    return _Device(kind_ if index is None else f"{kind_}:{index}")


def _get_layout(name: Any) -> _Named:
    if name not in _LAYOUTS:
        raise MalformedError("torch.serialization._get_layout is given an unknown layout")
    return _Named(name)


# the types _rebuild_from_type_v2 may give: a plain tensor with Python attributes (a Parameter pickles
# through _rebuild_parameter*, and any other subclass names its own class, which is refused)
_TENSOR_TYPES = {"torch.Tensor"}
_SPARSE_LAYOUTS = {"torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr", "torch.sparse_bsc"}
# every layout torch.serialization._get_layout names (distributed checkpoints' metadata name torch.strided)
_LAYOUTS = _SPARSE_LAYOUTS | {"torch.strided", "torch._mkldnn", "torch.jagged"}
_QSCHEMES = {
    "torch.per_tensor_affine",
    "torch.per_tensor_symmetric",
    "torch.per_channel_affine",
    "torch.per_channel_symmetric",
    "torch.per_channel_affine_float_qparams",
}
_TENSOR_REBUILDERS = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_meta_tensor_no_storage",
    "torch._utils._rebuild_nested_tensor",
}


def _allowlist() -> dict[str, Any]:
    """Every global a torch.save file may name, resolved to clipcli's own objects."""
    # plain data that protocol 2 writes through globals, as far as torch.load(weights_only=True) reads it
    # (it refuses builtins.bytes and builtins.frozenset: empty bytes and frozensets)
    plain = {"collections.OrderedDict", "builtins.set", "builtins.complex", "builtins.bytearray", "_codecs.encode"}
    allowed: dict[str, Any] = {c.name: c for c in PLAIN_GLOBALS.values() if c.name in plain}
    functions = {
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter_with_state,
        "torch._utils._rebuild_qtensor": _rebuild_qtensor,
        "torch._utils._rebuild_sparse_tensor": _rebuild_sparse_tensor,
        "torch._utils._rebuild_meta_tensor_no_storage": _rebuild_meta_tensor_no_storage,
        "torch._utils._rebuild_nested_tensor": _rebuild_nested_tensor,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch.Size": _size,
        "torch.device": _device,
        "torch.serialization._get_layout": _get_layout,
    }
    allowed.update({name: Constructor(name, func) for name, func in functions.items()})
    for name, dtype in _DTYPES.items():
        allowed[f"torch.{name}"] = _Named(f"torch.{name}", dtype)
    for name in _TENSOR_TYPES | _QSCHEMES:  # layouts come through _get_layout
        allowed[name] = _Named(name)
    for cls, dtype_name in _STORAGE_CLASSES.items():
        for module in ("torch", "torch.cuda"):  # torch < 1.10 named storages of CUDA tensors torch.cuda.*
            allowed[f"{module}.{cls}"] = _StorageType(f"torch.{cls}", _DTYPES[dtype_name])
    allowed["torch.storage.UntypedStorage"] = _StorageType("torch.storage.UntypedStorage", None)
    return allowed


_ALLOWED = _allowlist()


def _resolve(module: str, name: str) -> Any:
    return _ALLOWED.get(f"{module}.{name}")


def resolve_global(module: str, name: str) -> Any:
    """What a global of a torch.save file's allowlist resolves to (dtypes, torch.Size, ...), or None."""
    return _resolve(module, name)


def dtype_of(obj: Any) -> tuple[np.dtype | None, str] | None:
    """The NumPy / ml_dtypes dtype (None for types without one) and name of a torch dtype that a pickle
    named through `resolve_global` ('float32', 'bfloat16', 'complex32'); None if `obj` is not a dtype."""
    if isinstance(obj, _Named) and obj.dtype is not None:
        return obj.dtype.array, obj.dtype.name
    return None


def _resolve_nothing(module: str, name: str) -> Any:
    return None


class _Storages:
    """The storages a pickle's persistent ids name, one object per key."""

    def __init__(self, legacy: bool):
        self.legacy = legacy
        self.by_key: dict[str, _Storage] = {}

    def persistent_load(self, pid: Any) -> _Storage:
        n = 6 if self.legacy else 5
        if type(pid) is not tuple or len(pid) != n or pid[0] not in ("storage", b"storage"):
            raise MalformedError(
                f"a persistent id that is not ('storage', type, key, location, numel{', view' * self.legacy})"
            )
        storage_type, key, _location, numel = pid[1:5]
        if not isinstance(storage_type, _StorageType):
            raise MalformedError(f"a persistent id names a {kind(storage_type)} as its storage type")
        if type(key) is not str or not key:
            raise MalformedError(f"a persistent id's storage key is a {kind(key)}")
        if type(numel) is not int or not 0 <= numel < _MAX_INDEX:
            raise MalformedError(f"storage {key} has a bad size")
        dtype = storage_type.dtype or _UINT8
        storage = self._storage(key, dtype, numel)
        if n == 6 and pid[5] is not None:
            return self._view(storage, pid[5])
        return storage

    def _storage(self, key: str, dtype: _Dtype, numel: int) -> _Storage:
        storage = self.by_key.get(key)
        if storage is None:
            storage = self.by_key[key] = _Storage(key, dtype, numel)
        elif storage.dtype != dtype or storage.numel != numel:
            raise MalformedError(f"storage {key} is declared twice with different types or sizes")
        return storage

    @staticmethod
    def _view(root: _Storage, view: Any) -> _Storage:
        # legacy (torch < 0.4) storage views: (view key, offset, size) in elements of the root's dtype
        if type(view) is not tuple or len(view) != 3:
            raise MalformedError(f"storage {root.key} has malformed view metadata")
        key, offset, size = view
        if type(key) is not str or type(offset) is not int or type(size) is not int or offset < 0 or size < 0:
            raise MalformedError(f"storage {root.key} has malformed view metadata")
        if offset + size > root.numel:
            raise MalformedError(f"storage view {key} runs past the end of storage {root.key}")
        storage = _Storage(key, root.dtype, size)
        storage.root = root
        storage.base = offset * root.dtype.itemsize
        return storage


# -- the file --------------------------------------------------------------------------------------


class _Region:
    """The bytes [start, end) of an open file, as a file object of their own (for zipfile)."""

    def __init__(self, f: BinaryIO, start: int, end: int):
        self._f = f
        self.start = start
        self.size = end - start
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self.size - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        self._f.seek(self.start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def pread(self, offset: int, n: int) -> bytes:
        self.seek(offset)
        return self.read(n)

    def close(self) -> None:
        pass  # the file belongs to read_torch


def open_file(
    path: Path, store: Store = LOCAL, start: int = 0, end: int | None = None
) -> tuple[dict[str, str], list[TensorInfo]]:
    """The metadata and tensors of a torch.save file (or one at bytes [start, end) of a larger file).

    A view that is contiguous reads like any tensor (in chunks, by any worker); one with gaps, in another
    order or with values repeated (a slice with a step, a transpose, an expand) is read in order, in chunks,
    from its storage's bytes (`Pieces` of one strided piece). Names on one storage (tied weights) are
    separate tensors that know whom they share it with.
    """
    if Path(path).suffix == ".distcp":  # torch.save archives one after another: only the whole directory reads
        raise FileTypeError(
            f"one file of a distributed checkpoint, which reads only as a whole: name its directory "
            f"({Path(path).parent}) instead",
            path,
        )
    metadata, tensors = read_torch(path, start, end, store=store)
    # a storage is known by its file and key: shards of one checkpoint each have their own keys
    shared = {name: f"{path}:{key}" for key, names in shared_storages(tensors).items() for name in names}
    out = []
    for t in tensors:
        dtype = t.dtype if t.skip_reason is None else None
        nbytes = t.numel * t.dtype.itemsize if t.dtype is not None else 0
        location: Any = None
        if dtype is not None:
            start_byte, end_byte = view_byte_range(t)
            location = Span(start_byte) if is_contiguous(t) else _strided(t, str(path), start_byte, end_byte)
        stored = dtype.newbyteorder(">") if dtype is not None and t.big_endian and dtype.itemsize > 1 else None
        out.append(
            TensorInfo(
                t.name,
                t.dtype_name,
                t.shape,
                nbytes,
                str(path),
                dtype,
                location=location,
                stored_dtype=stored,
                skip=t.skip_reason,
                storage=shared.get(t.name),
            )
        )
    return metadata, out


def _strided(t: TorchTensor, path: str, start: int, end: int) -> Pieces:
    """A view with gaps, in another order or with values repeated: one strided piece of its storage's bytes."""
    view = Piece((0,) * len(t.shape), t.shape, path, start, (t.strides, end - start))
    return Pieces(t.shape, t.dtype.itemsize, (view,))


def read_torch(
    path: Path, start: int = 0, end: int | None = None, name: str | None = None, store: Store = LOCAL
) -> tuple[dict[str, str], list[TorchTensor]]:
    """The metadata and tensors of a torch.save file, or of one at bytes [start, end) of a larger file.

    Reads the zip directory (or the legacy file's pickles and storage headers) and the pickle, never
    the tensors' data; every tensor is checked to lie inside its storage, and every storage inside
    the file.

    Args:
        path: the file.
        start: where the torch.save file begins in it.
        end: where it ends (None: at the end of the file).
        name: the name of the saved object, as one item of a larger whole (a distributed checkpoint's
            `optim.param_groups.0.betas`): a container's items are named `name.key`, and an empty
            container is the metadata `{}`, `[]` or `()`. None: the object is the file's, its items
            are named by their keys alone, and a tensor or value saved on its own takes the file's stem.

    Raises:
        MissingFileError: when the file cannot be opened.
        FileTypeError: when it is not a torch.save file.
        MalformedError: when it breaks the format (UnsafePickleError when its pickle asks for code).
        UnsupportedError: for the tar format of torch 0.1.x, TorchScript archives and compressed storages.
    """
    path = Path(path)
    try:
        f = store.open(path)
    except OSError as e:
        raise MissingFileError(e.strerror or str(e), path) from e
    with f:
        try:
            return _read(f, path, start, end, name)
        except ClipcliError as e:
            if e.path is None:
                e.path = str(path)
            raise
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror or e}", path) from e


def _read(
    f: BinaryIO, path: Path, start: int, end: int | None, name: str | None
) -> tuple[dict[str, str], list[TorchTensor]]:
    size = size_of(f)
    stop = size if end is None else end
    if not 0 <= start <= stop <= size:
        raise MalformedError(f"bytes {start}..{stop} are not inside the file ({size} bytes)")
    region = _Region(f, start, stop)
    head = region.pread(0, 512)
    big_endian = False
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        root, storages, big_endian, pickle_size = _read_zip(region)
    elif len(head) >= 262 and head[257:262] == b"ustar":
        raise UnsupportedError(
            "a torch.save file in the tar format that torch wrote until early 2017 (torch 0.1.x); load it with "
            "torch and save it again"
        )
    else:
        root, storages, pickle_size = _read_legacy(region, head)
    return _flatten(root, path.stem if name is None else name, storages, big_endian, pickle_size, name is not None)


# what zipfile raises for a damaged archive (see checkpoint/__init__.py, which reads .npz the same way)
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    zlib.error,
    lzma.LZMAError,
    IndexError,
    NotImplementedError,
    ValueError,
    RuntimeError,
    struct.error,
    OverflowError,
)


def _read_zip(region: _Region) -> tuple[Any, _Storages, bool, int]:
    try:
        with zipfile.ZipFile(region) as z:  # type: ignore[arg-type]
            infos = z.infolist()
            members: dict[str, zipfile.ZipInfo] = {}
            for info in infos:
                if info.filename in members:
                    raise MalformedError(f"the zip holds two members named {info.filename!r}")
                members[info.filename] = info
            prefix = _archive_prefix(infos)
            _check_starts_at_zero(infos)
            data_pkl = members.get(prefix + "data.pkl")
            if prefix + "constants.pkl" in members or any(n.startswith(prefix + "code/") for n in members):
                # TorchScript's data.pkl names its module classes (__torch__.*): code, not tensors
                raise UnsupportedError(
                    "a TorchScript archive written by torch.jit.save (a program and its weights), not a torch.save "
                    "file; clipcli does not read TorchScript: torch.save the module's state_dict() instead"
                )
            if data_pkl is None:
                raise FileTypeError("a zip archive without data.pkl, not a torch.save file")
            order = members.get(prefix + "byteorder")
            big_endian = False
            if order is not None:
                text = _read_member(z, order, region, 16)
                if text not in (b"little", b"big"):
                    raise MalformedError("the byteorder record is neither 'little' nor 'big'")
                big_endian = text == b"big"
            data = _read_member(z, data_pkl, region, MAX_PICKLE)
            storages = _Storages(legacy=False)
            root = unpickle(data, _resolve, storages.persistent_load)
            for storage in storages.by_key.values():
                info = members.get(f"{prefix}data/{storage.key}")
                if info is None:
                    raise MalformedError(f"storage {storage.key} is not in the archive (no {prefix}data/{storage.key})")
                storage.file_offset = region.start + _stored_data_offset(region, info, storage)
            return root, storages, big_endian, len(data)
    except ClipcliError:
        raise
    except _ZIP_ERRORS as e:
        raise MalformedError(f"not a valid zip archive: truncated or damaged ({_one_line(e)})") from e


def _archive_prefix(infos: list[zipfile.ZipInfo]) -> str:
    """The folder all records are in: torch names it after the file (`archive/` when saved to a buffer)."""
    if not infos:
        raise FileTypeError("an empty zip archive, not a torch.save file")
    first = infos[0].filename
    if "/" not in first:
        what = "an .npz (a zip of .npy files)" if first.endswith(".npy") else "a zip archive"
        raise FileTypeError(f"not a PyTorch file: {what}, not a torch.save file")
    return first[: first.index("/") + 1]


def _check_starts_at_zero(infos: list[zipfile.ZipInfo]) -> None:
    """Refuses a zip whose first record is not at its first byte: torch reads only such a zip, and
    zipfile would read the last of two archives in one file (a .distcp file holds one per item)."""
    first = min(info.header_offset for info in infos)
    if first:
        raise MalformedError(
            f"the zip archive's first record is at byte {first}, not 0 (another archive or other bytes come "
            "before it); torch reads only a zip that starts the file"
        )


def _read_member(z: zipfile.ZipFile, info: zipfile.ZipInfo, region: _Region, limit: int) -> bytes:
    # torch stores every record; a compressed pickle would build objects far beyond the bytes in the file
    if info.compress_type != zipfile.ZIP_STORED:
        raise UnsupportedError(
            f"record {info.filename} is compressed (method {info.compress_type}); torch never compresses it, "
            "and clipcli reads it only stored"
        )
    if info.file_size > limit or info.compress_size > region.size:
        raise MalformedError(f"record {info.filename} claims {info.file_size} bytes")
    if info.CRC == 0 and info.file_size:
        # torch.save with `torch.utils.serialization.config.save.compute_crc32 = False` records every CRC-32
        # as 0, and torch reads such files: no checksum to check, rather than a wrong one
        info = copy.copy(info)
        del info.CRC
    data = z.read(info)
    if len(data) != info.file_size:
        raise MalformedError(f"record {info.filename} holds {len(data)} bytes, not {info.file_size}")
    return data


def _stored_data_offset(region: _Region, info: zipfile.ZipInfo, storage: _Storage) -> int:
    """Where a storage member's bytes begin in the region, from its local header; checks its size."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
        raise UnsupportedError(
            f"storage {storage.key} is compressed or encrypted (torch never does either); clipcli reads it only stored"
        )
    start = zip_data_start(region.pread, info)
    if start is None:
        raise MalformedError(f"storage {storage.key}: bad local zip header (the zip directory points elsewhere)")
    if info.file_size != info.compress_size or info.file_size != storage.nbytes:
        raise MalformedError(
            f"storage {storage.key} holds {info.file_size} bytes but the pickle declares {storage.numel} "
            f"{storage.dtype.name} elements ({storage.nbytes} bytes)"
        )
    if start + storage.nbytes > region.size:
        raise MalformedError(f"storage {storage.key} runs past the end of the file")
    return start


def _read_legacy(region: _Region, head: bytes) -> tuple[Any, _Storages, int]:
    """The object and storages of a legacy file: five pickles, then each storage behind its count."""
    window = min(region.size, _FIRST_WINDOW)
    while True:
        data = region.pread(0, window)
        try:
            root, storages, keys, end = _legacy_pickles(data, head)
            break
        except PickleTruncatedError:
            if window >= region.size or window >= MAX_PICKLE:
                raise
            window = min(region.size, window * 8, MAX_PICKLE)
    pos = end
    for key in keys:
        storage = storages.by_key.get(key)
        if storage is None:
            raise MalformedError(f"storage {key} follows the pickle but the pickle never uses it")
        count_bytes = region.pread(pos, 8)
        if len(count_bytes) < 8:
            raise MalformedError(f"the file ends before storage {key}")
        (count,) = struct.unpack("<q", count_bytes)
        if count != storage.numel:
            raise MalformedError(f"storage {key} holds {count} elements but the pickle declares {storage.numel}")
        storage.file_offset = region.start + pos + 8
        pos += 8 + storage.nbytes
        if pos > region.size:
            raise MalformedError(f"storage {key} runs past the end of the file")
    missing = [key for key in storages.by_key if storages.by_key[key].file_offset < 0]
    if missing:
        raise MalformedError(f"storage {missing[0]} has no data in the file")
    return root, storages, end


def _legacy_pickles(data: bytes, head: bytes) -> tuple[Any, _Storages, list[str], int]:
    try:  # ~15 bytes, well inside the first window: any failure means another kind of file
        magic, pos = unpickle_at(data, 0, _resolve_nothing)
    except MalformedError:
        magic, pos = None, 0
    if type(magic) is not int or magic != MAGIC_NUMBER:
        from clipcli.checkpoint.registry import describe  # here: only a file that is no torch.save needs it

        what = describe(head)
        if what.startswith("a Python pickle"):
            what = "a Python pickle, not a torch.save file"
        raise FileTypeError(f"not a PyTorch file: {what}")
    version, pos = unpickle_at(data, pos, _resolve_nothing)
    if version != PROTOCOL_VERSION:
        raise UnsupportedError(f"legacy torch.save protocol version {version!r} (clipcli reads {PROTOCOL_VERSION})")
    sys_info, pos = unpickle_at(data, pos, _resolve_nothing)
    if not isinstance(sys_info, dict):
        raise MalformedError("the legacy file's system information is not a dict")
    storages = _Storages(legacy=True)
    root, pos = unpickle_at(data, pos, _resolve, storages.persistent_load)
    keys, pos = unpickle_at(data, pos, _resolve_nothing)
    if type(keys) is not list or not all(type(k) is str for k in keys) or len(set(keys)) != len(keys):
        raise MalformedError("the legacy file's storage keys are not a list of distinct strings")
    return root, storages, keys, pos


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


# -- names ----------------------------------------------------------------------------------------


def _flatten(
    root: Any, root_name: str, storages: _Storages, big_endian: bool, pickle_size: int, item: bool = False
) -> tuple[dict[str, str], list[TorchTensor]]:
    """Walks the unpickled object depth first: tensors and metadata under dotted names, in order.

    With `item`, the object is named `root_name` as an item of a container would be (its own items
    `root_name.key`, an empty container a metadata entry).

    The walk is charged one unit per container or leaf and one per 16 characters of its name, and for every
    entry it keeps one per 4 characters of its name and value and _TENSOR_UNITS per tensor, against a budget
    proportional to the pickle's size: containers that share one another (one list held twice by a list
    held twice by ...) would otherwise give names without end, and a file may not cost more than its bytes
    justify.
    """
    budget = _NAME_UNITS + _NAME_UNITS_PER_BYTE * pickle_size
    tensors: list[TorchTensor] = []
    metadata: dict[str, str] = {}
    seen: set[str] = set()
    # parent's name, key, object, depth
    pending: list[tuple[str | None, Any, Any, int]] = [(None, root_name, root, 1) if item else (None, None, root, 0)]
    while pending:
        parent, key, obj, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise MalformedError(f"the pickle nests containers deeper than {MAX_DEPTH} levels (or holds itself)")
        if depth == 0:
            name = root_name
        else:
            part = key if type(key) is str else _key_text(key)
            name = part if parent is None else f"{parent}.{part}"
        budget -= 1 + len(name) // 16  # building the name; a leaf's is kept, and charged again below
        if budget < 0:
            raise MalformedError(
                "the pickle's containers share one another (or hold themselves) so often that their names would "
                f"not end: more tensors and values than its {pickle_size} bytes justify"
            )
        children = _children(obj)
        if children is not None and (children or depth == 0):
            prefix = None if depth == 0 else name
            pending.extend((prefix, k, v, depth + 1) for k, v in reversed(children))
            continue
        if name in seen:
            raise MalformedError("two entries of the pickle flatten to this name", tensor=name)
        seen.add(name)
        budget -= len(name) // 4
        if isinstance(obj, (_Tensor, _Storage)):
            budget -= _TENSOR_UNITS
            if isinstance(obj, _Storage):  # a storage saved as such: all of it, as a 1-d tensor
                obj = _Tensor(obj, 0, (obj.numel,), (1,))
            tensors.append(_describe(name, obj, big_endian))
        else:
            text = metadata[name] = _render(obj, name)
            budget -= len(text) // 4
    return metadata, tensors


def _children(obj: Any) -> list[tuple[Any, Any]] | None:
    """A container's (key, item) pairs, or None for a leaf; keys are rendered only once named."""
    if isinstance(obj, dict):
        return list(obj.items())
    if type(obj) in (list, tuple):
        return list(enumerate(obj))
    return None


def _key_text(key: Any) -> str:
    return key if type(key) is str else _literal(key, 0)


def _literal(value: Any, depth: int) -> str:
    """A dict key, set member or leaf written as a Python literal would be (never an object's address)."""
    if depth > _MAX_KEY_DEPTH:
        raise MalformedError(f"a dict key or set nested deeper than {_MAX_KEY_DEPTH} levels")
    if type(value) is str:
        return repr(value) if depth else value
    if type(value) is int:
        return str(value) if value.bit_length() < 10_000 else hex(value)  # str() refuses > 4300 digits
    if value is None or type(value) in (bool, float, complex, bytes):
        return repr(value)
    if type(value) is tuple:
        items = [_literal(v, depth + 1) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if type(value) in (set, frozenset):
        items = sorted(_literal(v, depth + 1) for v in value)
        if not items:
            return "set()" if type(value) is set else "frozenset()"
        text = "{" + ", ".join(items) + "}"
        return text if type(value) is set else f"frozenset({text})"
    if isinstance(value, (_Named, _StorageType)):
        return value.name
    if isinstance(value, _Device):
        return value.text
    if isinstance(value, Constructor):
        return value.name
    if isinstance(value, (_Tensor, _Storage)):
        raise UnsupportedError("a tensor used as a dict key or set member has no name")
    raise MalformedError(f"a {kind(value)} where a key or value belongs")


def _render(value: Any, name: str) -> str:
    if isinstance(value, dict):
        return "{}"
    if type(value) is list:
        return "[]"
    try:
        return _literal(value, 0)
    except ClipcliError as e:
        e.tensor = name
        raise


def _dims(value: Any, what: str, name: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or not all(type(d) is int and 0 <= d < _MAX_INDEX for d in value):
        raise MalformedError(f"the {what} is not a tuple of non-negative integers", tensor=name)
    return tuple(value)


def _describe(name: str, t: _Tensor, big_endian: bool) -> TorchTensor:
    """The tensor under its name, checked: its view lies inside its storage, and its storage in the file."""
    shape = _dims(t.shape, "shape", name)
    check_elements(shape, name)  # before anything counts or prints them (a meta tensor's too)
    storage = t.storage
    dtype = t.dtype if t.dtype is not None or not isinstance(storage, _Storage) else storage.dtype
    dtype_name = dtype.name if dtype is not None else "unknown"
    skip = (
        t.skip
        if t.skip is not None or dtype is None or dtype.array is not None
        else f"dtype {dtype.name} has no NumPy type"
    )
    if storage is None:  # sparse, meta, nested: listed with their shape, no storage
        strides = _dims(t.strides, "strides", name) if t.strides else ()
        return TorchTensor(name, None, dtype_name, shape, strides, 0, "", 0, 0, False, skip)
    assert isinstance(storage, _Storage) and dtype is not None
    strides = _dims(t.strides, "strides", name)
    if len(strides) != len(shape):
        raise MalformedError(f"{len(shape)} dimensions but {len(strides)} strides", tensor=name)
    if type(t.offset) is not int or not 0 <= t.offset < _MAX_INDEX:
        raise MalformedError("the storage offset is not a non-negative integer", tensor=name)
    itemsize = dtype.itemsize
    if math.prod(shape):
        last = t.offset + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
        if (last + 1) * itemsize > storage.nbytes:
            raise MalformedError(
                f"the view (offset {t.offset}, shape {shape}, strides {strides}) needs {(last + 1) * itemsize} "
                f"bytes of storage {storage.key}, which holds {storage.nbytes}",
                tensor=name,
            )
    first_byte = storage.base + t.offset * itemsize
    if first_byte % itemsize:
        raise MalformedError(f"storage view {storage.key} does not start on a {dtype.name} element", tensor=name)
    root = storage.root
    return TorchTensor(
        name,
        None if skip else dtype.array,
        dtype_name,
        shape,
        strides,
        first_byte // itemsize,
        root.key,
        root.file_offset,
        root.nbytes,
        big_endian,
        skip,
    )


# -- the format -------------------------------------------------------------------------------------

# The records of a torch archive (torch.save or torch.jit.save), in its one folder; an .npz holds .npy files.
_TORCH_RECORDS = ("data.pkl", "constants.pkl", "version")
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")


def _sniff(head: bytes, f: BinaryIO | None = None) -> bool:
    """A zip whose first record is torch's (or, the file `f` given, any record: torch.jit.save writes its
    storages first), or a pickle of torch's legacy magic number."""
    if head.startswith(_ZIP):
        return _is_torch_record(first_zip_member(head)) or (f is not None and _has_torch_record(f))
    return head[:1] in (b"\x80", b"L") and _starts_with_torch_magic(head)  # L: protocols 0 and 1 write a LONG


def _has_torch_record(f: BinaryIO) -> bool:
    try:
        with zipfile.ZipFile(f) as z:
            return any(_is_torch_record(name) for name in z.namelist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False  # the reader says what is wrong with it


def _is_torch_record(name: str) -> bool:
    folder, _, record = name.partition("/")
    return bool(folder) and (record in _TORCH_RECORDS or record.startswith("code/"))


def _starts_with_torch_magic(head: bytes) -> bool:
    """Whether the first pickle is torch's legacy magic number, in any pickle protocol."""
    try:
        value, _ = unpickle_at(head, 0, lambda module, name: None)
    except ClipcliError:
        return False
    return type(value) is int and value == MAGIC_NUMBER


def _describe_head(head: bytes) -> str | None:
    if _sniff(head):
        kind = "zip" if head.startswith(b"PK") else "legacy"
        return f"a PyTorch {kind} checkpoint (name it .pt, .pth or .bin)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle; clipcli never unpickles"
    return None


FORMAT = Format("torch", (".pt", ".pth", ".bin", ".ckpt"), sniff=_sniff, describe=_describe_head, open_file=open_file)
