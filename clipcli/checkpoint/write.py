"""Writing a checkpoint: the plan of files checked before anything is written, then each file atomically."""

from __future__ import annotations

import contextlib
import math
import os
import shlex
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from clipcli.checkpoint import registry
from clipcli.checkpoint.atomic import atomic_write, is_special, resolve_target
from clipcli.checkpoint.engine import CHUNK_BYTES
from clipcli.checkpoint.plugin import DIRECTORY, Plan, Target
from clipcli.checkpoint.reader import Checkpoint
from clipcli.checkpoint.tensor import TensorInfo
from clipcli.errors import ClipcliError, UnsupportedError, UsageError, WriteError

_MAX_OPEN_OUTPUT = 64  # output files written at once by workers; more are written one after another


def output_kind(path: Path) -> str:
    """What a path names: a file format's name, one of the directory writer's own names (an index of shards),
    or DIRECTORY."""
    return registry.directory_writer().kind_of(path.name) or registry.named_by(path.name) or DIRECTORY


def shared_in_output(target: Path | None, tensors: list[TensorInfo]) -> tuple[tuple[str, ...], ...]:
    """The groups of names on one storage of the input that the output at `target` keeps on one storage: a
    .pt's (`torch_write.kept_shared`); none in any other format, or without an output."""
    if target is None or output_kind(Path(target)) != "torch":
        return ()
    from clipcli.checkpoint.formats.torch_write import kept_shared  # here: the registry imports the formats

    return kept_shared(tensors)


def _in_directory(kind: str) -> bool:
    """Whether an output of this kind is written by the directory writer (a directory, or an index of shards)."""
    return kind == DIRECTORY or kind in registry.directory_writer().written


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
    hint = registry.output_hint(in_place=param == "--in-place")
    if raw == "-":
        raise UsageError(f"clipcli writes files, not standard output; {hint}", raw, param)
    if not raw:  # Path("") is the current directory, which a sharded output would fill
        raise UsageError(f"an empty path names no file; {hint}", None, param)
    kind = output_kind(out)
    shards = registry.directory_writer()
    writable = _in_directory(kind) or (shards.kind_of(out.name) is None and registry.writable(kind))
    target = Target(raw, out, kind, writable, hint, param)
    shards.check_target(target, source, resharding, command)
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
                fmt = registry.get(output_kind(target))
                ordered = _c_order(chunks) if fmt.c_order else chunks
                assert fmt.write is not None
                fmt.write(f, group, source.metadata, ordered, _expect(target), source.store)
            written.append(target)
        return [*written, *registry.directory_writer().finish(layout)]


class Place(NamedTuple):
    """Where a tensor's bytes go in an output being written: file descriptor and offset of its first byte."""

    fd: int
    offset: int
    path: str
    durable: bool  # fsynced at the end (it replaces a file): its bytes are handed to the disk as they come

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
            if self.durable and hasattr(os, "posix_fadvise"):  # only a hint: the fsync at the end decides
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

    On a clean exit every file is renamed over its target (fsynced first where it replaces one: see
    `atomic_write`), the index of shards last; on an error none is, and the temporary files are removed.

    Raises:
        UsageError, UnsupportedError, WriteError: as `save`.
    """
    layout = check_plan(source, out, in_place, tensors, max_shard)  # an index in the way fails before any shard
    formats = [registry.get(output_kind(target)) for target, _ in layout.files]
    in_c_order = [t for fmt, (_, group) in zip(formats, layout.files, strict=True) if fmt.c_order for t in group]
    in_order = any(fmt.header is None for fmt in formats)  # (an .npz)
    special = any(is_special(target) for target, _ in layout.files)  # a FIFO, a device: written in order
    if in_order or special or any(t.fortran_order for t in in_c_order) or len(layout.files) > _MAX_OPEN_OUTPUT:
        yield None  # (many shards: written one after another, holding one open instead of all of them)
        return
    places: dict[str, Place] = {}
    with _directory(layout), contextlib.ExitStack() as files:
        for fmt, (target, group) in zip(formats, layout.files, strict=True):
            f = files.enter_context(atomic_write(target))
            assert fmt.header is not None
            f.write(fmt.header(group, source.metadata))
            f.flush()
            at = f.tell()
            for t in group:
                places[t.name] = Place(f.fileno(), at, str(target), f.durable)
                at += t.nbytes
            f.truncate(at)  # the data's room (a sparse file until written)
        yield places
    registry.directory_writer().finish(layout)


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
    shards = registry.directory_writer()
    if _in_directory(kind):
        layout = shards.plan(source, out, kind, tensors, max_shard)
    elif max_shard is not None:
        raise UsageError(f"writes shards: name {shards.names}", out, "--max-shard-size")
    else:
        layout = Plan([(out, tensors)])
    shards.check(layout, source)
    for target, group in layout.files:
        _check_format(target, group, source)
    return layout


def _check_format(target: Path, tensors: list[TensorInfo], source: Checkpoint) -> None:
    """Refuses, before anything is written, a tensor (or metadata) the target's format cannot hold without loss."""
    fmt = registry.get(output_kind(target))
    for t in tensors:
        if t.skip is not None:
            hint = f"clipcli convert with --exclude {shlex.quote(t.name)} writes the other tensors"
            raise UnsupportedError(f"clipcli cannot write this tensor's values: {t.skip}; {hint}", target, t.name)
        if fmt.check_tensor is not None:
            try:
                fmt.check_tensor(t)
            except UnsupportedError as e:
                raise UnsupportedError(e.message, target, t.name) from e
    if fmt.check_file is not None:
        fmt.check_file(target, tensors, source.format, source.metadata, source.store)


def _c_order(chunks: ChunkSource) -> ChunkSource:
    """Chunks in C order. A Fortran-order tensor with at most one dimension past 1 has the same bytes in
    either order; any other is transposed (`_transposed`)."""

    def in_c_order(t: TensorInfo) -> Iterable[np.ndarray]:
        return _transposed(t, chunks(t)) if transposed(t) else chunks(t)

    return in_c_order


def transposed(t: TensorInfo) -> bool:
    """Whether a tensor's values are stored in another order than C order (Fortran order, two dimensions or
    more past 1)."""
    return t.fortran_order and t.size > 0 and sum(n > 1 for n in t.shape) > 1


def _transposed(t: TensorInfo, chunks: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """A Fortran-order tensor's chunks in C order: read into one array (a compressed member comes in
    Fortran order only), then given out a block of C-order rows at a time, so it is held once, not twice."""
    whole = np.empty(t.size, t.array_dtype if t.array_dtype is not None else np.uint8)
    at = 0
    for c in chunks:
        whole[at : at + c.size] = c
        at += c.size
    yield from c_order_blocks(whole, t.shape)


def c_order_blocks(whole: np.ndarray, shape: tuple[int, ...], max_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """The values of a tensor of `shape` held in Fortran order (`whole`, flat), in C order, a block of about
    `max_bytes` at a time."""
    dims = [n for n in shape if n != 1]  # NumPy holds at most 64 dimensions; ones change neither order
    view = whole.reshape(dims, order="F")
    # blocks of about max_bytes: rows of axis k with the axes after it whole, for each index of those before
    k = next((k for k in range(len(dims)) if math.prod(dims[k + 1 :]) * whole.itemsize <= max_bytes), len(dims) - 1)
    rows = max(1, max_bytes // (math.prod(dims[k + 1 :]) * whole.itemsize))
    for lead in np.ndindex(*dims[:k]):
        for i in range(0, dims[k], rows):
            yield np.ascontiguousarray(view[lead][i : i + rows]).reshape(-1)


def _expect(target: Path) -> Callable[[TensorInfo, int], None]:
    def expect(t: TensorInfo, written: int) -> None:
        if written != t.nbytes:
            raise ClipcliError(f"wrote {written} bytes of the tensor, expected {t.nbytes}", target, t.name)

    return expect
