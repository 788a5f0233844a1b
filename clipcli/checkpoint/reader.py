"""An open checkpoint: its tensors and metadata from the headers, and their bytes read in bounded chunks."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import numpy as np

from clipcli.checkpoint import engine, registry
from clipcli.checkpoint.crc import Log, ReadLog
from clipcli.checkpoint.decode import decode
from clipcli.checkpoint.engine import CHUNK_BYTES, geometry, spans
from clipcli.checkpoint.source import LocalStore, Store
from clipcli.checkpoint.tensor import Copy, Held, Pieces, Span, TensorInfo, ZipMember
from clipcli.errors import ClipcliError, FileTypeError, InputError, MalformedError, MissingFileError, UnsupportedError

if TYPE_CHECKING:
    import zipfile

R = TypeVar("R")
# called with every checkpoint `open_checkpoint` opens (the command line warns of what its pickles would call)
OPEN_HOOKS: list[Callable[[Checkpoint], None]] = []
MAX_NUMPY_DIMS = 64  # the most dimensions a NumPy array has; a tensor may have more


class Checkpoint:
    """An open checkpoint: its tensors in file order, its metadata, and chunked reads.

    Use as a context manager, or call `close()`.
    """

    def __init__(
        self,
        path: Path,
        fmt: str,
        metadata: dict[str, str],
        tensors: list[TensorInfo],
        files: list[Path],
        index: dict[str, Any] | None = None,
        index_path: Path | None = None,
        layout_keys: frozenset[str] = frozenset(),
        sharded: bool = False,
        store: Store | None = None,
        pickle_audits: tuple[Any, ...] = (),
    ):
        self.path = path
        self.index_path = index_path
        self.format = fmt
        self.metadata = metadata
        self.tensors = tensors
        self.files = files
        self.index = index
        self.layout_keys = layout_keys  # metadata keys that say how the files were written, not what they hold
        self.sharded = sharded  # a checkpoint of several files by its kind (a directory or an index)
        self.pickle_audits = pickle_audits  # what its pickles name and would call (PyTorch files), one per file
        self.store = LocalStore() if store is None else store  # its files (a local store keeps some open)
        self._zips: dict[str, tuple[zipfile.ZipFile, BinaryIO]] = {}
        self._zips_lock = threading.Lock()  # threads streaming members of one zip open its directory once
        self._crcs = ReadLog()
        self._will_read: Sequence[TensorInfo] = ()  # the tensors the reads to come take, in order (will_read)
        self._read_on: dict[tuple[str, int], int] | None = {}  # (file, a tensor's start) -> where reads go on to
        self._starts: Sequence[tuple[str, int]] = ()  # where other workers read on at the same time (will_read)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.store.close()
        for z, f in self._zips.values():
            z.close()
            f.close()
        self._zips.clear()

    def random_access(self, t: TensorInfo) -> bool:
        """Whether the tensor's bytes can be read anywhere by any worker (else only in order)."""
        loc = t.location
        return isinstance(loc, (Span, Held)) or (isinstance(loc, Pieces) and not loc.strided)

    def chunks(
        self, info: TensorInfo, max_bytes: int = CHUNK_BYTES, align: int = 1, unit: int = 1
    ) -> Iterator[np.ndarray]:
        """The tensor's values as flat arrays in storage order, each at most about `max_bytes`.

        Every chunk but the last holds a multiple of `align` elements (at least `align`), and of `unit` where
        the rows allow (`engine.geometry`). Chunks are views
        of one reused buffer: each is valid only until the next is produced. Types carried as bytes
        (`array_dtype` None) come as uint8.

        Raises:
            MalformedError: when the file turns out shorter than its header said, or its data damaged.
        """
        _, per_chunk = geometry(info, max_bytes, align, unit)
        buf = np.empty(per_chunk, dtype=np.uint8)
        if isinstance(info.location, Pieces) and info.location.strided:
            held: dict[int, np.ndarray] = {}  # the strided pieces read whole, while reads still take them
            for offset, n in spans(info.nbytes, per_chunk):
                self._gather(info, offset, buf[:n], held)
                yield decode(buf[:n], info)
            return
        if self.random_access(info):
            for offset, n in spans(info.nbytes, per_chunk):
                self.pread(info, offset, buf[:n])
                yield decode(buf[:n], info)
            return
        stream = self._open_stream(info)
        try:
            for _, n in spans(info.nbytes, per_chunk):
                _read_exactly(stream, memoryview(buf)[:n], info)
                yield decode(buf[:n], info)
        finally:
            stream.close()

    def map_chunks(
        self,
        tensors: list[TensorInfo],
        fn: Callable[[TensorInfo, int, np.ndarray], R],
        jobs: int = 1,
        max_bytes: int | None = None,
        align: dict[str, int] | None = None,
        *,
        unit: int,
    ) -> Iterator[tuple[TensorInfo, R]]:
        """`fn(tensor, offset, chunk)` for every chunk of every tensor, in order, by `jobs` threads (`engine`)."""
        return engine.map_chunks(self, tensors, fn, jobs, max_bytes, align, unit=unit)

    def pread(self, t: TensorInfo, offset: int, buf: np.ndarray) -> None:
        """Fills `buf` with the tensor's bytes from `offset` on (a tensor whose location is a Span or Pieces).

        Raises:
            MalformedError: when the file ends early, or a zip member's CRC-32 does not match once all of
                it has been read.
        """
        loc = t.location
        if isinstance(loc, Pieces):
            self._gather(t, offset, buf)
            return
        if isinstance(loc, Held):
            buf.view(np.uint8)[:] = np.frombuffer(loc.data, np.uint8, buf.nbytes, offset)
            return
        view = memoryview(buf)
        self._read_at(t.file, loc.offset + offset, view, t)
        if loc.crc is not None:
            self._crcs.check(t, offset, view)

    def _gather(self, t: TensorInfo, offset: int, buf: np.ndarray, held: dict[int, np.ndarray] | None = None) -> None:
        """Fills `buf` with the bytes of a tensor in `Pieces` from `offset` on: of each piece it touches, one
        contiguous read, scattered into place by strides (or read straight into place where it lies so).

        `held` (reads in order only): strided pieces read whole and kept, for a piece whose every read would
        take most of its bytes (a transposed view); only those this read touched stay.
        """
        loc = t.location
        item = loc.itemsize
        used = set()
        for c in loc.copies(offset // item, (offset + buf.size) // item):
            piece = loc.pieces[c.piece]
            if c.direct:
                self._read_at(
                    piece.file, piece.offset + c.at * item, memoryview(buf)[c.target * item :][: c.count * item], t
                )
                continue
            if held is not None and piece.strided and c.window > 4 * c.count:
                used.add(c.piece)
                if c.piece not in held:
                    held[c.piece] = np.empty(piece.strided[1], np.uint8)
                    self._read_at(piece.file, piece.offset, memoryview(held[c.piece]), t)
                raw = held[c.piece][c.at * item : (c.at + c.window) * item]
            else:
                raw = np.empty(c.window * item, np.uint8)
                self._read_at(piece.file, piece.offset + c.at * item, memoryview(raw), t)
            _scatter(raw, c, buf, item)
        if held is not None:
            for k in set(held) - used:
                del held[k]

    def _read_at(self, file: str, at: int, view: memoryview, t: Any) -> None:
        try:
            source = self.store.source(file)
        except OSError as e:
            raise MissingFileError(e.strerror or str(e), file) from e
        within = getattr(source, "read_within", None)  # a remote source's read-ahead, up to where reads go on
        end = None
        if within is not None and isinstance(t.location, Span):
            end = self._reads_on().get((file, t.location.offset), t.location.offset + t.nbytes)
            end = min([end, *(start for f, start in self._starts if f == file and at < start)])
        got = 0
        try:
            while got < len(view):
                k = source.read_into(at + got, view[got:]) if end is None else within(at + got, view[got:], end)
                if not k:
                    raise MalformedError("the file ends before the tensor's data does", file, t.name)
                got += k
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror or e}", file, t.name) from e
        finally:
            self.store.release(source)

    def will_read(self, tensors: Sequence[TensorInfo], starts: Sequence[tuple[str, int]] = ()) -> None:
        """Says whose bytes the reads to come take, in this order (`()`: nothing said). A source that reads ahead
        (a remote one: `read_within`) then reads on across the tensors that follow one another in a file, up to
        the next of `starts` (file, byte), where other workers read on at the same time (`engine.in_parts`)."""
        self._will_read, self._read_on = tensors, None  # worked out when a source that reads ahead asks
        self._starts = starts

    def _reads_on(self) -> dict[tuple[str, int], int]:
        """(file, a tensor's start) -> where the reads in order go on to, from the tensors of `will_read`: the end
        of the run of tensors lying one after another that it starts."""
        read_on = self._read_on
        if read_on is None:  # (threads may both work it out: the same dict)
            read_on = {}
            run: list[tuple[str, int]] = []  # the starts of tensors lying one after another, in order
            end = -1
            for t in [*self._will_read, None]:
                span = t is not None and isinstance(t.location, Span)
                if not (span and run and t.file == run[-1][0] and t.location.offset == end):
                    read_on.update(dict.fromkeys(run, end))
                    run = []
                if span:
                    run.append((t.file, t.location.offset))
                    end = t.location.offset + t.nbytes
            self._read_on = read_on
        return read_on

    def check(self, t: TensorInfo, data: np.ndarray) -> None:
        """Checks a tensor's bytes read whole in a larger read: a stored zip member's CRC-32.

        Raises:
            MalformedError: when they do not match.
        """
        if isinstance(t.location, Span) and t.location.crc is not None:
            self._crcs.check(t, 0, memoryview(data))

    def take_read_log(self) -> Log:
        """The CRC-32s of parts read and not yet checked (a worker process hands them to its parent)."""
        return self._crcs.take()

    def add_read_log(self, log: Log) -> None:
        """Adds the CRC-32s of parts read (here or by a worker), checking each member read whole.

        Raises:
            MalformedError: when a member's bytes do not match the CRC-32 its zip directory records.
        """
        self._crcs.add(log)

    def forget_handles(self) -> None:
        """In a forked worker: opens its own streams (their file positions are not to be shared), and lets the
        store reopen what it cannot share."""
        self._zips = {}
        self._zips_lock = threading.Lock()
        self._crcs = ReadLog()
        self.store.forked()

    def read(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor as an array of its shape in C order (for small tensors and tests).

        Raises:
            UnsupportedError: for a tensor of more than 64 dimensions, which NumPy cannot hold (`read_flat` can).
        """
        flat = self.read_flat(info)
        if info.array_dtype is None:
            return flat
        if len(info.shape) > MAX_NUMPY_DIMS:
            raise UnsupportedError(
                f"{len(info.shape)} dimensions, more than a NumPy array holds ({MAX_NUMPY_DIMS})", info.file, info.name
            )
        return flat.reshape(info.shape)

    def read_flat(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor's values, one after another in C order (types carried as bytes: their bytes)."""
        dtype = info.array_dtype if info.array_dtype is not None else np.dtype(np.uint8)
        flat = np.concatenate([c.copy() for c in self.chunks(info)] or [np.empty(0, dtype)])
        return flat if info.array_dtype is None or not info.fortran_order else c_order(flat, info.shape)

    def _open_stream(self, info: TensorInfo) -> BinaryIO:
        import zipfile  # here: only a compressed member is streamed

        from clipcli.checkpoint import zipmember

        loc = info.location
        assert isinstance(loc, ZipMember)
        path = Path(info.file)
        with self._zips_lock:
            if info.file not in self._zips:
                f = self.store.open(path)
                try:
                    self._zips[info.file] = (zipfile.ZipFile(f), f)
                except BaseException:
                    f.close()
                    raise
            z, _ = self._zips[info.file]
        try:
            return zipmember.open_member(self.store, path, z, loc)
        except zipmember.DATA_ERRORS as e:
            raise MalformedError(f"corrupt zip member ({_one_line(e)})", info.file, info.name) from e


def _scatter(raw: np.ndarray, c: Copy, buf: np.ndarray, item: int) -> None:
    """Puts a copy's elements from the window of bytes read (`raw`) into the read's buffer, by strides."""
    cell = np.dtype((np.void, item))
    source = np.lib.stride_tricks.as_strided(raw.view(cell), c.sizes, [s * item for s in c.source])
    target = buf[c.target * item :].view(cell)
    np.copyto(np.lib.stride_tricks.as_strided(target, c.sizes, [s * item for s in c.target_strides]), source)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def _read_exactly(stream: BinaryIO, view: memoryview, info: TensorInfo) -> None:
    from clipcli.checkpoint.zipmember import DATA_ERRORS

    got = 0
    try:
        while got < len(view):
            n = stream.readinto(view[got:])
            if not n:
                raise MalformedError("the file ends before the tensor's data does", info.file, info.name)
            got += n
    except DATA_ERRORS as e:
        raise MalformedError(f"corrupt zip member ({_one_line(e)})", info.file, info.name) from e
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", info.file, info.name) from e


def open_checkpoint(path: str | os.PathLike[str], store: Store | None = None) -> Checkpoint:
    """Opens a checkpoint (a file, a sharded index or a directory), reading headers only.

    The suffix names the format; a file whose name has none that clipcli knows is read as what its first
    bytes show it is. `store` is where its files are read from (by default the file system, or for a URL given
    as text, `https://...`, `hf://...`, `s3://...`, the remote store of its protocol).

    Raises:
        MissingFileError, FileTypeError, MalformedError, UnsupportedError: as the input deserves.
    """
    remote = remote_store(path, store)
    if remote is not None:
        store, where = remote
        try:
            return open_checkpoint(where, store)
        except BaseException:
            store.close()
            raise
    return at_path(path, store, _opened)


def _opened(path: Path, store: Store) -> Checkpoint:
    """The checkpoint at a path known to exist, checked, and shown to every `OPEN_HOOKS` function."""
    ckpt = _checked_text(_open(path, store))
    try:
        for hook in OPEN_HOOKS:
            hook(ckpt)
    except BaseException:
        ckpt.close()
        raise
    return ckpt


def remote_store(path: str | os.PathLike[str], store: Store | None) -> tuple[Store, Path] | None:
    """For a URL given as text (`https://...`, `hf://...`, `s3://...`) and no store: the remote store of its
    protocol and the path in it (the caller closes the store); None for anything else.

    Raises:
        UsageError: for a protocol no installed package reads.
    """
    if store is None and isinstance(path, str) and "://" in path:
        from clipcli.checkpoint.remote import is_url, open_store

        if is_url(path):
            return open_store(path)
    return None


def at_path(path: str | os.PathLike[str], store: Store | None, action: Callable[[Path, Store], R]) -> R:
    """`action(path, store)` once the path is known to exist and be a file or directory, its errors naming
    the path (an OSError as the system names it: the shard or the directory without permission).

    Raises:
        MissingFileError, FileTypeError, InputError: for a path that is missing, `-` or not a regular file;
            what `action` raises.
    """
    path = Path(path)
    if os.fspath(path) == "-":
        raise FileTypeError("clipcli reads checkpoints from files, not from standard input; save it to a file", path)
    store = LocalStore() if store is None else store
    typed = getattr(store, "typed", None)  # a URL as typed: `.../ckpt/` keeps its `/` in messages
    named = typed if typed is not None and Path(typed) == path else path
    try:
        unlisted = not getattr(store, "lists", True) and registry.named_by(path.name) is None  # a directory?
        path, kind = _unlisted(path, store) if unlisted else (path, store.kind(path))
        if kind is None:
            if not unlisted:
                raise MissingFileError("no such file or directory", path)
            markers = ", ".join(registry.directory_markers())
            raise MissingFileError(
                f"no such file, and no directory holding {markers}: plain HTTP cannot list a directory; name a "
                "file, a sharded index, or a directory holding one of those",
                named,
            )
        if kind == "other":
            raise FileTypeError(
                "not a regular file (a pipe or a device?): clipcli reads checkpoints in place; save it to a file first",
                path,
            )
        return action(path, store)
    except ClipcliError as e:
        if e.path is None or (e.path == str(path) and path == Path(named)):
            e.path = str(named)
        raise
    except OSError as e:  # the file it is about: the one the system or the server (a URL's `url`) refused
        raise InputError(f"cannot read: {e.strerror or e}", e.filename or getattr(e, "url", None) or named) from e


def _unlisted(path: Path, store: Store) -> tuple[Path, str | None]:
    """What to read for a path with no suffix clipcli knows in a store that cannot list (plain HTTP), and its
    kind: the path when it answers with a checkpoint, else the directory a marker shows (`_marked_directory`),
    else the path as it is. A web server answers a directory's URL with 404, 403, a redirect to the same path
    with a `/` (then 403), or an HTML listing (which may ignore `Range`): none of those is a checkpoint.

    Raises:
        OSError: the path's own error (a 403, Range ignored) where no marked directory is there either.
    """
    try:
        kind = store.kind(path)
        if kind is not None and (kind != "file" or registry.file_format(path, store) is not None):
            return path, kind
    except FileNotFoundError:
        kind = None
    except OSError:
        marked = _marked_directory(path, store)
        if marked[1] is None:
            raise
        return marked
    marked = _marked_directory(path, store)
    return (path, kind) if marked[1] is None else marked


def _marked_directory(path: Path, store: Store) -> tuple[Path, str | None]:
    """What to read for a path that a store which cannot list (plain HTTP) shows only by a file its format names
    in it (`Format.markers`), and its kind: the directory of a distributed checkpoint's `.metadata` (whose pickle
    names every other file), or a sharded checkpoint's index itself; (path, None) where none is there."""
    for name in registry.directory_markers():
        marker = path / name
        if store.kind(marker) == "file":
            if registry.named_by(name) is not None:  # a file its format reads named alone: the index
                return marker, "file"
            store.known_directory(path)  # type: ignore[attr-defined]
            return path, "directory"
    return path, None


def _open(path: Path, store: Store) -> Checkpoint:
    """`open_checkpoint` of an existing path, by the format the registry finds for it."""
    opened = registry.open_path(path, store)
    files = [path] if opened.files is None else opened.files
    fmt = opened.format or ""
    return Checkpoint(
        path, fmt, opened.metadata, opened.tensors, files, opened.index, opened.index_path, opened.layout_keys,
        opened.sharded, store, opened.audits,
    )  # fmt: skip


def _checked_text(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint, once its names and metadata are text that UTF-8 can hold.

    JSON escapes (`\\ud800`) and pickles can hold a lone surrogate, which no report or output could write;
    the reference safetensors reader refuses such a header.

    Raises:
        MalformedError: naming the tensor or metadata key.
    """
    for t in ckpt.tensors:
        if not t.name.isascii() and not _is_text(t.name):
            raise MalformedError("the tensor's name holds a lone surrogate, which is not text", ckpt.path, t.name)
    for key, value in ckpt.metadata.items():
        for text in (key, value):
            if isinstance(text, str) and not text.isascii() and not _is_text(text):
                raise MalformedError(f"metadata {key!r} holds a lone surrogate, which is not text", ckpt.path)
    return ckpt


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def c_order(flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The values of a tensor of `shape` stored in Fortran order, in C order.

    Dimensions of one element change neither order: they are dropped first, as NumPy holds at most 64
    dimensions and a tensor may have more (never 64 of more than one element: 2**64 values).
    """
    if flat.size == 0:
        return flat
    return flat.reshape([n for n in shape if n != 1], order="F").ravel(order="C")
