"""The one engine: a kernel run over the chunks of tensors by N workers, in bounded memory.

`run` hands out tasks (a span of one tensor, a run of small tensors read at once, or a whole tensor that
can only be streamed) to workers that take the next task as they finish one; each worker feeds its
chunks to a kernel of its own and hands back the kernel's result. Workers are forked processes, which
share no GIL (the Python between NumPy's kernels serialises threads), or threads where fork is missing,
or the caller itself for one worker or a small input. `map_chunks` keeps order, for writers that must.
"""

from __future__ import annotations

import collections
import contextlib
import math
import operator
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from clipcli.checkpoint import workers
from clipcli.checkpoint.decode import as_values, decode, equal_values, pair_values, stored_type
from clipcli.checkpoint.tensor import Span

if TYPE_CHECKING:
    from concurrent.futures import Future

CHUNK_BYTES = 4 << 20
# Memory for all workers' chunk buffers together: more workers read smaller chunks (16 workers, 512 KiB).
BUFFER_BUDGET = 8 << 20
_MIN_CHUNK = 256 << 10
# Memory for all worker processes together (their own pages: buffers, scratch, what they copy of the
# parent's): with the parent's ~45 MiB, clipcli stays under 128 MiB whatever --jobs. A kernel says what
# one worker of its takes (`worker_bytes`, measured by benchmarks/run.py --only workers); there are never
# more workers than fit.
WORKERS_BUDGET = 80 << 20
_WORKER_BYTES = 6 << 20
# Tensors at most this large, lying one after another (at most _GAP bytes apart: the members of an .npz
# have their headers between them), are read together as one task.
SMALL_TENSOR = 256 << 10
_GAP = 4096
# Below this many bytes per worker, workers cost more than they save.
_BYTES_PER_WORKER = 16 << 20
_PROCESS_BYTES = 64 << 20  # forking pays for itself from about this much data
_CHUNKS_PER_THREAD = 4
R = TypeVar("R")


class Reader(Protocol):
    """What the engine reads through: an open checkpoint."""

    def random_access(self, t: Any) -> bool: ...

    def pread(self, t: Any, offset: int, buf: np.ndarray) -> None: ...

    def chunks(self, t: Any, max_bytes: int = CHUNK_BYTES, align: int = 1, unit: int = 1) -> Iterator[np.ndarray]: ...

    def forget_handles(self) -> None: ...

    def take_read_log(self) -> Any: ...

    def check(self, t: Any, data: np.ndarray) -> None: ...

    def add_read_log(self, log: Any) -> None: ...


class Kernel(Protocol):
    """What a worker does with its chunks: `chunk(t, offset, values)`, then `result()` for the parent.

    `values` are tensor `t`'s elements from byte `offset` on, in storage order, valid only during the
    call; every span but a tensor's last holds a whole number of `align` elements. A kernel may also
    have `batch(tensors, raw, starts)`: whole small tensors lying together, their bytes at `starts` of
    `raw` (uint8), given at once instead of one `chunk` each. A kernel with `whole = True` (a hash) gets
    every chunk of a tensor in one worker, in order.
    """

    def chunk(self, t: Any, offset: int, values: np.ndarray) -> None: ...

    def result(self) -> Any: ...


class _Task(NamedTuple):
    """One tensor's bytes [offset, offset + nbytes), or (`batch`) several whole tensors lying together."""

    tensors: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0
    batch: bool = False
    stream: bool = False


def _fitting(jobs: int, make_kernel: Callable[[], Any]) -> int:
    """`jobs`, or fewer: as many workers as fit WORKERS_BUDGET with what one of this kernel's takes."""
    worker = getattr(make_kernel(), "worker_bytes", _WORKER_BYTES)
    return max(1, min(jobs, WORKERS_BUDGET // worker))


def chunk_bytes(jobs: int) -> int:
    """The chunk size for `jobs` workers: 4 MiB, smaller when many workers share the buffer budget."""
    return max(_MIN_CHUNK, min(CHUNK_BYTES, BUFFER_BUDGET // max(jobs, 1)))


def _tasks(
    reader: Reader, tensors: Sequence[Any], max_bytes: int, align: dict[str, int], unit: int, whole: bool = False
) -> list[_Task]:
    runs = _small_runs(tensors, max_bytes)
    if runs is not None:
        return [_Task(tuple(range(i, j)), batch=True) for i, j in runs]
    tasks: list[_Task] = []
    run: list[int] = []  # small tensors lying one after another in one file

    def flush() -> None:
        if run:
            tasks.append(_Task(tuple(run), batch=True))
            run.clear()

    file, first, end = None, 0, 0  # the run's file, where it starts and ends
    for i, t in enumerate(tensors):
        nbytes, loc = t.nbytes, t.location
        if nbytes <= SMALL_TENSOR and isinstance(loc, Span) and t.array_dtype is not None:  # (read anywhere)
            offset = loc.offset
            if run and not (t.file == file and 0 <= offset - end <= _GAP and offset + nbytes - first <= max_bytes):
                flush()
            if not run:
                file, first = t.file, offset
            end = offset + nbytes
            run.append(i)
            continue
        flush()
        if not reader.random_access(t):
            tasks.append(_Task((i,), stream=True))
            continue
        if whole:  # one worker reads it all, in order
            tasks.append(_Task((i,), stream=True))
            continue
        _, per_chunk = geometry(t, max_bytes, align.get(t.name, 1), unit)
        tasks += [_Task((i,), offset, n) for offset, n in spans(t.nbytes, per_chunk)]
    flush()
    return tasks


def _small_runs(tensors: Sequence[Any], max_bytes: int) -> list[tuple[int, int]] | None:
    """`_tasks`' runs (first, end) where all are small, in order at `Span`s of one file (found per run), else None."""
    if not tensors or set(map(type, map(_LOCATION, tensors))) != {Span} or len(set(map(_FILE, tensors))) != 1:
        return None
    sizes = np.fromiter(map(_NBYTES, tensors), np.int64, len(tensors))
    offsets = np.fromiter(map(_OFFSET, map(_LOCATION, tensors)), np.int64, len(tensors))
    ends = offsets + sizes
    gaps = offsets[1:] - ends[:-1]
    if (
        None in set(map(_ARRAY_DTYPE, tensors))
        or sizes.max() > SMALL_TENSOR
        or not ((gaps >= 0) & (gaps <= _GAP)).all()
    ):
        return None
    runs, i, starts = [], 0, offsets.tolist()
    while i < len(starts):  # a run takes those ending within max_bytes of its start (one at least)
        j = max(i + 1, int(np.searchsorted(ends, starts[i] + max_bytes, "right")))
        runs.append((i, j))
        i = j
    return runs


_NBYTES, _LOCATION, _FILE, _ARRAY_DTYPE, _OFFSET = map(
    operator.attrgetter, ("nbytes", "location", "file", "array_dtype", "offset")
)


def geometry(t: Any, max_bytes: int, align: int, unit: int = 1) -> tuple[np.dtype, int]:
    """The dtype a tensor's bytes are read as, and the bytes in each chunk but the last.

    Chunks hold whole multiples of `align` elements (rows), at least one, whatever `max_bytes` says; and
    whole `unit`s (the caller's blocks: the norms' BLOCK values) where the rows allow it within a few chunks'
    worth, so that a worker never holds a block's parts waiting for the rest from another.
    """
    dtype = stored_type(t)
    if t.array_dtype is None:
        per_chunk = max(max_bytes, 1)
    else:
        align = max(align, 1)  # a row of a tensor with a zero-length dimension holds no values
        unit = math.lcm(align, unit)
        if unit * dtype.itemsize > 4 * max_bytes:
            unit = align
        per_chunk = max(max_bytes // (dtype.itemsize * unit), 1) * unit * dtype.itemsize
    return dtype, min(per_chunk, t.nbytes) or 1


def spans(total: int, per_chunk: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each chunk of `total` bytes."""
    for offset in range(0, total, per_chunk):
        yield offset, min(per_chunk, total - offset)


def run(
    reader: Reader,
    tensors: Sequence[Any],
    make_kernel: Callable[[], Kernel],
    jobs: int = 1,
    align: dict[str, int] | None = None,
    progress: Callable[[int], None] | None = None,
    *,
    unit: int,
    kind: str | None = None,
) -> list[Any]:
    """Runs a kernel over every chunk of `tensors` with `jobs` workers; returns each worker's `result()`.

    Chunks hold whole multiples of `unit` elements where the rows allow (see `geometry`).

    Fewer workers than `jobs` run where the input is small, or where more would not fit the memory budget.

    Which worker sees which chunk is not fixed, so kernels must give results that do not depend on it
    (the norms add exactly; ordered folds keep offsets). `kind` forces 'inline', 'threads' or
    'processes' (tests); by default forked processes for more than one worker on a large input.

    Raises:
        whatever a worker raised (the first error; the other workers are stopped).
    """
    align = align or {}
    total = sum(t.nbytes for t in tensors)
    jobs = max(1, min(_fitting(jobs, make_kernel), math.ceil(total / _BYTES_PER_WORKER)))
    max_bytes = chunk_bytes(jobs)
    whole = getattr(make_kernel(), "whole", False)
    tasks = _tasks(reader, tensors, max_bytes, align, unit, whole)
    work = _Worker(reader, tensors, tasks, make_kernel, max_bytes, align, unit)
    with _read_ahead([reader], [() if whole else tensors]):
        return _dispatch(work, min(jobs, len(tasks)) or 1, total, kind, progress)


@contextlib.contextmanager
def _read_ahead(readers: list[Any], sides: list[Sequence[Any]]) -> Iterator[None]:
    """Tells each reader (that can use it: a remote one) the tensors whose chunks the run reads, in the order the
    workers take them, for the run's time. Not the tensors one worker reads whole (a hash's, a transposed
    pair's): the workers would wait on one another's read-ahead."""
    advise = [getattr(reader, "will_read", None) for reader in readers]
    for will_read, tensors in zip(advise, sides, strict=True):
        if will_read is not None:
            will_read(tensors)
    try:
        yield
    finally:
        for will_read in advise:
            if will_read is not None:
                will_read(())


def _ignore(n: int) -> None:
    pass


class _Worker:
    """What every worker runs: take the next task, read it into a buffer of its own, feed the kernel."""

    def __init__(
        self,
        reader: Reader,
        tensors: Sequence[Any],
        tasks: list[Any],
        make_kernel: Callable[[], Any],
        max_bytes: int,
        align: dict[str, int],
        unit: int = 1,
    ):
        self.reader, self.tensors, self.tasks = reader, tensors, tasks
        self.make_kernel, self.max_bytes, self.align, self.unit = make_kernel, max_bytes, align, unit
        self.readers = [reader]

    def all(self, progress: Callable[[int], None]) -> Any:
        """Every task, in order, in the caller."""
        return self.loop(iter(range(len(self.tasks))).__next__, progress)

    def loop(
        self, take: Callable[[], int], progress: Callable[[int], None], stop: threading.Event | None = None
    ) -> Any:
        kernel = self.make_kernel()
        buffers = _Buffers(self.max_bytes)  # this worker's own (threads share the _Worker)
        while True:
            try:
                i = take()
            except StopIteration:
                break
            if i >= len(self.tasks) or (stop is not None and stop.is_set()):
                break
            self.do(kernel, self.tasks[i], progress, buffers)
        return kernel.result()

    def do(self, kernel: Kernel, task: _Task, progress: Callable[[int], None], buffers: _Buffers) -> None:
        if task.stream:
            self._stream(kernel, self.tensors[task.tensors[0]], progress)
        elif task.batch:
            self._batch(kernel, [self.tensors[j] for j in task.tensors], progress, buffers)
        else:
            t = self.tensors[task.tensors[0]]
            buf = buffers.get(task.nbytes)
            self.reader.pread(t, task.offset, buf)
            kernel.chunk(t, task.offset, decode(buf, t))
            progress(task.nbytes)

    def _batch(self, kernel: Kernel, ts: list[Any], progress: Callable[[int], None], buffers: _Buffers) -> None:
        start = ts[0].location.offset
        n = ts[-1].location.offset + ts[-1].nbytes - start
        buf = buffers.get(n)
        self.reader.pread(ts[0] if len(ts) == 1 else _Range(ts[0], n), 0, buf)
        if len(ts) > 1:
            for t in ts:  # each tensor's own checks (a stored member's CRC-32), as its own read would make
                if t.location.crc is not None:
                    at = t.location.offset - start
                    self.reader.check(t, buf[at : at + t.nbytes])
        batch = getattr(kernel, "batch", None)
        if batch is not None:  # the kernel takes them all at once (the norms of many tiny tensors)
            batch(ts, buf, [t.location.offset - start for t in ts])
        else:
            for t in ts:
                at = t.location.offset - start
                kernel.chunk(t, 0, decode(buf[at : at + t.nbytes], t))
        progress(n)

    def _stream(self, kernel: Kernel, t: Any, progress: Callable[[int], None]) -> None:
        offset = 0
        for values in self.reader.chunks(t, self.max_bytes, self.align.get(t.name, 1), self.unit):
            kernel.chunk(t, offset, values)
            offset += values.nbytes
            progress(values.nbytes)


class _Buffers:
    """A worker's reused read buffers, one per side, grown when a row passes the chunk size."""

    def __init__(self, size: int):
        self.size = size
        self.buffers: dict[int, np.ndarray] = {}

    def get(self, n: int, which: int = 0) -> np.ndarray:
        buf = self.buffers.get(which)
        if buf is None or buf.size < n:
            buf = self.buffers[which] = np.empty(max(n, self.size), np.uint8)
        return buf[:n]


# --- Two checkpoints in lockstep ----------------------------------------------------------------------


class PairKernel(Protocol):
    """What a worker does with the chunks of pairs of tensors: `pair(i, start, a, b, same)`, then `result()`.

    `a` and `b` are the values of pair i's tensors from element `start` on (equally many); `same` says
    their dtypes and stored bytes are equal. Every span but a pair's last holds whole blocks of
    `block` elements (so that block sums merge exactly).
    """

    def pair(self, i: int, start: int, a: np.ndarray, b: np.ndarray, same: bool) -> None: ...

    def result(self) -> Any: ...


class _PairTask(NamedTuple):
    pair: int
    start: int = 0  # first element
    count: int = 0  # elements
    stream: bool = False
    whole: bool = False  # both tensors read whole, in C order: their element orders differ (Fortran and C)
    batch: tuple[int, ...] = ()  # whole small pairs lying together on both sides, read at once


def run_pairs(
    readers: tuple[Reader, Reader],
    pairs: Sequence[tuple[Any, Any]],
    make_kernel: Callable[[], PairKernel],
    jobs: int = 1,
    block: int = 1,
    progress: Callable[[int], None] | None = None,
    kind: str | None = None,
) -> list[Any]:
    """Like `run`, over pairs of equally long tensors of two checkpoints read in lockstep.

    Both sides of a task are read at once (two buffers a worker); a pair that one side can only stream
    is one task, both sides streamed in chunks of the same element count. Tensors carried as bytes are
    paired byte by byte. A tensor in Fortran order paired with one in C order (of more than one
    dimension longer than 1) is read whole, both sides, into C order: their stored orders pair other
    elements. Small pairs lying one after another on both sides are read together, as `run` reads small
    tensors: given to the kernel's `batch(pairs, raw_a, starts_a, raw_b, starts_b)` where it has one.
    """
    total = sum(a.nbytes + b.nbytes for a, b in pairs)
    jobs = max(1, min(_fitting(jobs, make_kernel), math.ceil(total / _BYTES_PER_WORKER)))
    max_bytes = chunk_bytes(jobs)
    tasks: list[_PairTask] = []
    run: list[int] = []  # small pairs lying together on both sides
    for i, (a, b) in enumerate(pairs):
        if _small_pair(a, b):
            if run and not _pair_follows((a, b), pairs[run[-1]], pairs[run[0]], max_bytes):
                tasks.append(_PairTask(run[0], batch=tuple(run)))
                run = []
            run.append(i)
            continue
        if run:
            tasks.append(_PairTask(run[0], batch=tuple(run)))
            run = []
        if a.fortran_order != b.fortran_order and sum(n > 1 for n in a.shape) > 1:
            tasks.append(_PairTask(i, whole=True))
            continue
        if not (readers[0].random_access(a) and readers[1].random_access(b)):
            tasks.append(_PairTask(i, stream=True))
            continue
        size = a.nbytes // _itemsize(a)
        step = max(max_bytes // max(_itemsize(a), _itemsize(b)) // block, 1) * block
        tasks += [_PairTask(i, start, min(step, size - start)) for start in range(0, size, step)] or [_PairTask(i)]
    if run:
        tasks.append(_PairTask(run[0], batch=tuple(run)))
    work = _PairWorker(readers, pairs, tasks, make_kernel, max_bytes, block)
    # each pair read in chunks, once, in the order its first chunk is taken
    chunked = [pairs[i] for i in dict.fromkeys(t.pair for t in tasks if not (t.whole or t.stream or t.batch))]
    with _read_ahead(list(readers), [[a for a, _ in chunked], [b for _, b in chunked]]):
        return _dispatch(work, min(jobs, len(tasks)) or 1, total, kind, progress)


class _PairWorker(_Worker):
    def __init__(
        self,
        readers: tuple[Reader, Reader],
        pairs: Sequence[tuple[Any, Any]],
        tasks: list[_PairTask],
        make_kernel: Callable[[], PairKernel],
        max_bytes: int,
        block: int,
    ):
        super().__init__(readers[0], [], tasks, make_kernel, max_bytes, {})
        self.readers, self.pairs, self.block = list(readers), pairs, block

    def do(self, kernel: Any, task: _PairTask, progress: Callable[[int], None], buffers: _Buffers) -> None:
        a, b = self.pairs[task.pair]
        if task.batch:
            self._pair_batch(kernel, task.batch, progress, buffers)
            return
        if task.stream:
            self._stream_pair(kernel, task.pair, a, b, progress)
            return
        if task.whole:
            va, vb = (reader.read_flat(t) for reader, t in zip(self.readers, (a, b), strict=True))
            kernel.pair(task.pair, 0, va, vb, equal_values(va, vb))
            progress(a.nbytes + b.nbytes)
            return
        raw = []
        for k, (reader, t) in enumerate(zip(self.readers, (a, b), strict=True)):
            item = _itemsize(t)
            buf = buffers.get(task.count * item, k)
            reader.pread(t, task.start * item, buf)
            raw.append(buf)
        kernel.pair(task.pair, task.start, *pair_values(a, b, *raw))
        progress(raw[0].nbytes + raw[1].nbytes)

    def _pair_batch(
        self, kernel: Any, ids: tuple[int, ...], progress: Callable[[int], None], buffers: _Buffers
    ) -> None:
        """Whole small pairs lying together: each side's bytes read at once, then the kernel's `batch` (or its
        `pair`, pair by pair)."""
        raws, starts = [], []
        for k, reader in enumerate(self.readers):
            ts = [self.pairs[i][k] for i in ids]
            first = ts[0].location.offset
            buf = buffers.get(ts[-1].location.offset + ts[-1].nbytes - first, k)
            reader.pread(ts[0] if len(ts) == 1 else _Range(ts[0], buf.size), 0, buf)
            at = [t.location.offset - first for t in ts]
            for t, s in zip(ts, at, strict=True):  # each tensor's own checks (a stored member's CRC-32)
                if len(ts) > 1 and t.location.crc is not None:
                    reader.check(t, buf[s : s + t.nbytes])
            raws.append(buf)
            starts.append(at)
        batch = getattr(kernel, "batch", None)
        if batch is not None:
            batch(ids, raws[0], starts[0], raws[1], starts[1])
        else:
            for i, sa, sb in zip(ids, *starts, strict=True):
                a, b = self.pairs[i]
                kernel.pair(i, 0, *pair_values(a, b, raws[0][sa : sa + a.nbytes], raws[1][sb : sb + b.nbytes]))
        progress(raws[0].nbytes + raws[1].nbytes)

    def _stream_pair(self, kernel: Any, i: int, a: Any, b: Any, progress: Callable[[int], None]) -> None:
        """Both tensors streamed in chunks of the same element count (a multiple of the block)."""
        items = (_itemsize(a), _itemsize(b))
        n = max(self.max_bytes // max(items) // self.block, 1) * self.block
        chunks_a = self.readers[0].chunks(a, n * items[0], unit=self.block)
        chunks_b = self.readers[1].chunks(b, n * items[1], unit=self.block)
        start = 0
        for va, vb in zip(chunks_a, chunks_b, strict=True):
            kernel.pair(i, start, va, vb, equal_values(va, vb))
            start += va.size
            progress(va.nbytes + vb.nbytes)


def _small_pair(a: Any, b: Any) -> bool:
    """Whether a pair is read whole among others: small tensors of values, contiguous, in one element order."""
    return (
        a.nbytes <= SMALL_TENSOR
        and b.nbytes <= SMALL_TENSOR
        and a.array_dtype is not None
        and b.array_dtype is not None
        and isinstance(a.location, Span)
        and isinstance(b.location, Span)
        and (a.fortran_order == b.fortran_order or sum(n > 1 for n in a.shape) <= 1)
    )


def _pair_follows(pair: tuple[Any, Any], last: tuple[Any, Any], first: tuple[Any, Any], max_bytes: int) -> bool:
    """Whether both tensors of a pair lie just after those of `last` in their files (at most _GAP bytes on),
    each side of the run from `first` taking at most `max_bytes`."""
    return _follows(pair[0], last[0], first[0], max_bytes) and _follows(pair[1], last[1], first[1], max_bytes)


def _follows(t: Any, last: Any, first: Any, max_bytes: int) -> bool:
    offset = t.location.offset
    gap = offset - last.location.offset - last.nbytes
    return 0 <= gap <= _GAP and offset + t.nbytes - first.location.offset <= max_bytes and t.file == last.file


def _itemsize(t: Any) -> int:
    """Bytes per element as a pair is read: a type carried as bytes is paired byte by byte."""
    return t.array_dtype.itemsize if t.array_dtype is not None else 1


class _Range(NamedTuple):
    """The bytes of several tensors lying together, read as if they were one tensor's."""

    first: Any
    nbytes: int

    @property
    def file(self) -> str:
        return self.first.file

    @property
    def name(self) -> str:
        return self.first.name

    @property
    def location(self) -> Any:
        return Span(self.first.location.offset)


def _dispatch(work: Any, jobs: int, total: int, kind: str | None, progress: Callable[[int], None] | None) -> list:
    """Runs `work` in the caller, in `jobs` threads or in `jobs` forked processes (by default: processes for
    large inputs where fork exists, threads otherwise or for a store that cannot be forked (a remote one: its
    event loop), the caller for one job); returns each worker's result."""
    if kind is None:
        forkable = hasattr(os, "fork") and all(
            getattr(getattr(r, "store", None), "forkable", True) for r in work.readers
        )
        kind = "inline" if jobs == 1 else "processes" if forkable and total >= _PROCESS_BYTES else "threads"
    if kind == "inline":
        return [work.all(progress or _ignore)]
    if kind == "threads":
        return workers.in_threads(work, jobs, progress or _ignore)
    return workers.in_processes(work, jobs, progress or _ignore)


def map_chunks(
    reader: Reader,
    tensors: list[Any],
    fn: Callable[[Any, int, np.ndarray], R],
    jobs: int = 1,
    max_bytes: int | None = None,
    align: dict[str, int] | None = None,
    *,
    unit: int,
) -> Iterator[tuple[Any, R]]:
    """`fn(tensor, offset, chunk)` for every chunk of every tensor, in order, computed by `jobs` threads.

    For writers that need the chunks in order (an .npz). Each thread reads its chunks with `pread` into
    buffers of its own; NumPy releases the GIL in its kernels. A chunk (and a result that is a view of
    it) stays valid until the caller asks for the next result. `offset` is the chunk's first byte in the
    tensor; chunks hold multiples of `align[name]` elements. Tensors that are streamed are read by one
    thread.
    """
    align = align or {}
    max_bytes = max_bytes or chunk_bytes(2 * jobs)  # two chunks a thread are in flight
    jobs = min(jobs, sum(-(-t.nbytes // max_bytes) for t in tensors) // _CHUNKS_PER_THREAD)
    if jobs <= 1 or not all(reader.random_access(t) for t in tensors):
        for t in tensors:
            offset = 0
            for chunk in reader.chunks(t, max_bytes, align.get(t.name, 1), unit):
                yield t, fn(t, offset, chunk)
                offset += chunk.nbytes
        return

    def tasks() -> Iterator[tuple[Any, int, int, np.dtype]]:
        for t in tensors:
            dtype, per_chunk = geometry(t, max_bytes, align.get(t.name, 1), unit)
            for offset, n in spans(t.nbytes, per_chunk):
                yield t, offset, n, dtype

    def read_apply(t: Any, offset: int, n: int, dtype: np.dtype, buf: np.ndarray) -> tuple[Any, R]:
        reader.pread(t, offset, buf[:n])
        return t, fn(t, offset, as_values(buf[:n], dtype))

    todo = tasks()
    free: list[np.ndarray] = []
    inflight: collections.deque[tuple[Future[tuple[Any, R]], np.ndarray]] = collections.deque()
    from concurrent.futures import ThreadPoolExecutor  # here: its imports (logging) cost every other run

    pool = ThreadPoolExecutor(jobs, thread_name_prefix="clipcli-read")

    def submit() -> None:
        task = next(todo, None)
        if task is not None:
            t, offset, n, dtype = task
            buf = free.pop() if free else np.empty(max_bytes, np.uint8)
            if buf.size < n:  # a row larger than a chunk
                buf = np.empty(n, np.uint8)
            inflight.append((pool.submit(read_apply, t, offset, n, dtype, buf), buf))

    try:
        for _ in range(2 * jobs):
            submit()
        while inflight:
            future, buf = inflight.popleft()
            yield future.result()
            free.append(buf)
            submit()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
