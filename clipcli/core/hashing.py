"""Content hashes of tensors and checkpoints: SHA-256 over a canonical byte form that no format changes.

The tensor hash is SHA-256 of these bytes, in this order (`u64` is an unsigned 64-bit little-endian
integer, `i64` a signed one):

1. `u64` the length in bytes of the dtype name, then the name in UTF-8: NumPy's or ml_dtypes' name,
   which carries no byte order (`float32`, `bfloat16`, `float8_e4m3fn`, `complex64`, `int64`, `bool`).
2. `u64` the number of dimensions, then each dimension as `i64` (none for a 0-d tensor).
3. The values in C order, each in its dtype's little-endian bytes (a complex value: real part, then
   imaginary part); a bool is one byte, 0 or 1. Nothing else: no padding, no count.

So a Fortran-order or big-endian `.npy`, a `.pt`, a DCP and a sharded safetensors of the same tensor
hash the same; NaN payloads and the sign of zero are kept, since they are in the bytes. In Python::

    header = len(name).to_bytes(8, "little") + name.encode() + len(shape).to_bytes(8, "little")
    header += b"".join(d.to_bytes(8, "little", signed=True) for d in shape)
    hashlib.sha256(header + np.ascontiguousarray(t, t.dtype.newbyteorder("<")).tobytes()).hexdigest()

A type clipcli carries as bytes (strings and records of an `.npy`, `float128`, an object array's pickle,
safetensors' packed 4- and 6-bit floats) has no canonical values: its hash is of the same three parts with
the name `stored <type> <order>` and its bytes as stored. `<type>` is Python's `repr` of the `descr` of the
NumPy type the `.npy` header states, byte order included (`repr(np.dtype('<U3').descr)`: `[('', '<U3')]`), or,
where there is no such header, the dtype's name as clipcli reports it (`float4_e2m1fn` for safetensors' `F4`);
`<order>` is `F` for a tensor stored in Fortran order with more than one dimension above 1, else `C`. Copies
that keep those bytes (an `.npy` and the `.npz` that holds it) hash the same; a byte-swapped or reordered one
does not.

The checkpoint hash is SHA-256 over its tensors sorted by name (the names' UTF-8 bytes, compared as
bytes), each as `u64` the length of its UTF-8 name, the name, then the tensor hash's 32 raw bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from clipcli.core.blocks import as_tensor


def canonical_header(dtype: Any, shape: tuple[int, ...]) -> bytes:
    """The bytes a tensor's hash begins with: its dtype's name and its shape, length-prefixed.

    Raises:
        ValueError: for a negative dimension.
    """
    return _header(np.dtype(dtype).name, shape)


def _header(name: str, shape: tuple[int, ...]) -> bytes:
    if any(d < 0 for d in shape):
        raise ValueError(f"a shape has no negative dimensions, got {tuple(shape)}")
    text = name.encode()
    dims = b"".join(int(d).to_bytes(8, "little", signed=True) for d in shape)
    return _u64(len(text)) + text + _u64(len(shape)) + dims


class StoredHasher:
    """Streams the bytes of a type carried as bytes, as stored, into its hash (see the module's docstring):
    `layout` is the type as its file states it and its element order, `nbytes` how many bytes it holds."""

    __slots__ = ("_fed", "_sha", "nbytes")

    def __init__(self, layout: str, shape: tuple[int, ...], nbytes: int) -> None:
        self._sha = hashlib.sha256(_header(f"stored {layout}", tuple(shape)))
        self.nbytes, self._fed = nbytes, 0

    def update(self, raw: Any) -> None:
        """Adds the next bytes (a uint8 array or a bytes-like object).

        Raises:
            ValueError: when they run past the tensor's bytes.
        """
        view = memoryview(raw).cast("B")
        if self._fed + view.nbytes > self.nbytes:
            raise ValueError(f"more bytes than the tensor's {self.nbytes}")
        self._fed += view.nbytes
        self._sha.update(view)

    def hexdigest(self) -> str:
        """The hash as 64 lowercase hexadecimal digits.

        Raises:
            ValueError: when fewer bytes than the tensor's were added.
        """
        if self._fed != self.nbytes:
            raise ValueError(f"{self._fed} of the tensor's {self.nbytes} bytes were added")
        return self._sha.hexdigest()


class TensorHasher:
    """Streams chunks of one tensor's values, in C order, into its canonical content hash.

    Args:
        dtype: the tensor's dtype (its byte order is of no matter).
        shape: the tensor's shape.
    """

    __slots__ = ("_dtype", "_fed", "_sha", "size")

    def __init__(self, dtype: Any, shape: tuple[int, ...]) -> None:
        self._dtype = np.dtype(dtype).newbyteorder("<")
        if self._dtype.kind not in "biufcV" or self._dtype.hasobject or self._dtype.fields:
            raise TypeError(f"cannot hash a tensor of dtype {self._dtype}")
        self.size = int(np.prod(shape, dtype=np.int64))
        self._sha = hashlib.sha256(canonical_header(self._dtype, tuple(shape)))
        self._fed = 0

    def update(self, values: Any) -> None:
        """Adds the next values (any shape, taken in C order; any byte order of the tensor's dtype).

        Raises:
            TypeError: when the values are of another dtype.
            ValueError: when they run past the tensor's size.
        """
        values = as_tensor(values)
        if values.dtype.newbyteorder("<") != self._dtype:
            raise TypeError(f"expected values of dtype {self._dtype.name}, got {values.dtype.name}")
        if self._fed + values.size > self.size:
            raise ValueError(f"more values than the tensor's {self.size}")
        self._fed += values.size
        self._sha.update(canonical_bytes(values))

    def digest(self) -> bytes:
        """The 32 bytes of the hash.

        Raises:
            ValueError: when fewer values than the tensor's size were added.
        """
        if self._fed != self.size:
            raise ValueError(f"{self._fed} of the tensor's {self.size} values were added")
        return self._sha.digest()

    def hexdigest(self) -> str:
        """The hash as 64 lowercase hexadecimal digits (see `digest`)."""
        return self.digest().hex()


def canonical_bytes(values: np.ndarray) -> bytes | memoryview:
    """The values' bytes in C order, little-endian, bools as 0 or 1: the third part of the canonical form."""
    if values.dtype.kind == "b":  # a bool read from raw bytes may hold any non-zero byte for True
        values = np.not_equal(values.view(np.uint8), 0).view(np.uint8)
    flat = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).reshape(-1)
    return memoryview(flat.view(np.uint8)) if flat.size else b""


def tensor_hash(t: Any) -> str:
    """The canonical content hash of a whole tensor (array-like), as hexadecimal digits."""
    t = as_tensor(t)
    hasher = TensorHasher(t.dtype, t.shape)
    hasher.update(t)
    return hasher.hexdigest()


def checkpoint_hash(hashes: Mapping[str, str] | Iterable[tuple[str, str]]) -> str:
    """The hash of a checkpoint from its tensors' names and hashes (hexadecimal), in any order.

    Raises:
        ValueError: when a name comes twice, or a hash is not 64 hexadecimal digits.
    """
    pairs = list(hashes.items() if isinstance(hashes, Mapping) else hashes)
    named = sorted((name.encode(), digest) for name, digest in pairs)
    if len({name for name, _ in named}) != len(named):
        raise ValueError("a tensor name comes twice")
    sha = hashlib.sha256()
    for name, digest in named:
        raw = bytes.fromhex(digest)
        if len(raw) != 32:
            raise ValueError(f"a tensor hash is 64 hexadecimal digits, got {digest!r}")
        sha.update(_u64(len(name)) + name + raw)
    return sha.hexdigest()


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")
