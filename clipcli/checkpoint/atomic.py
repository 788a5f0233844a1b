"""Atomic writes: a temporary file beside the target, renamed over it only once complete (and durable, where it
replaces a file)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np

from clipcli._stops import commit_begins, defer_stops, raise_if_stopped
from clipcli.checkpoint.copy import FileRange
from clipcli.errors import WriteError

# Every this many bytes written, the file asks the kernel to start writing them to the disk.
WRITEBACK_BYTES = 32 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def resolve_target(target: Path) -> Path:
    """The file a write to `target` lands in: a symlink's target, as `cp` writes through links (the link itself
    where it leads to what has no path: /dev/stdout on a pipe)."""
    real = Path(os.path.realpath(target))
    return Path(target) if not real.exists() and os.path.exists(target) else real


@contextlib.contextmanager
def atomic_write(target: Path) -> Iterator[BinaryIO]:
    """Yields a temporary file beside `target` that replaces it only once complete.

    A new file is written as `cp` writes one: complete when renamed, on the disk when the kernel writes it
    back. A file that replaces one (`--in-place`, an output written again) is fsynced before the rename and
    its directory after it, so that a power loss leaves the old file or the new one, never neither (the
    old may be the only copy); its bytes go to the disk as they are written (`_EarlyWriteback`).
    The result gets the mode a new file gets (the umask's) or keeps the mode of the file it replaces, and its
    owner and group where the process may give them (root may: `--in-place` as root kept root's).
    On any failure, or an interrupt, the temporary file is removed and the target stays as it was.

    Raises:
        WriteError: when the file cannot be created, written or renamed.
    """
    real = resolve_target(target)
    if real.is_dir():
        raise WriteError("is a directory", target)
    try:
        st = real.stat()
        mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = 0o666 & ~_umask(), None
    except OSError as e:
        raise WriteError(e.strerror or str(e), target) from e
    if owner is not None and not stat.S_ISREG(st.st_mode):  # a FIFO, a device: written into, as `cp` does
        with _written_into(real, target) as f:
            yield f
        return
    import tempfile  # here: only writes need it (and its imports)

    resume = defer_stops()  # until the `try` that removes the file: a stop before it would leave the file behind
    try:
        fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    except OSError as e:
        resume()
        raise WriteError(f"cannot create a file in {real.parent}: {e.strerror or e}", target) from e
    try:
        replaces = owner is not None
        with os.fdopen(fd, "wb") as f:
            resume()
            yield cast(BinaryIO, _EarlyWriteback(f, real, durable=replaces))
            f.flush()
            if owner is not None:
                _keep_owner(f.fileno(), owner)
            os.fchmod(f.fileno(), mode)  # after fchown, which clears set-user-ID bits
            if replaces:
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
    if replaces:
        _fsync_dir(real.parent)


def is_special(target: Path) -> bool:
    """Whether a write to `target` goes into a file that is not a regular one (a FIFO, a device such as
    /dev/null): written in order, into it, not replaced (`atomic_write`)."""
    try:
        mode = resolve_target(target).stat().st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@contextlib.contextmanager
def _written_into(real: Path, target: Path) -> Iterator[BinaryIO]:
    """A FIFO or device opened for writing (a FIFO waits for its reader, as `cp`'s does): no file to replace, so
    nothing to keep on a failure either.

    Raises:
        WriteError: when it cannot be opened or written (/dev/full: no space left on the device).
    """
    try:
        with open(real, "wb") as f:
            yield cast(BinaryIO, _EarlyWriteback(f, real, durable=False))
            f.flush()
    except OSError as e:
        raise WriteError(e.strerror or str(e), target) from e


def _keep_owner(fd: int, owner: tuple[int, int]) -> None:
    """Gives the file the owner and group it replaces, where the process may (others than root: only a group
    of their own, and their own files)."""
    if hasattr(os, "fchown"):
        with contextlib.suppress(PermissionError):
            os.fchown(fd, *owner)


class _EarlyWriteback:
    """A file whose written bytes, where it is `durable` (fsynced at the end), go to the disk while the next
    ones are computed, not all at fsync.

    Every WRITEBACK_BYTES, `posix_fadvise(DONTNEED)` starts the writeback of what was written since (it
    does not wait for it, and the pages stay cached until written). Without it a clip first fills the
    page cache with dirty pages and then waits for the disk in fsync: the computing and the writing add
    up instead of overlapping (a 2 GiB clip on this project's VM: 7.2-7.9 s before, 5.1-6.5 s after).
    """

    def __init__(self, f: BinaryIO, target: Path | None = None, durable: bool = True):
        self._f = f
        self.target = target  # the file it replaces once complete (a format may name its contents after it)
        self.durable = durable
        self._mark = 0
        self._advise = getattr(os, "posix_fadvise", None) if durable else None

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        if self._advise is None:  # (not durable; a FIFO, which has no position)
            return n
        end = self._f.tell()
        if end - self._mark >= WRITEBACK_BYTES:
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


def write_data(f: BinaryIO, chunks: Iterable[np.ndarray | bytes | memoryview | FileRange]) -> int:
    """Writes chunks as their little-endian bytes (a `FileRange`'s copied from its file); returns how many were
    written."""
    written = 0
    for chunk in chunks:
        if isinstance(chunk, FileRange):
            written += chunk.copy_to(f)
            continue
        data = memoryview(np.ascontiguousarray(chunk).view(np.uint8)) if isinstance(chunk, np.ndarray) else chunk
        f.write(data)
        written += data.nbytes
    return written
