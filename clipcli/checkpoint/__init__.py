"""Checkpoints on disk: list tensors from headers, read them in bounded chunks, write them atomically.

Each format is one module (`_safetensors`, `_sharded`, `_npz`, `_npy`, `_torch`, `_dcp`) that opens a file
into tensors with locations and writes tensors from chunks; this module knows no format beyond the
registry below.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
import shlex
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, TypeVar

import numpy as np

from clipcli.checkpoint import _engine, _npy, _npz, _safetensors, _sharded
from clipcli.checkpoint._engine import CHUNK_BYTES, as_values, geometry, spans
from clipcli.checkpoint._files import (
    Copy,
    Pieces,
    Span,
    ZipMember,
    atomic_write,
    crc32_of_parts,
    file_format,
    read_head,
    resolve_target,
    sniff,
)
from clipcli.checkpoint._npz import MAX_LZMA_DICTIONARY
from clipcli.errors import (
    ClipcliError,
    FileTypeError,
    InputError,
    MalformedError,
    MissingFileError,
    UnsupportedError,
    UsageError,
    WriteError,
)

__all__ = [
    "CHUNK_BYTES",
    "MAX_LZMA_DICTIONARY",
    "MAX_NUMPY_DIMS",
    "Checkpoint",
    "TensorInfo",
    "byte_layout",
    "check_output",
    "check_plan",
    "check_report",
    "open_checkpoint",
    "output_kind",
    "placed",
    "plan",
    "save",
]

R = TypeVar("R")
INDEX_SUFFIX = _sharded.INDEX_SUFFIX

# The file formats: how each is opened and written. A format is a module and a line here: the module
# and the suffixes that name it. Modules are imported when a file needs them (PyTorch's reader and its
# unpickler would be a tenth of the start-up of every other command).
_FILE_FORMATS = {
    "safetensors": ("_safetensors", (".safetensors",)),
    "npz": ("_npz", (".npz",)),
    "npy": ("_npy", (".npy",)),
    "torch": ("_torch", (".pt", ".pth", ".bin", ".ckpt")),
}
_WRITABLE = ("safetensors", "npz", "npy")
MAX_NUMPY_DIMS = 64  # the most dimensions a NumPy array has; a tensor may have more
_MAX_OPEN = 16  # files a checkpoint holds open to read at once (macOS allows a process 256; a diff reads two)
_MAX_OPEN_OUTPUT = 64  # output files written at once by workers; more are written one after another


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
    compression: int = field(default=zipfile.ZIP_STORED, repr=False, compare=False)
    prefix: bytes = field(default=b"", repr=False, compare=False)
    skip: str | None = field(default=None, compare=False)  # why it is listed but has no values to read
    storage: str | None = field(default=None, repr=False, compare=False)  # a storage it shares with others

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def byte_layout(t: TensorInfo) -> tuple[str, bool]:
    """How a type carried as bytes lies: its stored type (byte order included; "" where it has no .npy header)
    and whether in Fortran order (where the shape makes the orders differ). Two such tensors of one type whose
    layouts agree hold the same values exactly when they hold the same bytes."""
    dtype = _npy.read_npy_header(io.BytesIO(t.prefix)).dtype if t.prefix else None
    descr = "" if dtype is None else repr(dtype.descr)  # fields' names, order and byte orders too
    return descr, t.fortran_order and sum(n > 1 for n in t.shape) > 1


def numpy_tensor(name: str, header: _npy.NpyHeader, path: Path, location: Any, compression: int = 0) -> TensorInfo:
    """A tensor from a .npy header: numeric types in native byte order, others carried as bytes."""
    if not header.numeric:
        return TensorInfo(
            name, _npy.type_name(header.dtype), header.shape, header.nbytes, str(path), None,
            header.fortran_order, location, None, compression, header.raw,
        )  # fmt: skip
    native = header.dtype.newbyteorder("=")
    stored = None if header.dtype.isnative else header.dtype
    return TensorInfo(
        name, native.name, header.shape, header.nbytes, str(path), native, header.fortran_order, location, stored,
        compression,
    )  # fmt: skip


def output_kind(path: Path) -> str:
    """The format a path names: 'safetensors', 'npz', 'npy', 'torch', 'index', 'torch-index' or 'directory'."""
    name = path.name
    if name.endswith(INDEX_SUFFIX):
        return "index"
    if name.endswith(_sharded.TORCH_INDEX_SUFFIXES):
        return "torch-index"
    for kind, (_, suffixes) in _FILE_FORMATS.items():
        if name.endswith(suffixes):
            return kind
    return "directory"


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
    ):
        self.path = path
        self.index_path = index_path
        self.format = fmt
        self.metadata = metadata
        self.tensors = tensors
        self.files = files
        self.index = index
        self._handles: dict[str, list[Any]] = {}  # file -> [its handle, the reads using it now]; oldest first
        self._zips: dict[str, zipfile.ZipFile] = {}
        self._crcs: dict[str, tuple[TensorInfo, dict[int, tuple[int, int]]]] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f, _ in self._handles.values():
            f.close()
        for z in self._zips.values():
            z.close()
        self._handles.clear()
        self._zips.clear()

    def random_access(self, t: TensorInfo) -> bool:
        """Whether the tensor's bytes can be read anywhere by any worker (else only in order)."""
        return isinstance(t.location, Span) or (isinstance(t.location, Pieces) and not t.location.strided)

    def chunks(self, info: TensorInfo, max_bytes: int = CHUNK_BYTES, align: int = 1) -> Iterator[np.ndarray]:
        """The tensor's values as flat arrays in storage order, each at most about `max_bytes`.

        Every chunk but the last holds a multiple of `align` elements (at least `align`). Chunks are views
        of one reused buffer: each is valid only until the next is produced. Types carried as bytes
        (`array_dtype` None) come as uint8.

        Raises:
            MalformedError: when the file turns out shorter than its header said, or its data damaged.
        """
        dtype, per_chunk = geometry(info, max_bytes, align)
        buf = np.empty(per_chunk, dtype=np.uint8)
        if isinstance(info.location, Pieces) and info.location.strided:
            held: dict[int, np.ndarray] = {}  # the strided pieces read whole, while reads still take them
            for offset, n in spans(info.nbytes, per_chunk):
                self._gather(info, offset, buf[:n], held)
                yield as_values(buf[:n], dtype)
            return
        if self.random_access(info):
            for offset, n in spans(info.nbytes, per_chunk):
                self.pread(info, offset, buf[:n])
                yield as_values(buf[:n], dtype)
            return
        stream = self._open_stream(info)
        try:
            for _, n in spans(info.nbytes, per_chunk):
                _read_exactly(stream, memoryview(buf)[:n], info)
                yield as_values(buf[:n], dtype)
        finally:
            stream.close()

    def map_chunks(
        self,
        tensors: list[TensorInfo],
        fn: Callable[[TensorInfo, int, np.ndarray], R],
        jobs: int = 1,
        max_bytes: int | None = None,
        align: dict[str, int] | None = None,
    ) -> Iterator[tuple[TensorInfo, R]]:
        """`fn(tensor, offset, chunk)` for every chunk of every tensor, in order, by `jobs` threads (_engine)."""
        return _engine.map_chunks(self, tensors, fn, jobs, max_bytes, align)

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
        view = memoryview(buf)
        self._read_at(t.file, loc.offset + offset, view, t)
        if loc.crc is not None:
            self._check_crc(t, offset, view)

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
        fd = self._acquire(file)
        got = 0
        try:
            while got < len(view):
                k = os.preadv(fd, [view[got:]], at + got)
                if not k:
                    raise MalformedError("the file ends before the tensor's data does", file, t.name)
                got += k
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror or e}", file, t.name) from e
        finally:
            with self._lock:
                self._handles[file][1] -= 1

    def check(self, t: TensorInfo, data: np.ndarray) -> None:
        """Checks a tensor's bytes read whole in a larger read: a stored zip member's CRC-32.

        Raises:
            MalformedError: when they do not match.
        """
        if isinstance(t.location, Span) and t.location.crc is not None:
            self._check_crc(t, 0, memoryview(data))

    def _check_crc(self, t: TensorInfo, offset: int, data: memoryview) -> None:
        """Logs the CRC-32 of a part read; once every byte of the member has been read, checks the whole."""
        crc = t.location.crc
        if offset == 0 and len(data) == t.nbytes:  # read whole: the member's CRC follows on from its header's
            if zlib.crc32(data, crc.head) != crc.expected:
                raise MalformedError(f"Bad CRC-32 for file {t.name + '.npy'!r} (the member is damaged)", t.file, t.name)
            return
        self.add_read_log({f"{t.file}\0{t.name}": (t, {offset: (zlib.crc32(data), len(data))})})

    def take_read_log(self) -> dict[str, tuple[TensorInfo, dict[int, tuple[int, int]]]]:
        """The CRC-32s of parts read and not yet checked (a worker process hands them to its parent)."""
        with self._lock:
            log, self._crcs = self._crcs, {}
        return log

    def add_read_log(self, log: dict[str, tuple[TensorInfo, dict[int, tuple[int, int]]]]) -> None:
        """Adds the CRC-32s of parts read (here or by a worker), checking each member read whole.

        Raises:
            MalformedError: when a member's bytes do not match the CRC-32 its zip directory records.
        """
        for key, (t, parts) in log.items():
            with self._lock:
                seen = self._crcs.setdefault(key, (t, {}))[1]
                seen.update(parts)
                if sum(n for _, n in seen.values()) < t.nbytes:
                    continue
                del self._crcs[key]
            crc = t.location.crc
            whole = crc32_of_parts([(crc.head, crc.head_length), *(seen[k] for k in sorted(seen))])
            if whole != crc.expected:
                raise MalformedError(f"Bad CRC-32 for file {t.name + '.npy'!r} (the member is damaged)", t.file, t.name)

    def forget_handles(self) -> None:
        """In a forked worker: opens its own streams (their file positions are not to be shared)."""
        self._zips = {}
        self._crcs = {}

    def _acquire(self, file: str) -> int:
        """The descriptor of an open file, counted as in use until the read releases it (`_read_at`).

        At most `_MAX_OPEN` files stay open: the least recently used that no read is using are closed
        first, so a checkpoint of hundreds of shards (or two in a diff) stays within `ulimit -n`.
        """
        with self._lock:
            entry = self._handles.pop(file, None)  # put back last: the most recently used
            if entry is None:
                if len(self._handles) >= _MAX_OPEN:
                    for name, (f, users) in list(self._handles.items()):
                        if not users and len(self._handles) >= _MAX_OPEN // 2:
                            f.close()
                            del self._handles[name]
                try:
                    entry = [open(file, "rb", buffering=0), 0]  # noqa: SIM115 (closed here or in close())
                except OSError as e:
                    raise MissingFileError(e.strerror or str(e), file) from e
            entry[1] += 1
            self._handles[file] = entry
            return entry[0].fileno()

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
        loc = info.location
        assert isinstance(loc, ZipMember)
        z = self._zips.get(info.file)
        if z is None:
            z = self._zips[info.file] = zipfile.ZipFile(info.file)
        try:
            return _npz.open_member(z, loc)
        except _npz.DATA_ERRORS as e:
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
    got = 0
    try:
        while got < len(view):
            n = stream.readinto(view[got:])
            if not n:
                raise MalformedError("the file ends before the tensor's data does", info.file, info.name)
            got += n
    except _npz.DATA_ERRORS as e:
        raise MalformedError(f"corrupt zip member ({_one_line(e)})", info.file, info.name) from e
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", info.file, info.name) from e


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Opens a checkpoint (a file, a sharded index or a directory), reading headers only.

    The suffix names the format; a file whose name has none that clipcli knows is read as what its first
    bytes show it is.

    Raises:
        MissingFileError, FileTypeError, MalformedError, UnsupportedError: as the input deserves.
    """
    path = Path(path)
    if os.fspath(path) == "-":
        raise FileTypeError("clipcli reads checkpoints from files, not from standard input; save it to a file", path)
    try:
        if not path.exists():
            raise MissingFileError("no such file or directory", path)
        if not (path.is_dir() or path.is_file()):
            raise FileTypeError(
                "not a regular file (a pipe or a device?): clipcli reads checkpoints in place; save it to a file first",
                path,
            )
        return _checked_text(_open(path))
    except ClipcliError as e:
        if e.path is None:
            e.path = str(path)
        raise
    except OSError as e:  # named as the system names it: the shard or the directory without permission
        raise InputError(f"cannot read: {e.strerror or e}", e.filename or path) from e


def _open(path: Path) -> Checkpoint:
    """`open_checkpoint` of an existing path, by its kind: a directory, an index, a file of a format."""
    if path.is_dir() and _dcp_module().is_dcp(path):
        metadata, tensors = _dcp_module().open_directory(path)
        return Checkpoint(path, "distcp", metadata, tensors, sorted({Path(t.file) for t in tensors}))
    if path.is_dir():
        # a safetensors index first (Hugging Face repositories often hold both kinds of the same weights),
        # then PyTorch shards' index, then loose .safetensors shards; never loose files over an index
        index = _sharded.find_index(path) or _sharded.find_index(path, _sharded.TORCH_INDEX_SUFFIXES)
        if index is not None and index.name.endswith(_sharded.TORCH_INDEX_SUFFIXES):
            loose = sorted(p.name for p in path.glob("*.safetensors"))
            if loose:
                raise InputError(
                    f"the directory holds {index.name} and {len(loose)} .safetensors file(s) without an index "
                    f"({', '.join(loose[:3])}{', ...' if len(loose) > 3 else ''}); name the index or a file",
                    path,
                )
        if index is None:
            metadata, tensors, files = _sharded.open_directory(path)
            return Checkpoint(path, "sharded", metadata, tensors, files)
        ckpt = _open(index)
        ckpt.path = path
        return ckpt
    kind = output_kind(path)
    if kind in ("index", "torch-index"):
        torch = kind == "torch-index"
        opener = _format("torch").open_file if torch else _safetensors.open_file
        metadata, tensors, files, index = _sharded.open_index(path, opener)
        return Checkpoint(path, "sharded-torch" if torch else "sharded", metadata, tensors, files, index, path)
    if kind == "directory":  # no suffix clipcli knows: the first bytes tell
        kind = file_format(path) or ""
        if kind not in _FILE_FORMATS:
            raise FileTypeError(
                "unknown checkpoint suffix (expected .safetensors, .safetensors.index.json, .npz, .npy, .pt, "
                f".pth, .bin, .ckpt or pytorch_model.bin.index.json, or a directory); the file is "
                f"{sniff(read_head(path))}",
                path,
            )
    metadata, tensors = _format(kind).open_file(path)
    return Checkpoint(path, kind, metadata, tensors, [path])


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


def _format(kind: str) -> Any:
    """The module of a file format."""
    return importlib.import_module(f"clipcli.checkpoint.{_FILE_FORMATS[kind][0]}")


def _dcp_module() -> Any:
    """The module of PyTorch's distributed checkpoints (a directory)."""
    from clipcli.checkpoint import _dcp

    return _dcp


def check_output(
    text: str | os.PathLike[str],
    source: Checkpoint,
    resharding: bool = False,
    command: str = "clip",
    param: str = "-o",
) -> Path:
    """The output path `-o` (or, in place, the input's own) names for `source`, refused before any work.

    A file output names its format by its suffix; a directory output (for a sharded source, or when
    `resharding`) is an existing directory, a path ending in a slash, or a name without a suffix.

    Raises:
        UsageError: for '-', an unknown suffix, a PyTorch file, PyTorch shards or a distributed checkpoint
            (never written), an existing file that is no checkpoint file, or a directory output for a
            source that is not sharded safetensors.
    """
    raw = os.fspath(text)
    out = Path(raw)
    hint = (
        "give -o OUT.safetensors (or .npz) instead"
        if param == "--in-place"
        else "name a .safetensors, .npz or .npy file"
    )
    if raw == "-":
        raise UsageError(f"clipcli writes files, not standard output; {hint}", raw, param)
    if not raw:  # Path("") is the current directory, which a sharded output would fill
        raise UsageError(f"an empty path names no file; {hint}", None, param)
    kind = output_kind(out)
    if kind not in (*_WRITABLE, "index", "directory") or (
        out == source.path and (source.format == "distcp" or (source.format == "sharded-torch" and not resharding))
    ):
        raise UsageError(f"clipcli reads PyTorch files but does not write them; {hint}", raw, param)
    if kind in ("index", "directory") and source.format == "sharded-torch" and not resharding:
        shards = "clipcli convert --max-shard-size writes them as .safetensors shards"
        raise UsageError(f"clipcli reads PyTorch shards but does not write them; {hint} ({shards})", raw, param)
    if kind == "directory" and not (out == source.path and source.format == "sharded"):
        if out.suffix and not raw.endswith(("/", os.sep)) and not out.is_dir():
            raise UsageError(
                f"unknown output format {out.suffix!r}; {hint} (or a directory for a sharded input)", raw, param
            )
        if out.exists() and not out.is_dir():
            raise UsageError(f"exists and is not a directory; {hint}", raw, param)
        if source.format != "sharded" and not resharding:
            more = " (or --max-shard-size)" if command == "convert" else ""
            raise UsageError(f"a directory output needs a sharded input{more}; {hint}", raw, param)
    return out


def check_report(text: str | os.PathLike[str], source: Checkpoint, output: Path | None) -> Path:
    """The path --report names, refused before any work when it is an input or the output, or cannot be written.

    Raises:
        WriteError: when writing the report there would replace a checkpoint, or its directory is missing or
            not writable.
    """
    with _unreachable_as_write_error(text):
        return _checked_report(text, source, output)


def _checked_report(text: str | os.PathLike[str], source: Checkpoint, output: Path | None) -> Path:
    report = resolve_target(Path(text))
    taken = {resolve_target(f) for f in [*source.files, source.path, source.index_path] if f is not None}
    if output is not None:
        taken.add(resolve_target(output))
    if report in taken or (output is not None and report.parent == resolve_target(output) and output.is_dir()):
        raise WriteError("refusing to write the report over a checkpoint; name another file", text)
    # Found now, not after the checkpoint is written: a report that cannot be written fails the command.
    if report.is_dir():
        raise WriteError("is a directory", text)
    if not report.parent.is_dir():
        raise WriteError(f"cannot write the report: no directory {report.parent}", text)
    if not os.access(report.parent, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write the report: {report.parent} is not writable", text)
    return Path(text)


ChunkSource = Callable[[TensorInfo], Iterable[np.ndarray]]


def save(
    source: Checkpoint,
    out: str | os.PathLike[str],
    chunks: ChunkSource,
    in_place: bool | None = False,
    tensors: list[TensorInfo] | None = None,
    max_shard: int | None = None,
) -> list[Path]:
    """Writes the tensors of `source` (or those given), as `chunks(info)` produces them, to `out`, in order.

    The format follows `out`'s suffix (see `plan`). Each file is written atomically, an index last.
    Returns the files written.

    Raises:
        UsageError: for a directory output of a source that is not sharded, without `max_shard`.
        UnsupportedError: for a conversion that would lose information (checked before writing anything).
        WriteError: when a file cannot be written, or would overwrite an input without `in_place`.
    """
    layout = check_plan(source, out, in_place, tensors, max_shard)
    written = []
    with _directory(layout):
        for target, group in layout.files:
            with atomic_write(target) as f:
                kind = output_kind(target)
                ordered = _c_order(chunks) if kind == "safetensors" else chunks  # safetensors holds C order only
                _format(kind).write(f, group, source.metadata, ordered, _expect(target))
            written.append(target)
        return [*written, *_write_index(layout)]


def _write_index(layout: Plan) -> list[Path]:
    if layout.index is None:
        return []
    where = layout.index.parent
    mapping = {t.name: target.relative_to(where).as_posix() for target, group in layout.files for t in group}
    total = sum(t.nbytes for _, group in layout.files for t in group)
    with atomic_write(layout.index) as f:
        _sharded.write_index(f, layout.index_base, mapping, total)
    return [layout.index]


class Place(NamedTuple):
    """Where a tensor's bytes go in an output being written: file descriptor and offset of its first byte."""

    fd: int
    offset: int
    path: str

    def write(self, offset: int, data: np.ndarray) -> None:
        """Writes `data` (native bytes) at `offset` from the tensor's first byte; asks the disk to start on it.

        Raises:
            WriteError: when the disk refuses (full, an I/O error).
        """
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        at = self.offset + offset
        try:
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
            if hasattr(os, "posix_fadvise"):  # only a hint: the fsync at the end still decides
                os.posix_fadvise(self.fd, self.offset + offset, data.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise WriteError(e.strerror or str(e), self.path) from e


@contextlib.contextmanager
def placed(
    source: Checkpoint,
    out: str | os.PathLike[str],
    in_place: bool | None = False,
    tensors: list[TensorInfo] | None = None,
    max_shard: int | None = None,
) -> Iterator[dict[str, Place] | None]:
    """Opens the output's files (temporary ones) with their headers written and yields where each tensor's
    bytes go, so that workers can write them in any order (`os.pwrite`); None when the output's format
    needs them in order (an .npz; a Fortran-order tensor into .safetensors), or it has more files than
    `_MAX_OPEN_OUTPUT`: then use `save`.

    On a clean exit every file is fsynced and renamed over its target, the index of shards last; on an
    error none is, and the temporary files are removed.

    Raises:
        UsageError, UnsupportedError, WriteError: as `save`.
    """
    layout = check_plan(source, out, in_place, tensors, max_shard)  # an index in the way fails before any shard
    kinds = [output_kind(target) for target, _ in layout.files]
    in_c_order = [t for target, group in layout.files if target.suffix == ".safetensors" for t in group]
    if "npz" in kinds or any(t.fortran_order for t in in_c_order) or len(layout.files) > _MAX_OPEN_OUTPUT:
        yield None  # (many shards: written one after another, holding one open instead of all of them)
        return
    places: dict[str, Place] = {}
    with _directory(layout), contextlib.ExitStack() as files:
        for target, group in layout.files:
            f = files.enter_context(atomic_write(target))
            if output_kind(target) == "safetensors":
                entries = [(t.name, _safetensors.dtype_of(t), t.shape, t.nbytes) for t in group]
                f.write(_safetensors.header_bytes(entries, source.metadata))
            else:
                (t,) = group
                f.write(t.prefix or _npy.npy_header(t.array_dtype, t.shape, t.fortran_order))
            f.flush()
            at = f.tell()
            for t in group:
                places[t.name] = Place(f.fileno(), at, str(target))
                at += t.nbytes
            f.truncate(at)  # the data's room (a sparse file until written)
        yield places
    _write_index(layout)


def check_plan(
    source: Checkpoint,
    out: str | os.PathLike[str],
    in_place: bool | None = False,
    tensors: list[TensorInfo] | None = None,
    max_shard: int | None = None,
) -> Plan:
    """`plan`, the refusal to write over an input unless `in_place`, and whether the files can be created
    where they go: all that a write checks before it starts, for a dry run to refuse what the write would.

    Raises:
        UsageError, UnsupportedError: as `plan`; WriteError: for an output that is an input, a directory, or
            in a directory that is missing (and not made by the write) or not writable.
    """
    with _unreachable_as_write_error(out):
        return _checked_plan(source, out, in_place, tensors, max_shard)


@contextlib.contextmanager
def _unreachable_as_write_error(target: str | os.PathLike[str]) -> Iterator[None]:
    """A place the checks cannot look into (a directory without search permission: `is_dir` raises) is a
    write that would fail there (exit 4), not a bug."""
    try:
        yield
    except OSError as e:
        raise WriteError(f"cannot write there: {e.strerror or e}", e.filename or target) from e


def _checked_plan(
    source: Checkpoint,
    out: str | os.PathLike[str],
    in_place: bool | None,
    tensors: list[TensorInfo] | None,
    max_shard: int | None,
) -> Plan:
    layout = plan(source, out, tensors, max_shard)
    _refuse_overwrite(source, layout, in_place)
    if layout.directory is not None and layout.directory.is_symlink() and not layout.directory.exists():
        raise WriteError("cannot create the directory: File exists", layout.directory)  # a dangling link, as mkdir
    for target in [f for f, _ in layout.files] + ([layout.index] if layout.index else []):
        real = resolve_target(target)
        if real.is_dir():
            raise WriteError("is a directory", target)
        where = real.parent
        while layout.directory is not None and not where.exists() and where != where.parent:
            where = where.parent  # a directory of shards is made, with its parents: the first that exists
        problem = None
        if not where.is_dir():
            problem = "Not a directory" if where.exists() else "No such file or directory"
        elif not os.access(where, os.W_OK | os.X_OK):
            read_only = hasattr(os, "statvfs") and os.statvfs(where).f_flag & os.ST_RDONLY
            problem = "Read-only file system" if read_only else "Permission denied"
        if problem:
            raise WriteError(f"cannot create a file in {where}: {problem}", target)
    return layout


def _refuse_overwrite(source: Checkpoint, layout: Plan, in_place: bool | None) -> None:
    """Refuses to write over an input unless `in_place` (None: replacing the input is not offered)."""
    inputs = {resolve_target(f) for f in [*source.files, source.path, source.index_path] if f is not None}
    targets = [target for target, _ in layout.files] + ([layout.index] if layout.index else [])
    hint = "write to another path" if in_place is None else "use --in-place to replace it"
    for target in targets:
        if resolve_target(target) in inputs and not in_place:
            raise WriteError(f"refusing to overwrite the input ({hint})", target)


@contextlib.contextmanager
def _directory(layout: Plan) -> Iterator[None]:
    """Makes the directory of shards and its shards' subdirectories where missing; removes those it made
    again, if still empty, when the write fails."""
    made: list[Path] = []
    try:
        if layout.directory is not None:
            for d in dict.fromkeys([layout.directory, *(f.parent for f, _ in layout.files)]):
                missing = []
                while not d.exists() and d != d.parent:
                    missing.append(d)
                    d = d.parent
                for d in reversed(missing):
                    try:
                        d.mkdir()
                    except OSError as e:
                        raise WriteError(f"cannot create the directory: {e.strerror or e}", d) from e
                    made.append(d)
        yield
    except BaseException:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


class Plan(NamedTuple):
    """What writing a checkpoint makes: data files, each with its tensors in order, then an index of shards.

    `index_base` is the source's own index (kept, with its weight map and total size redone);
    `directory`, the directory of shards, is made if missing.
    """

    files: list[tuple[Path, list[TensorInfo]]]
    index: Path | None = None
    index_base: dict[str, Any] | None = None
    directory: Path | None = None


def plan(
    source: Checkpoint,
    out: str | os.PathLike[str],
    tensors: list[TensorInfo] | None = None,
    max_shard: int | None = None,
) -> Plan:
    """The files that writing `tensors` (default: all) of `source` to `out` makes, checked before any is written.

    A file output holds every tensor. A directory (or `*.safetensors.index.json`) output of a sharded
    source keeps its shards and rewrites its index; with `max_shard` (bytes) any source is cut into
    Hugging Face style shards `model-00001-of-0000N.safetensors` of at most that size (a larger tensor
    gets a shard of its own) with an index `model.safetensors.index.json`.

    Raises:
        UsageError: for a directory output of a source that is not sharded, without `max_shard`.
        UnsupportedError: for a tensor the output's format cannot hold.
    """
    out = Path(out)
    kind = output_kind(out)
    tensors = source.tensors if tensors is None else tensors
    if kind in ("directory", "index"):
        directory = out.parent if kind == "index" else out
        if max_shard is not None:
            layout = _reshard(tensors, directory, out if kind == "index" else None, max_shard, source.index)
        elif source.format == "sharded":
            groups: dict[str, list[TensorInfo]] = {}
            for t in tensors:
                groups.setdefault(t.file, []).append(t)
            files = [(directory / name, groups.get(str(f), [])) for f, name in _shard_names(source)]
            index = None
            if source.index_path is not None:
                index = out if kind == "index" else directory / source.index_path.name
            layout = Plan([(target, group) for target, group in files if group], index, source.index, directory)
        else:
            raise UsageError("a directory output needs a sharded input; name a .safetensors, .npz or .npy file", out)
    elif max_shard is not None:
        message = "writes shards: name a directory (or a *.safetensors.index.json)"
        raise UsageError(message, out, "--max-shard-size")
    else:
        layout = Plan([(out, tensors)])
    _check_no_stale_shards(layout, source.index_path if source.format == "sharded-torch" else None)
    for target, group in layout.files:
        _check_format(target, group)
        if output_kind(target) == "npy" and source.format != "npy" and group[0].name != target.stem:
            raise UnsupportedError(
                f"an .npy holds no name: tensor {group[0].name!r} would be read back as {target.stem!r}; "
                f"name the output {group[0].name}.npy, or write .npz",
                target,
            )
        if source.metadata and output_kind(target) in ("npz", "npy"):
            n = len(source.metadata)
            keys = ", ".join(list(source.metadata)[:5]) + (", ..." if n > 5 else "")
            raise UnsupportedError(
                f"the metadata ({n:,} {'entry' if n == 1 else 'entries'}: {keys}) has no place in an .npz or .npy; "
                "write .safetensors to keep it, or give --drop-metadata",
                target,
            )
    return layout


def _shard_names(source: Checkpoint) -> list[tuple[Path, Path]]:
    """Each shard of a sharded source with its path relative to the index's directory (`a/model.safetensors`):
    shards of one name in different subdirectories stay apart in the output. The index reader refuses
    shard paths that leave its directory, so each is below it."""
    base = source.path if source.index_path is None else source.index_path.parent
    return [(f, f.relative_to(base)) for f in source.files]


def _check_no_stale_shards(layout: Plan, source_index: Path | None = None) -> None:
    """Refuses a directory output that holds other shards or indexes than those the write makes: left
    beside the new ones, they would make the directory a different (or an unreadable) checkpoint.

    Raises:
        WriteError: naming a few of them.
    """
    if layout.directory is None or not layout.directory.is_dir():
        return
    made = {resolve_target(f) for f, _ in layout.files} | ({resolve_target(layout.index)} if layout.index else set())
    if source_index is not None:  # PyTorch shards converted beside themselves: the new index is read first
        made.add(resolve_target(source_index))
    directories = dict.fromkeys([layout.directory, *(f.parent for f, _ in layout.files)])  # shards' subdirectories
    stale = sorted(
        p.relative_to(layout.directory).as_posix()
        for d in directories
        if d.is_dir()
        for p in d.iterdir()
        if p.name.endswith((".safetensors", INDEX_SUFFIX, *_sharded.TORCH_INDEX_SUFFIXES))
        and resolve_target(p) not in made
    )
    if stale:
        listed = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise WriteError(
            f"the directory holds {listed}, which this write would leave beside its own shards; "
            "remove them or name an empty directory",
            layout.directory,
        )


def _reshard(
    tensors: list[TensorInfo], directory: Path, index: Path | None, max_shard: int, base: dict[str, Any] | None
) -> Plan:
    """Tensors in order, a new shard started when the next would pass `max_shard` bytes."""
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    prefix = "model" if index is None else index.name[: -len(INDEX_SUFFIX)]
    n = len(groups)
    files = [(directory / f"{prefix}-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]
    return Plan(files, index or directory / f"{prefix}{INDEX_SUFFIX}", base, directory)


def _check_format(target: Path, tensors: list[TensorInfo]) -> None:
    """Refuses, before anything is written, a tensor the target's format cannot hold without loss."""
    kind = output_kind(target)
    for t in tensors:
        if t.skip is not None:
            hint = f"clipcli convert with --exclude {shlex.quote(t.name)} writes the other tensors"
            raise UnsupportedError(f"clipcli cannot write this tensor's values: {t.skip}; {hint}", target, t.name)
        try:
            if kind == "safetensors":
                _safetensors.dtype_of(t)
            elif not (t.array_dtype is None and (t.prefix or (kind == "npz" and t.dtype == "bytes"))):
                _npy.check_portable(t.array_dtype, t.name)
            if kind == "npz":
                _npz.check_member_name(_npz.tensor_member(t))
        except UnsupportedError as e:
            raise UnsupportedError(e.message, target, t.name) from e
    if kind == "npy" and len(tensors) != 1:
        raise UnsupportedError(f"a .npy file holds one tensor, the checkpoint has {len(tensors)}", target)


def _c_order(chunks: ChunkSource) -> ChunkSource:
    """Chunks in C order. A Fortran-order tensor with at most one dimension past 1 has the same bytes in
    either order; any other is transposed (`_transposed`)."""

    def in_c_order(t: TensorInfo) -> Iterable[np.ndarray]:
        if not t.fortran_order or t.size == 0 or sum(n > 1 for n in t.shape) <= 1:
            return chunks(t)
        return _transposed(t, chunks(t))

    return in_c_order


def c_order(flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The values of a tensor of `shape` stored in Fortran order, in C order.

    Dimensions of one element change neither order: they are dropped first, as NumPy holds at most 64
    dimensions and a tensor may have more (never 64 of more than one element: 2**64 values).
    """
    if flat.size == 0:
        return flat
    return flat.reshape([n for n in shape if n != 1], order="F").ravel(order="C")


def _transposed(t: TensorInfo, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """A Fortran-order tensor's chunks in C order: read into one array (a compressed member comes in
    Fortran order only), then given out a block of C-order rows at a time, so it is held once, not twice."""
    whole = np.empty(t.size, t.array_dtype if t.array_dtype is not None else np.uint8)
    at = 0
    for c in chunks:
        whole[at : at + c.size] = c
        at += c.size
    shape = [n for n in t.shape if n != 1]  # NumPy holds at most 64 dimensions; ones change neither order
    view = whole.reshape(shape, order="F")
    # blocks of about CHUNK_BYTES: rows of axis k with the axes after it whole, for each index of those before
    k = next(k for k in range(len(shape)) if math.prod(shape[k + 1 :]) * whole.itemsize <= CHUNK_BYTES)
    rows = max(1, CHUNK_BYTES // (math.prod(shape[k + 1 :]) * whole.itemsize))
    for lead in np.ndindex(*shape[:k]):
        for i in range(0, shape[k], rows):
            yield np.ascontiguousarray(view[lead][i : i + rows]).reshape(-1)


def _expect(target: Path) -> Callable[[TensorInfo, int], None]:
    def expect(t: TensorInfo, written: int) -> None:
        if written != t.nbytes:
            raise ClipcliError(f"wrote {written} bytes of the tensor, expected {t.nbytes}", target, t.name)

    return expect
