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
import itertools
import math
import operator
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np

from clipcli.checkpoint import workers
from clipcli.checkpoint.decode import as_values, decode, stored_type
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
# Tensors at most this large, lying one after another (at most GAP bytes apart: the members of an .npz
# have their headers between them), are read together as one task.
SMALL_TENSOR = 256 << 10
GAP = 4096
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


def jobs_for(jobs: int, make_kernel: Callable[[], Any], total: int) -> int:
    """The workers a pass over `total` bytes takes: at most `jobs`, as many as fit, none idle for lack of data."""
    return max(1, min(_fitting(jobs, make_kernel), math.ceil(total / _BYTES_PER_WORKER)))


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
            if run and not (t.file == file and 0 <= offset - end <= GAP and offset + nbytes - first <= max_bytes):
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
    if None in set(map(_ARRAY_DTYPE, tensors)) or sizes.max() > SMALL_TENSOR or not ((gaps >= 0) & (gaps <= GAP)).all():
        return None
    runs, i, starts = [], 0, offsets.tolist()
    while i < len(starts):  # a run takes those ending within max_bytes of its start (one at least)
        j = max(i + 1, int(np.searchsorted(ends, starts[i] + max_bytes, "right")))
        runs.append((i, j))
        i = j
    return runs


_NBYTES, _LOCATION, _FILE, _ARRAY_DTYPE, _OFFSET, _CRC = map(
    operator.attrgetter, ("nbytes", "location", "file", "array_dtype", "offset", "crc")
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
    total = sum(map(_NBYTES, tensors))
    jobs = jobs_for(jobs, make_kernel, total)
    max_bytes = chunk_bytes(jobs)
    whole = getattr(make_kernel(), "whole", False)
    tasks = _tasks(reader, tensors, max_bytes, align, unit, whole)
    jobs = min(jobs, len(tasks)) or 1
    parts = 1 if whole else min(jobs, getattr(getattr(reader, "store", None), "streams", 1))
    starts: list[tuple[str, int]] = []
    if parts > 1:
        tasks, starts = in_parts(tasks, tensors, parts)
    work = Worker(reader, tensors, tasks, make_kernel, max_bytes, align, unit)
    with read_ahead([reader], [() if whole else tensors], starts):
        return dispatch(work, jobs, total, kind, progress)


def in_parts(tasks: list[_Task], tensors: Sequence[Any], parts: int) -> tuple[list[_Task], list[tuple[str, int]]]:
    """`tasks` cut into `parts` runs of about equal bytes, handed out in turn (the first task of each run, then the
    second of each, ...), and where each run but the first starts in its file (file, byte).

    For a store that streams (a remote one): `parts` workers then each read on in a part of their own, on a
    connection of its own, where one connection's bytes are received by one thread at a time.
    """
    sizes = [task.nbytes or sum(tensors[i].nbytes for i in task.tensors) for task in tasks]
    total = sum(sizes)
    runs: list[list[_Task]] = [[]]
    done = 0
    for task, n in zip(tasks, sizes, strict=True):
        if runs[-1] and len(runs) < parts and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(task)
        done += n
    starts = []
    for run in runs[1:]:
        t = tensors[run[0].tensors[0]]
        if isinstance(t.location, Span):
            starts.append((t.file, t.location.offset + run[0].offset))
    turns = itertools.zip_longest(*runs)
    return [task for turn in turns for task in turn if task is not None], starts


@contextlib.contextmanager
def read_ahead(
    readers: list[Any], sides: list[Sequence[Any]], starts: Sequence[tuple[str, int]] = ()
) -> Iterator[None]:
    """Tells each reader (that can use it: a remote one) the tensors whose chunks the run reads, in the order the
    workers take them, and where a part that other workers read at the same time starts (`in_parts`), for the
    run's time. Not the tensors one worker reads whole (a hash's, a transposed pair's): the workers would wait
    on one another's read-ahead."""
    advise = [getattr(reader, "will_read", None) for reader in readers]
    for will_read, tensors in zip(advise, sides, strict=True):
        if will_read is not None:
            will_read(tensors, starts)
    try:
        yield
    finally:
        for will_read in advise:
            if will_read is not None:
                will_read(())


def _ignore(n: int) -> None:
    pass


class Worker:
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
        buffers = Buffers(self.max_bytes)  # this worker's own (threads share the Worker)
        while True:
            try:
                i = take()
            except StopIteration:
                break
            if i >= len(self.tasks) or (stop is not None and stop.is_set()):
                break
            self.do(kernel, self.tasks[i], progress, buffers)
        return kernel.result()

    def do(self, kernel: Kernel, task: _Task, progress: Callable[[int], None], buffers: Buffers) -> None:
        if task.stream:
            self._stream(kernel, self.tensors[task.tensors[0]], progress)
        elif task.batch:
            self._batch(kernel, list(map(self.tensors.__getitem__, task.tensors)), progress, buffers)
        else:
            t = self.tensors[task.tensors[0]]
            buf = buffers.get(task.nbytes)
            self.reader.pread(t, task.offset, buf)
            kernel.chunk(t, task.offset, decode(buf, t))
            progress(task.nbytes)

    def _batch(self, kernel: Kernel, ts: list[Any], progress: Callable[[int], None], buffers: Buffers) -> None:
        start = ts[0].location.offset
        n = ts[-1].location.offset + ts[-1].nbytes - start
        buf = buffers.get(n)
        self.reader.pread(ts[0] if len(ts) == 1 else Range(ts[0], n), 0, buf)
        if len(ts) > 1:
            check_each(self.reader, ts, buf, start)
        batch = getattr(kernel, "batch", None)
        if batch is not None:  # the kernel takes them all at once (the norms of many tiny tensors)
            batch(ts, buf, starts_in(ts, start))
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


def starts_in(ts: list[Any], start: int) -> list[int]:
    """Where each of tensors at `Span`s starts in a buffer read from `start`."""
    return list(map(operator.sub, map(_OFFSET, map(_LOCATION, ts)), itertools.repeat(start)))


def check_each(reader: Any, ts: list[Any], buf: np.ndarray, start: int) -> None:
    """Each tensor's own checks (a stored member's CRC-32) of tensors read together into `buf` from `start`, as its
    own read would make them."""
    if set(map(_CRC, map(_LOCATION, ts))) == {None}:  # (the common case, tested at once)
        return
    for t in ts:
        if t.location.crc is not None:
            at = t.location.offset - start
            reader.check(t, buf[at : at + t.nbytes])


class Buffers:
    """A worker's reused read buffers, one per side, grown when a row passes the chunk size."""

    def __init__(self, size: int):
        self.size = size
        self.buffers: dict[int, np.ndarray] = {}

    def get(self, n: int, which: int = 0) -> np.ndarray:
        buf = self.buffers.get(which)
        if buf is None or buf.size < n:
            buf = self.buffers[which] = np.empty(max(n, self.size), np.uint8)
        return buf[:n]


class Range(NamedTuple):
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


def dispatch(work: Any, jobs: int, total: int, kind: str | None, progress: Callable[[int], None] | None) -> list:
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
