"""Bytes that go from a local input into an output unchanged: copied by the kernel, never through Python's buffers."""

from __future__ import annotations

import errno
import io
import os
import stat
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO, NamedTuple

from clipcli.checkpoint.crc import crc32
from clipcli.checkpoint.source import FileSource, LocalStore, Store
from clipcli.checkpoint.tensor import Span, TensorInfo
from clipcli.errors import MalformedError

_PIECE = 4 << 20  # what a read takes where the bytes must pass through memory (a CRC-32, a stream without a file)
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.ETXTBSY}
MIN_BYTES = 1 << 20  # smaller tensors are read with the others (a copy costs its own system calls)


class FileRange(NamedTuple):
    """A tensor's bytes as they lie in a local file, which an output holds unchanged (`unchanged_range`)."""

    store: LocalStore
    file: str
    offset: int
    nbytes: int
    name: str  # the tensor's, for an error

    def copy_to(self, f: BinaryIO) -> int:
        """Appends the bytes to `f` at its position (`os.copy_file_range` where the file system has it;
        otherwise, and into a stream without a file, read and written); returns how many.

        Raises:
            MalformedError: when the input ends before the bytes do.
        """
        source = self.store.source(self.file)
        try:
            f.flush()
            copied = 0
            fd = _descriptor(f)
            if fd is not None:
                start = f.tell()
                copied = self._kernel_copy(source, fd, start)
                f.seek(start + copied)
            for piece in self._pieces(source, copied):
                f.write(piece)
            return self.nbytes
        finally:
            self.store.release(source)

    def crc(self, crc: int = 0) -> int:
        """The CRC-32 of the bytes, continued from `crc` (read in pieces: a thread computes it while they are
        copied).

        Raises:
            MalformedError: when the input ends before the bytes do.
        """
        source = self.store.source(self.file)
        try:
            for piece in self._pieces(source, 0):
                crc = crc32(piece, crc)
            return crc
        finally:
            self.store.release(source)

    def _kernel_copy(self, source: FileSource, fd: int, at: int) -> int:
        """Copies from the start, `at` the output's byte `at`, for as long as the kernel does; returns how much."""
        done = 0
        while done < self.nbytes:
            try:
                n = os.copy_file_range(source.fileno(), fd, self.nbytes - done, self.offset + done, at + done)
            except OSError as e:
                if e.errno in _NO_KERNEL_COPY:
                    return done  # (another file system, an old kernel): the rest is read and written
                raise
            if n == 0:
                raise self._short()
            done += n
        return done

    def _pieces(self, source: FileSource, start: int) -> Iterator[memoryview]:
        """The bytes from `start`, a reused buffer's worth at a time."""
        buf = memoryview(bytearray(min(_PIECE, max(self.nbytes - start, 1))))
        at = start
        while at < self.nbytes:
            view = buf[: min(len(buf), self.nbytes - at)]
            n = source.read_into(self.offset + at, view)
            if n == 0:
                raise self._short()
            yield view[:n]
            at += n

    def _short(self) -> MalformedError:
        return MalformedError("the file ends before the tensor's data does", self.file, self.name)


def _descriptor(f: Any) -> int | None:
    """The file descriptor of a regular file written at its position, or None (a zip member's stream, a FIFO)."""
    try:
        fd = f.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, io.UnsupportedOperation, AttributeError):
        return None


def unchanged_range(store: Store, t: TensorInfo) -> FileRange | None:
    """Where a tensor's bytes lie in a local file exactly as an output stores them (C order, little-endian, no
    container's check to pass), for a copy that never reads them into Python; None for any other (and for
    one smaller than MIN_BYTES)."""
    loc = t.location
    if (
        t.nbytes < MIN_BYTES
        or not isinstance(store, LocalStore)
        or type(loc) is not Span
        or loc.crc is not None
        or t.stored_dtype is not None
        or t.fortran_order
        or t.prefix
        or t.skip is not None
        or t.array_dtype is None
        or sys.byteorder != "little"
    ):
        return None
    return FileRange(store, t.file, loc.offset, t.nbytes, t.name)
