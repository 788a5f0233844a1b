"""What a torch.save pickle may build: its tensors' descriptions, the dtypes, and the allowlist of globals."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from clipcli.checkpoint.formats._numpy_pickle import numpy_globals
from clipcli.checkpoint.formats._pickle import (
    PLAIN_GLOBALS,
    Constructor,
    Record,
    a_kind,
)
from clipcli.errors import (
    MalformedError,
    printable,
)

_MAX_INDEX = 1 << 63  # shapes, strides and offsets are int64 in torch


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
    held: bytes | None = None  # the values themselves, C order, native order (a NumPy array inside the pickle)
    itemsize: int = 0  # bytes per element in its storage, also when skipped (quantized: 1 for qint8); 0 if none

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The bytes of its elements (a skipped tensor's too, as its storage holds them; 0 with no storage)."""
        return self.numel * (self.dtype.itemsize if self.dtype is not None else self.itemsize)


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
class Dtype:
    """A torch dtype: its name in torch, its NumPy / ml_dtypes type if any, and its element size."""

    torch_name: str
    itemsize: int
    array: np.dtype | None

    @property
    def name(self) -> str:
        return self.torch_name if self.array is None else self.array.name


def _dtype_table() -> dict[str, Dtype]:
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
    table = {name: Dtype(name, np.dtype(t).itemsize, np.dtype(t)) for name, t in arrays.items()}
    # Listed and skipped: types that neither NumPy nor ml_dtypes holds (complex32, a pair of float16s;
    # float4_e2m1fn_x2, two 4-bit floats a byte, where ml_dtypes' float4_e2m1fn takes a byte each), quantized
    # integers, and the bits types (bytes without a meaning).
    others = {"complex32": 4, "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1}
    others.update({"float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2})
    others.update({"bits1x8": 1, "bits2x4": 1, "bits4x2": 1})
    others.update({f"{sign}int{bits}": 1 for sign in ("", "u") for bits in range(1, 8)})
    table.update({name: Dtype(name, size, None) for name, size in others.items()})
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


class Named(Record):
    """A torch object a pickle passes by name: a dtype, a layout, a quantization scheme, a tensor type."""

    def __init__(self, name: str, dtype: Dtype | None = None):
        self.name = name  # "torch.float32"
        self.dtype = dtype

    def describe(self) -> str:
        return f"global {self.name}"


class StorageType(Record):
    """A storage class named in a persistent id; `dtype` is None for UntypedStorage (bytes)."""

    def __init__(self, name: str, dtype: Dtype | None):
        self.name = name
        self.dtype = dtype

    def describe(self) -> str:
        return f"global {self.name}"


class Device(Record):
    def __init__(self, text: str):
        self.text = text

    def describe(self) -> str:
        return "torch.device"


class Storage(Record):
    """A storage named by a persistent id: `numel` elements of `dtype` (bytes for UntypedStorage).

    A legacy storage view covers `nbytes` bytes from `base` bytes into the storage `root`.
    """

    def __init__(self, key: str, dtype: Dtype, numel: int):
        self.key = key
        self.dtype = dtype
        self.numel = numel
        self.root = self
        self.base = 0
        self.nbytes = numel * dtype.itemsize
        self.file_offset = -1  # set once the storage is found in the file

    def describe(self) -> str:
        return "storage"


class Tensor(Record):
    """A tensor as a rebuild function describes it; checked, with its name, by `_describe`."""

    def __init__(
        self,
        storage: Any,
        offset: Any,
        shape: Any,
        strides: Any,
        dtype: Dtype | None = None,
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


def _storage_arg(storage: Any, func: str) -> Storage:
    if not isinstance(storage, Storage):
        raise MalformedError(f"{func} is given {a_kind(storage)} where a storage belongs")
    return storage


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> Tensor:
    _storage_arg(storage, "torch._utils._rebuild_tensor")
    return Tensor(storage, storage_offset, size, stride)


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    metadata: Any = None,
) -> Tensor:
    _storage_arg(storage, "torch._utils._rebuild_tensor_v2")
    return Tensor(storage, storage_offset, size, stride, skip=_metadata_skip(metadata))


def _rebuild_tensor_v3(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    backward_hooks: Any,
    dtype: Any,
    metadata: Any = None,
) -> Tensor:
    _storage_arg(storage, "torch._utils._rebuild_tensor_v3")
    return Tensor(storage, storage_offset, size, stride, _dtype_arg(dtype), _metadata_skip(metadata))


def _metadata_skip(metadata: Any) -> str | None:
    """Why a tensor with these flags cannot be read as stored, if it cannot.

    torch writes only its conj and neg bits here (torch._utils.get_tensor_metadata); a flag it never writes
    is a file clipcli does not understand, named in the reason only in part and escaped (it is the file's).
    """
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise MalformedError(f"tensor metadata is {a_kind(metadata)}, not a dict")
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
    shown = [printable(k[:_FLAG_CHARS]) if type(k) is str else f"{a_kind(k)}" for k in keys[:_SHOWN_FLAGS]]
    more = len(keys) - _SHOWN_FLAGS
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _dtype_arg(dtype: Any) -> Dtype:
    if not isinstance(dtype, Named) or dtype.dtype is None:
        raise MalformedError(f"{a_kind(dtype)} where a torch dtype belongs")
    return dtype.dtype


def _tensor_arg(data: Any, func: str) -> Tensor:
    if not isinstance(data, Tensor):
        raise MalformedError(f"{func} is given {a_kind(data)} where a tensor belongs")
    return data


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> Tensor:
    return _tensor_arg(data, "torch._utils._rebuild_parameter")


def _rebuild_parameter_with_state(data: Any, requires_grad: Any, backward_hooks: Any, state: Any) -> Tensor:
    return _tensor_arg(data, "torch._utils._rebuild_parameter_with_state")


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Tensor:
    # A tensor with Python attributes (or a Parameter subclass): rebuilt by one of the functions above.
    if not (isinstance(func, Constructor) and func.name in _TENSOR_REBUILDERS):
        raise MalformedError(f"torch._tensor._rebuild_from_type_v2 is given {a_kind(func)} to call")
    if not (isinstance(new_type, Named) and new_type.name in _TENSOR_TYPES):
        raise MalformedError(f"torch._tensor._rebuild_from_type_v2 is given {a_kind(new_type)} as the tensor type")
    if type(args) is not tuple:
        raise MalformedError(f"torch._tensor._rebuild_from_type_v2 is given {a_kind(args)} of arguments")
    return _tensor_arg(func.func(*args), "torch._tensor._rebuild_from_type_v2")


def _rebuild_qtensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    quantizer_params: Any,
    requires_grad: Any,
    backward_hooks: Any,
) -> Tensor:
    _storage_arg(storage, "torch._utils._rebuild_qtensor")
    scheme = quantizer_params[0] if type(quantizer_params) is tuple and quantizer_params else None
    if not (isinstance(scheme, Named) and scheme.name in QSCHEMES):
        raise MalformedError(f"torch._utils._rebuild_qtensor is given {a_kind(scheme)} as quantization scheme")
    return Tensor(storage, storage_offset, size, stride, skip=f"quantized tensor ({scheme.name})")


def _rebuild_sparse_tensor(layout: Any, data: Any) -> Tensor:
    if not (isinstance(layout, Named) and layout.name in _SPARSELAYOUTS):
        raise MalformedError(f"torch._utils._rebuild_sparse_tensor is given {a_kind(layout)} as layout")
    coo = layout.name == "torch.sparse_coo"  # (indices, values, size[, coalesced]); else 2 index tensors first
    if type(data) is not tuple or len(data) not in ((3, 4) if coo else (4,)):
        raise MalformedError("torch._utils._rebuild_sparse_tensor is given malformed data")
    values, size = (data[1], data[2]) if coo else (data[2], data[3])
    dtype = _tensor_arg(values, "torch._utils._rebuild_sparse_tensor").dtype
    if dtype is None and isinstance(values.storage, Storage):
        dtype = values.storage.dtype
    return Tensor(None, 0, size, (), dtype, f"sparse tensor ({layout.name})")


def _rebuild_meta_tensor_no_storage(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> Tensor:
    return Tensor(None, 0, size, stride, _dtype_arg(dtype), "meta tensor: no data")


def _rebuild_nested_tensor(buffer: Any, sizes: Any, strides: Any, storage_offsets: Any) -> Tensor:
    values = _tensor_arg(buffer, "torch._utils._rebuild_nested_tensor")
    dtype = values.dtype or (values.storage.dtype if isinstance(values.storage, Storage) else None)
    return Tensor(None, 0, (), (), dtype, "nested tensor (ragged, no single shape)")


def _size(dims: Any = ()) -> tuple[int, ...]:
    if type(dims) not in (tuple, list) or not all(type(d) is int for d in dims):
        raise MalformedError("torch.Size is given something other than integers")
    return tuple(dims)


def _device(kind_: Any, index: Any = None) -> Device:
    if type(kind_) is not str or not (index is None or type(index) is int):
        raise MalformedError("torch.device is given something other than a name and an index")
    return Device(kind_ if index is None else f"{kind_}:{index}")


def _get_layout(name: Any) -> Named:
    if name not in LAYOUTS:
        raise MalformedError("torch.serialization._get_layout is given an unknown layout")
    return Named(name)


# the types _rebuild_from_type_v2 may give: a plain tensor with Python attributes (a Parameter pickles
# through _rebuild_parameter*, and any other subclass names its own class, which is refused)
_TENSOR_TYPES = {"torch.Tensor"}
_SPARSELAYOUTS = {"torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr", "torch.sparse_bsc"}
# every layout torch.serialization._get_layout names (distributed checkpoints' metadata name torch.strided)
LAYOUTS = _SPARSELAYOUTS | {"torch.strided", "torch._mkldnn", "torch.jagged"}
QSCHEMES = {
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
    # plain data that protocol 2 writes through globals (the audit says that torch.load(weights_only=True)
    # refuses builtins.bytes and builtins.frozenset: empty bytes and frozensets)
    allowed: dict[str, Any] = {c.name: c for c in PLAIN_GLOBALS.values()}
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
        allowed[f"torch.{name}"] = Named(f"torch.{name}", dtype)
    for name in _TENSOR_TYPES | QSCHEMES:  # layouts come through _get_layout
        allowed[name] = Named(name)
    for cls, dtype_name in _STORAGE_CLASSES.items():
        for module in ("torch", "torch.cuda"):  # torch < 1.10 named storages of CUDA tensors torch.cuda.*
            allowed[f"{module}.{cls}"] = StorageType(f"torch.{cls}", _DTYPES[dtype_name])
    allowed["torch.storage.UntypedStorage"] = StorageType("torch.storage.UntypedStorage", None)
    allowed.update(numpy_globals())
    return allowed


_ALLOWED = _allowlist()


def resolve(module: str, name: str) -> Any:
    return _ALLOWED.get(f"{module}.{name}")


def resolve_global(module: str, name: str) -> Any:
    """What a global of a torch.save file's allowlist resolves to (dtypes, torch.Size, ...), or None."""
    return resolve(module, name)


def dtype_of(obj: Any) -> tuple[np.dtype | None, str] | None:
    """The NumPy / ml_dtypes dtype (None for types without one) and name of a torch dtype that a pickle
    named through `resolve_global` ('float32', 'bfloat16', 'complex32'); None if `obj` is not a dtype."""
    if isinstance(obj, Named) and obj.dtype is not None:
        return obj.dtype.array, obj.dtype.name
    return None


def resolve_nothing(module: str, name: str) -> Any:
    return None


class Storages:
    """The storages a pickle's persistent ids name, one object per key."""

    def __init__(self, legacy: bool):
        self.legacy = legacy
        self.by_key: dict[str, Storage] = {}

    def persistent_load(self, pid: Any) -> Storage:
        n = 6 if self.legacy else 5
        if type(pid) is not tuple or len(pid) != n or pid[0] not in ("storage", b"storage"):
            raise MalformedError(
                f"a persistent id that is not ('storage', type, key, location, numel{', view' * self.legacy})"
            )
        storage_type, key, _location, numel = pid[1:5]
        if not isinstance(storage_type, StorageType):
            raise MalformedError(f"a persistent id names {a_kind(storage_type)} as its storage type")
        if type(key) is not str or not key:
            raise MalformedError(f"a persistent id's storage key is {a_kind(key)}")
        if type(numel) is not int or not 0 <= numel < _MAX_INDEX:
            raise MalformedError(f"storage {key} has a bad size")
        dtype = storage_type.dtype or _UINT8
        storage = self._storage(key, dtype, numel)
        if n == 6 and pid[5] is not None:
            return self._view(storage, pid[5])
        return storage

    def _storage(self, key: str, dtype: Dtype, numel: int) -> Storage:
        storage = self.by_key.get(key)
        if storage is None:
            storage = self.by_key[key] = Storage(key, dtype, numel)
        elif storage.dtype != dtype or storage.numel != numel:
            raise MalformedError(f"storage {key} is declared twice with different types or sizes")
        return storage

    @staticmethod
    def _view(root: Storage, view: Any) -> Storage:
        # legacy (torch < 0.4) storage views: (view key, offset, size) in elements of the root's dtype
        if type(view) is not tuple or len(view) != 3:
            raise MalformedError(f"storage {root.key} has malformed view metadata")
        key, offset, size = view
        if type(key) is not str or type(offset) is not int or type(size) is not int or offset < 0 or size < 0:
            raise MalformedError(f"storage {root.key} has malformed view metadata")
        if offset + size > root.numel:
            raise MalformedError(f"storage view {key} runs past the end of storage {root.key}")
        storage = Storage(key, root.dtype, size)
        storage.root = root
        storage.base = offset * root.dtype.itemsize
        return storage
