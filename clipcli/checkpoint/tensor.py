"""A tensor as a header describes it, and the locations of its bytes: the types every format builds."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from clipcli.errors import MalformedError

MAX_COUNT = 1 << 63  # element counts, sizes, strides and offsets are int64 in torch and intp in NumPy


def check_elements(shape: tuple[int, ...], tensor: str | None = None) -> None:
    """Refuses a header's shape (each dimension below MAX_COUNT) of MAX_COUNT elements or more, before anything
    prints its count: no tensor holds that many, and Python refuses to print an int of more than 4,300 digits.

    Raises:
        MalformedError: saying so, without the shape (it may have thousands of dimensions).
    """
    if math.prod(shape) >= MAX_COUNT:
        raise MalformedError(f"the shape ({len(shape)} dimensions) holds more than 2**63 elements", tensor=tensor)


# never changed once made; not frozen, as a frozen one is 4 times as slow to make; slots, as a header may list
# a million
@dataclass(unsafe_hash=True, slots=True)
class TensorInfo:
    """A tensor as its file's header describes it; `array_dtype` is None for types carried as bytes.

    `location` says where its bytes lie (a `Span` of the file, `Pieces` of files or a strided view of
    one storage, or a `ZipMember` stream); `stored_dtype` is the byte order they are stored in when it is
    not the native one. A tensor with a `skip` reason (a sparse or quantized PyTorch tensor) is listed but
    has no values; `storage` names the storage it shares with other tensors (tied weights), if it does.
    `compression` is the method of the .npz member it came from (kept when written to .npz) and `prefix` the header
    bytes a type carried as bytes had in it (written back as they were).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    array_dtype: np.dtype | None = field(repr=False)
    fortran_order: bool = field(default=False, repr=False)
    location: Any = field(default=None, repr=False, compare=False)
    stored_dtype: np.dtype | None = field(default=None, repr=False, compare=False)
    compression: int = field(default=0, repr=False, compare=False)  # zip's ZIP_STORED
    prefix: bytes = field(default=b"", repr=False, compare=False)
    skip: str | None = field(default=None, compare=False)  # why it is listed but has no values to read
    storage: str | None = field(default=None, repr=False, compare=False)  # a storage it shares with others

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class StoredCrc(NamedTuple):
    """The CRC-32 a zip directory records for a member, and the CRC-32 of the member's bytes before the data."""

    expected: int
    head: int
    head_length: int
    member: str = ""  # the member's name, as messages give it


class Span(NamedTuple):
    """A tensor's bytes lie contiguous in its file from byte `offset` (read with `pread`, by any worker).

    `crc`, where the container stores one (a stored zip member), checks them once they have all been read.
    """

    offset: int
    crc: StoredCrc | None = None


class Held(NamedTuple):
    """A tensor's bytes held in memory, read with its header (a NumPy array pickled inside a PyTorch file)."""

    data: bytes


class Piece(NamedTuple):
    """A rectangular piece of a tensor (`sizes` from `offsets`), its elements in C order from `offset` of `file`.

    `strided`, for a piece saved as a view with gaps, in another order or with values repeated (a stride of
    0): its strides (elements, non-negative) and the bytes from `offset` that hold it.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    strided: tuple[tuple[int, ...], int] | None = None

    def strides(self) -> tuple[int, ...]:
        """Its strides in elements: its own, or those of C order."""
        return self.strided[0] if self.strided else c_strides(self.sizes)


class Copy(NamedTuple):
    """Elements of one piece that a read takes: `window` elements of the piece's bytes from element `at`
    (relative to its `offset`), of which those at `source` strides (elements, from the window's start) go
    to the read's buffer at element `target` and `target_strides`; `sizes` is their shape."""

    piece: int
    at: int
    window: int
    sizes: tuple[int, ...]
    source: tuple[int, ...]
    target: int
    target_strides: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.sizes)

    @property
    def direct(self) -> bool:
        """Whether the window is the elements themselves, in the buffer's order: read straight into it."""
        return self.window == self.count and all(s == 1 for s in (*self.source, *self.target_strides))


# never changed once made (not frozen: a frozen class costs two more generated methods to create); compared by
# identity, so a view of a storage is never the same location as another (`shared_once`)
@dataclass(eq=False)
class Pieces:
    """A tensor stored in rectangular pieces, each in some file (the chunks of a distributed checkpoint), or
    a view of one storage (a PyTorch slice, transpose or expand: one piece, strided). Its bytes are read in
    the tensor's own C order: each read takes, of each piece it touches, the piece's bytes that hold the
    elements it wants (one contiguous window) and scatters them by strides, whatever the pieces (rows or
    columns, from any rank) and however many.
    """

    shape: tuple[int, ...]
    itemsize: int
    pieces: tuple[Piece, ...]

    @property
    def strided(self) -> bool:
        """Whether a piece is strided: its reads may each need most of its bytes (read it in order, held)."""
        return any(p.strided for p in self.pieces)

    def copies(self, start: int, stop: int) -> Iterator[Copy]:
        """What reading elements [start, stop) of the tensor takes, piece by piece (each element once)."""
        target = 0
        for offsets, sizes in flat_boxes(self.shape, start, stop):
            box_strides = c_strides(sizes)
            ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
            for i in self._touching(target + start, target + start + math.prod(sizes)):
                piece = self.pieces[i]
                lo = [max(a, b) for a, b in zip(offsets, piece.offsets, strict=True)]
                hi = [min(a, b + n) for a, b, n in zip(ends, piece.offsets, piece.sizes, strict=True)]
                if any(a >= b for a, b in zip(lo, hi, strict=True)):
                    continue
                strides = piece.strides()
                at = sum((a - b) * s for a, b, s in zip(lo, piece.offsets, strides, strict=True))
                shape = tuple(b - a for a, b in zip(lo, hi, strict=True))
                window = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1
                into = target + sum((a - b) * s for a, b, s in zip(lo, offsets, box_strides, strict=True))
                sizes_, (source, into_strides) = collapse(shape, strides, box_strides)
                yield Copy(i, at, window, sizes_, source, into, into_strides)
            target += math.prod(sizes)

    def _touching(self, start: int, stop: int) -> list[int]:
        """The pieces whose elements lie (first to last, in C order) anywhere in [start, stop): found by
        bisection among the pieces sorted by their first element, not by looking at every piece."""
        first, last, order, reach = self._extents()
        hi = int(np.searchsorted(first, stop, side="left"))
        lo = int(np.searchsorted(reach, start, side="right"))  # before lo, every piece ends at or before start
        picked = order[lo:hi][last[lo:hi] > start]
        return np.sort(picked).tolist()

    def _extents(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The pieces' first elements (sorted), their ends, their order, and the largest end so far."""
        cached = self.__dict__.get("_extents_")
        if cached is None:
            strides = c_strides(self.shape)
            starts, ends = [], []
            for piece in self.pieces:
                starts.append(sum(o * s for o, s in zip(piece.offsets, strides, strict=True)))
                last = [o + n - 1 for o, n in zip(piece.offsets, piece.sizes, strict=True)]
                ends.append(sum(o * s for o, s in zip(last, strides, strict=True)) + 1)
            order = np.argsort(np.array(starts, np.int64), kind="stable")
            first = np.array(starts, np.int64)[order]
            last = np.array(ends, np.int64)[order]
            reach = np.maximum.accumulate(last) if last.size else last
            cached = self.__dict__["_extents_"] = (first, last, order, reach)
        return cached


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (elements) of C order."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, sizes) whose elements, box after box and each box in C order, are elements
    [start, stop) of a tensor of `shape` in C order: at most two a dimension (a partial row on each side)."""
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    rank = len(shape)

    def walk(d: int, prefix: tuple[int, ...], start: int, stop: int) -> None:
        if d == rank:  # a 0-d tensor's one element
            boxes.append((prefix, ()))
            return
        row = math.prod(shape[d + 1 :])
        a, b = -(-start // row), stop // row  # the whole rows of dimension d
        if a > b:  # inside one row
            walk(d + 1, (*prefix, b), start - b * row, stop - b * row)
            return
        if start < a * row:
            walk(d + 1, (*prefix, a - 1), start - (a - 1) * row, row)
        if a < b:
            boxes.append(((*prefix, a, *(0,) * (rank - d - 1)), ((1,) * d + (b - a,) + shape[d + 1 :])))
        if b * row < stop:
            walk(d + 1, (*prefix, b), 0, stop - b * row)

    if start < stop:
        walk(0, (), start, stop)
    return boxes


def collapse(sizes: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The same elements in fewest dimensions: dimensions of one element dropped, and neighbours that every
    `strides` walks as one merged. (NumPy holds at most 64 dimensions; a tensor may have more.)"""
    kept = [d for d, n in enumerate(sizes) if n != 1]
    out_sizes: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for d in reversed(kept):
        n = sizes[d]
        if out_sizes and all(s[d] == o[0] * out_sizes[0] for s, o in zip(strides, out_strides, strict=True)):
            out_sizes[0] *= n
            continue
        out_sizes.insert(0, n)
        for s, o in zip(strides, out_strides, strict=True):
            o.insert(0, s[d])
    return tuple(out_sizes), [tuple(o) for o in out_strides]


class ZipMember(NamedTuple):
    """A tensor's bytes come in order from a compressed zip member, from `data_offset` on (one reader)."""

    member: str
    data_offset: int
