"""Where bytes come from: a `Source` is one file's bytes by ranged reads, a `Store` finds and lists files.

Formats read only through these: `Store.open` (a file object, for headers and zipfile), `Store.source` (ranged
reads into a buffer, for tensors' data), `Store.kind` and `Store.list` (siblings: shards, a distributed
checkpoint's files). The local store is the file system; `MemoryStore` holds files in memory (tests; the shape
of a remote store: one ranged read, fsspec's `cat_file(path, start, end)`, is all a source needs).
"""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)  # what pathlib takes for "does not exist"
_MAX_OPEN = 16  # files a store holds open to read at once (macOS allows a process 256; a diff reads two)


class Source(Protocol):
    """One file's bytes: its size, and ranged reads into a buffer (short only at its end)."""

    name: str  # for messages

    def size(self) -> int: ...

    def read_into(self, offset: int, view: memoryview) -> int: ...


class Store(Protocol):
    """The files a checkpoint is in: opened as file objects or sources, looked at, listed.

    Every method raises OSError as the file system would (FileNotFoundError for a missing file). A source is
    held from `source` to `release`; `forked` is called in a forked worker (to reopen what cannot be shared).
    """

    def open(self, path: Path) -> BinaryIO: ...

    def source(self, path: Path | str) -> Source: ...

    def kind(self, path: Path) -> str | None: ...

    def size(self, path: Path) -> int: ...

    def list(self, directory: Path) -> list[Path]: ...

    def real(self, path: Path) -> Path: ...

    def release(self, source: Source) -> None: ...

    def forked(self) -> None: ...

    def close(self) -> None: ...


class FileSource:
    """A local file read with `preadv` on a descriptor of its own (shared by threads and forked workers)."""

    def __init__(self, path: str):
        self.name = path
        self._f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        self._fd = self._f.fileno()
        self.users = 0  # reads using it now (the store closes only an idle one)

    def size(self) -> int:
        return os.fstat(self._f.fileno()).st_size

    def fileno(self) -> int:
        return self._fd

    def read_into(self, offset: int, view: memoryview) -> int:
        return os.preadv(self._fd, [view], offset)

    def close(self) -> None:
        self._f.close()


class LocalStore:
    """The file system. Sources stay open for later reads, at most _MAX_OPEN at once: the least recently used
    that no read is using are closed first, so a checkpoint of hundreds of shards (or two in a diff) stays
    within `ulimit -n`."""

    def __init__(self) -> None:
        self._sources: dict[str, FileSource] = {}  # oldest first
        self._lock = threading.Lock()

    def open(self, path: Path) -> BinaryIO:
        return open(path, "rb")

    def source(self, path: Path | str) -> FileSource:
        """The file's source, counted as in use until `release`."""
        key = os.fspath(path)
        with self._lock:
            source = self._sources.pop(key, None)  # put back last: the most recently used
            if source is None:
                if len(self._sources) >= _MAX_OPEN:
                    for name, old in list(self._sources.items()):
                        if not old.users and len(self._sources) >= _MAX_OPEN // 2:
                            old.close()
                            del self._sources[name]
                source = FileSource(key)
            source.users += 1
            self._sources[key] = source
            return source

    def release(self, source: Source) -> None:
        with self._lock:
            source.users -= 1  # type: ignore[attr-defined]

    def forked(self) -> None:
        """In a forked worker: a lock of its own (a thread of the parent may have held this one at the fork).
        The descriptors stay shared: `preadv` reads at an offset and moves no file position."""
        self._lock = threading.Lock()

    def kind(self, path: Path) -> str | None:
        """'file', 'directory', 'other' (a pipe, a device) or None (missing), links followed, as pathlib says."""
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            if e.errno in _MISSING:
                return None
            raise
        except ValueError:  # a path that no file can have (a NUL byte): pathlib's answer
            return None
        return "file" if stat.S_ISREG(mode) else "directory" if stat.S_ISDIR(mode) else "other"

    def size(self, path: Path) -> int:
        return os.stat(path).st_size

    def list(self, directory: Path) -> list[Path]:
        return list(Path(directory).iterdir())

    def real(self, path: Path) -> Path:
        return Path(path).resolve()

    def close(self) -> None:
        for source in self._sources.values():
            source.close()
        self._sources.clear()


LOCAL = LocalStore()  # headers read from local files (its sources are not used: each checkpoint has a store)


class MemorySource:
    """Bytes in memory as a source."""

    def __init__(self, name: str, data: bytes):
        self.name = name
        self._data = memoryview(data)

    def size(self) -> int:
        return len(self._data)

    def read_into(self, offset: int, view: memoryview) -> int:
        part = self._data[offset : offset + len(view)]
        view[: len(part)] = part
        return len(part)


class MemoryStore:
    """Files in memory, by path: a directory is any path that files lie below. `sources` may make a file's source
    (a test's failing one); by default its bytes are read from memory."""

    def __init__(self, files: dict[Path, bytes], sources: Any = None):
        self.files = {Path(p): data for p, data in files.items()}
        self._make = sources or MemorySource

    @classmethod
    def copy_of(cls, paths: Iterable[Path], sources: Any = None) -> MemoryStore:
        """The files at `paths` (and every file below a directory among them), read into memory."""
        files: dict[Path, bytes] = {}
        for path in paths:
            for p in [path] if Path(path).is_file() else sorted(Path(path).rglob("*")):
                if p.is_file():
                    files[Path(p)] = p.read_bytes()
        return cls(files, sources)

    def open(self, path: Path) -> BinaryIO:
        return io.BufferedReader(SourceFile(self.source(path)))  # type: ignore[return-value]

    def source(self, path: Path | str) -> Source:
        data = self.files.get(Path(path))
        if data is None:
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        return self._make(os.fspath(path), data)

    def release(self, source: Source) -> None:
        pass

    def forked(self) -> None:
        pass

    def size(self, path: Path) -> int:
        return self.source(path).size()

    def kind(self, path: Path) -> str | None:
        path = Path(path)
        if path in self.files:
            return "file"
        return "directory" if any(path in p.parents for p in self.files) else None

    def list(self, directory: Path) -> list[Path]:
        directory = Path(directory)
        below = {directory / p.relative_to(directory).parts[0] for p in self.files if directory in p.parents}
        return sorted(below)

    def real(self, path: Path) -> Path:
        return Path(path)

    def close(self) -> None:
        pass


class SourceFile(io.RawIOBase):
    """A source as a read-only file object (for zipfile and headers read in sequence)."""

    def __init__(self, source: Source):
        super().__init__()
        self.source = source
        self.name = source.name
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.source.size()}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = self.source.read_into(self._pos, view) if len(view) else 0
        self._pos += n
        return n


def size_of(f: BinaryIO) -> int:
    """The size of the file behind a file object that a store opened."""
    raw = getattr(f, "raw", f)
    if isinstance(raw, SourceFile):
        return raw.source.size()
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, io.UnsupportedOperation):  # a file object of a store's own (io.BytesIO): seekable
        here = f.tell()
        try:
            return f.seek(0, os.SEEK_END)
        finally:
            f.seek(here)


def pread_of(f: BinaryIO) -> Any:
    """`pread(offset, n) -> bytes` of a file object a store opened, its position left alone."""
    raw = getattr(f, "raw", f)
    if isinstance(raw, SourceFile):
        source = raw.source

        def pread(offset: int, n: int) -> bytes:
            buf = bytearray(n)
            got = source.read_into(offset, memoryview(buf))
            return bytes(buf[:got])

        return pread
    try:
        fd = f.fileno()
    except (AttributeError, io.UnsupportedOperation):  # a file object of a store's own: seek and read

        def seek_and_read(offset: int, n: int) -> bytes:
            here = f.tell()
            try:
                f.seek(offset)
                return f.read(n)
            finally:
                f.seek(here)

        return seek_and_read
    return lambda offset, n: os.pread(fd, n, offset)


def read_head(store: Store, path: Path, n: int) -> bytes:
    """The first `n` bytes of a file (fewer if it is shorter)."""
    with store.open(path) as f:
        return f.read(n)
