"""File-level helpers: what a file really is, and atomic writes that never leave a partial target."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import reprlib
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, cast

import numpy as np

from clipcli.errors import MalformedError, WriteError, commit_begins, defer_stops, raise_if_stopped

# Every this many bytes written, the file asks the kernel to start writing them to the disk.
WRITEBACK_BYTES = 32 << 20

SAFETENSORS = "a safetensors file"
UNKNOWN = "not a known checkpoint format"
HEAD_BYTES = 512  # enough to see a tar header's magic at 257

_TORCH_MAGIC = b"\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # LONG1 of torch's legacy magic number


def sniff_format(head: bytes) -> str | None:
    """The checkpoint format the first bytes of a file show ('safetensors', 'npy', 'npz', 'torch'), if any."""
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "torch" if _first_zip_member(head).endswith("data.pkl") else "npz"
    if head[:1] == b"\x80" and head[2:14] == _TORCH_MAGIC:
        return "torch"
    if len(head) >= 9 and head[8:].lstrip(b" \t\r\n")[:1] == b"{" and int.from_bytes(head[:8], "little") < 1 << 32:
        return "safetensors"
    return None


def _first_zip_member(head: bytes) -> str:
    if len(head) < 30 or not head.startswith(b"PK\x03\x04"):
        return ""
    n = int.from_bytes(head[26:28], "little")
    return head[30 : 30 + n].decode("utf-8", "replace")


def sniff(head: bytes) -> str:
    """What the first bytes of a file say it is, as a phrase for an error message."""
    text = head.lstrip().lower()
    fmt = sniff_format(head)
    if not head:
        return "an empty file"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer, not the checkpoint itself (run `git lfs pull`)"
    if text.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml")):
        return "an HTML page, not a checkpoint (a download that returned a web page?)"
    if fmt == "torch":
        kind = "zip" if head.startswith(b"PK") else "legacy"
        return f"a PyTorch {kind} checkpoint (name it .pt, .pth or .bin)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle; clipcli never unpickles"
    if fmt == "npz":
        return "a zip archive (an .npz?)" if _first_zip_member(head).endswith(".npy") else "a zip archive"
    if head.startswith(b"PK\x05\x06"):
        return "an empty zip archive"
    if fmt == "npy":
        return "a NumPy .npy file"
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 file (a Keras .h5?)"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file"
    if head[257:262] == b"ustar":
        return "a tar archive (PyTorch's format before version 0.4, which clipcli does not read)"
    if fmt == "safetensors":
        return SAFETENSORS
    if text.startswith((b"{", b"[")):
        return "a JSON file"
    if _is_text(head):
        return "a text file"
    return UNKNOWN


def _is_text(head: bytes) -> bool:
    if b"\x00" in head:
        return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut at the end of the head
            return False
        text = head[: e.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\n\r\f" for c in text)


def read_head(path: Path, n: int = HEAD_BYTES) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


MAX_COUNT = 1 << 63  # element counts, sizes, strides and offsets are int64 in torch and intp in NumPy


def check_elements(shape: tuple[int, ...], tensor: str | None = None) -> None:
    """Refuses a header's shape (each dimension below MAX_COUNT) of MAX_COUNT elements or more, before anything
    prints its count: no tensor holds that many, and Python refuses to print an int of more than 4,300 digits.

    Raises:
        MalformedError: saying so, without the shape (it may have thousands of dimensions).
    """
    if math.prod(shape) >= MAX_COUNT:
        raise MalformedError(f"the shape ({len(shape)} dimensions) holds more than 2**63 elements", tensor=tensor)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Holds off Python's cyclic garbage collector while a header's objects are made: a header may list a
    million tensors, none of them in a cycle, and each collection would walk all those made so far."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Shown(reprlib.Repr):
    """`repr`, cut short, with an int past 64 bits shown by its size (Python will not print one of more
    than 4,300 digits, and no header needs one)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxtuple, self.maxlist, self.maxdict, self.maxstring = 3, 8, 8, 8, 60

    def repr_int(self, x: int, level: int) -> str:
        return repr(x) if -(1 << 64) < x < 1 << 64 else f"<a {x.bit_length()}-bit number>"


shown = _Shown().repr  # a value from a file's header as an error message quotes it


class StoredCrc(NamedTuple):
    """The CRC-32 a zip directory records for a member, and the CRC-32 of the member's bytes before the data."""

    expected: int
    head: int
    head_length: int


class Span(NamedTuple):
    """A tensor's bytes lie contiguous in its file from byte `offset` (read with `pread`, by any worker).

    `crc`, where the container stores one (a stored zip member), checks them once they have all been read.
    """

    offset: int
    crc: StoredCrc | None = None


class Strided(NamedTuple):
    """A tensor that is a view with gaps or another order (a PyTorch slice or transpose) of bytes from
    `offset`: element i of `index` lies at `offset + itemsize * sum(index * strides)`. Read whole."""

    offset: int
    strides: tuple[int, ...]
    span: int  # the bytes from `offset` that hold all its elements, gaps included


class Piece(NamedTuple):
    """A rectangular piece of a tensor (`sizes` from `offsets`), its elements in C order from `offset` of `file`.

    `strided`, for a piece saved as a view with gaps or another order: its strides (elements) and the
    bytes from `offset` that hold it.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    strided: tuple[tuple[int, ...], int] | None = None


@dataclass(frozen=True, eq=False)
class Pieces:
    """A tensor stored in rectangular pieces, each contiguous in some file (the chunks of a distributed
    checkpoint). Its bytes are read in the tensor's own C order, gathered from the pieces' runs: every
    reader sees one tensor, whatever the pieces (rows or columns, from any rank).
    """

    shape: tuple[int, ...]
    itemsize: int
    pieces: tuple[Piece, ...]
    whole: bool = False  # a piece is strided: the tensor is put together whole (in memory) to be read

    def runs(self, start: int, stop: int) -> Iterator[tuple[str, int, int, int]]:
        """(file, file offset, element of the tensor, count) of the runs that hold elements [start, stop)."""
        for piece, (starts, length) in zip(self.pieces, self._layout(), strict=True):
            first = max(int(np.searchsorted(starts, start, side="right")) - 1, 0)
            last = int(np.searchsorted(starts, stop, side="left"))
            for r in range(first, last):
                begin, end = max(int(starts[r]), start), min(int(starts[r]) + length, stop)
                if begin < end:
                    local = r * length + begin - int(starts[r])
                    yield piece.file, piece.offset + local * self.itemsize, begin, end - begin

    def _layout(self) -> list[tuple[np.ndarray, int]]:
        """Per piece: where each of its runs begins in the tensor (sorted), and the elements a run holds.

        A run is as much of a piece as lies together in the tensor's C order: its last dimensions while
        they are whole, times the first one that is not.
        """
        cached = self.__dict__.get("_runs")
        if cached is None:
            cached = [_piece_runs(self.shape, piece.offsets, piece.sizes) for piece in self.pieces]
            self.__dict__["_runs"] = cached
        return cached


def _piece_runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[np.ndarray, int]:
    rank = len(shape)
    k = rank - 1
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[j + 1 :]) for j in range(rank)]
    length = sizes[k] * strides[k] if rank else 1
    base = sum(offsets[j] * strides[j] for j in range(rank))
    if k <= 0 or not rank:
        return np.array([base], np.int64), length
    index = np.indices(sizes[:k], dtype=np.int64).reshape(k, -1)
    starts = base + sum(index[j] * strides[j] for j in range(k))
    return np.asarray(starts, np.int64).reshape(-1), length


class ZipMember(NamedTuple):
    """A tensor's bytes come in order from a compressed zip member, from `data_offset` on (one reader)."""

    member: str
    data_offset: int


def zip_data_start(read: Callable[[int, int], bytes], info: Any) -> int | None:
    """Where a zip member's bytes begin (after its local header, whose lengths may differ from the
    directory's), or None when no local header of that name is where the directory says: the directory
    would point at another member's bytes. `read(offset, n)` reads the archive; `info` is a ZipInfo."""
    local = read(info.header_offset, 30)
    if len(local) < 30 or not local.startswith(b"PK\x03\x04"):
        return None
    flags, name_len, extra_len = struct.unpack("<H18xHH", local[6:30])
    raw_name = read(info.header_offset + 30, name_len)
    name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")  # as zipfile decodes it
    if name != info.orig_filename:
        return None
    return info.header_offset + 30 + name_len + extra_len


def crc32_of_parts(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive byte strings from their own CRC-32s and lengths, in order.

    zlib's crc32_combine, which Python's zlib lacks: appending `n` zero bytes to a string maps its CRC
    linearly over GF(2); the maps for 2**k bytes are kept, and `n`'s bits pick which to apply.
    """
    crc = 0
    for part_crc, length in parts:
        crc = _append_zeros(crc, length) ^ part_crc
    return crc


_ZERO_BYTES: list[list[int]] = []  # _ZERO_BYTES[k]: the map of appending 2**k zero bytes, as 32 columns


def _append_zeros(crc: int, length: int) -> int:
    k = 0
    while length:
        if k == len(_ZERO_BYTES):
            if k == 0:
                step = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
                for _ in range(3):  # eight zero bits
                    step = [_gf2_apply(step, column) for column in step]
            else:
                step = [_gf2_apply(_ZERO_BYTES[-1], column) for column in _ZERO_BYTES[-1]]
            _ZERO_BYTES.append(step)
        if length & 1:
            crc = _gf2_apply(_ZERO_BYTES[k], crc)
        length >>= 1
        k += 1
    return crc


def _gf2_apply(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def resolve_target(target: Path) -> Path:
    """The file a write to `target` lands in: a symlink's target, as `cp` writes through links."""
    return Path(os.path.realpath(target))


@contextlib.contextmanager
def atomic_write(target: Path) -> Iterator[BinaryIO]:
    """Yields a temporary file beside `target` that replaces it only once complete and fsynced.

    The result gets the mode a new file gets (the umask's) or keeps the mode of the file it replaces.
    On any failure, or an interrupt, the temporary file is removed and the target stays as it was.

    Raises:
        WriteError: when the file cannot be created, written or renamed.
    """
    real = resolve_target(target)
    if real.is_dir():
        raise WriteError("is a directory", target)
    try:
        mode = stat.S_IMODE(real.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as e:
        raise WriteError(e.strerror or str(e), target) from e
    import tempfile  # here: only writes need it (and its imports)

    resume = defer_stops()  # until the `try` that removes the file: a stop before it would leave the file behind
    try:
        fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    except OSError as e:
        resume()
        raise WriteError(f"cannot create a file in {real.parent}: {e.strerror or e}", target) from e
    try:
        with os.fdopen(fd, "wb") as f:
            resume()
            yield cast(BinaryIO, _EarlyWriteback(f))
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        raise_if_stopped()  # a stop whose exception was swallowed on the way never commits the write
        commit_begins()  # from here on a stop is dropped (the command line's handler)
        os.replace(tmp, real)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise WriteError(e.strerror or str(e), target) from e
        raise
    _fsync_dir(real.parent)


class _EarlyWriteback:
    """A file whose written bytes go to the disk while the next ones are computed, not all at fsync.

    Every WRITEBACK_BYTES, `posix_fadvise(DONTNEED)` starts the writeback of what was written since (it
    does not wait for it, and the pages stay cached until written). Without it a clip first fills the
    page cache with dirty pages and then waits for the disk in fsync: the computing and the writing add
    up instead of overlapping (a 2 GiB clip on this project's VM: 7.2-7.9 s before, 5.1-6.5 s after).
    """

    def __init__(self, f: BinaryIO):
        self._f = f
        self._mark = 0
        self._advise = getattr(os, "posix_fadvise", None)

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        end = self._f.tell()
        if self._advise is not None and end - self._mark >= WRITEBACK_BYTES:
            self._f.flush()
            with contextlib.suppress(OSError):  # only a hint: the fsync at the end still decides
                self._advise(self._f.fileno(), self._mark, end - self._mark, os.POSIX_FADV_DONTNEED)
            self._mark = end
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_data(f: BinaryIO, chunks: Iterable[np.ndarray | bytes | memoryview]) -> int:
    """Writes chunks as their little-endian bytes; returns how many were written."""
    written = 0
    for chunk in chunks:
        data = memoryview(np.ascontiguousarray(chunk).view(np.uint8)) if isinstance(chunk, np.ndarray) else chunk
        f.write(data)
        written += data.nbytes
    return written
