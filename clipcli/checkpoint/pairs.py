"""Two checkpoints in lockstep: `run_pairs`, the engine's `run` over pairs of tensors read side by side."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from clipcli.checkpoint.decode import equal_values, pair_values
from clipcli.checkpoint.engine import (
    GAP,
    SMALL_TENSOR,
    Buffers,
    Range,
    Reader,
    Worker,
    check_each,
    chunk_bytes,
    dispatch,
    jobs_for,
    read_ahead,
    starts_in,
)
from clipcli.checkpoint.tensor import Span


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
    total = sum(map(_NBYTES, itertools.chain.from_iterable(pairs)))
    jobs = jobs_for(jobs, make_kernel, total)
    max_bytes = chunk_bytes(jobs)
    tasks = _pair_tasks(readers, pairs, max_bytes, block)
    work = _PairWorker(readers, pairs, tasks, make_kernel, max_bytes, block)
    # each pair read in chunks, once, in the order its first chunk is taken
    chunked = [pairs[i] for i in dict.fromkeys(t.pair for t in tasks if not (t.whole or t.stream or t.batch))]
    with read_ahead(list(readers), [[a for a, _ in chunked], [b for _, b in chunked]]):
        return dispatch(work, min(jobs, len(tasks)) or 1, total, kind, progress)


def _pair_tasks(
    readers: tuple[Reader, Reader], pairs: Sequence[tuple[Any, Any]], max_bytes: int, block: int
) -> list[_PairTask]:
    """The tasks of `run_pairs`: runs of small pairs lying together, pairs read whole, streamed or in chunks."""
    runs = _small_pair_runs(pairs, max_bytes)
    if runs is not None:
        return [_PairTask(i, batch=tuple(range(i, j))) for i, j in runs]
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
    return tasks


def _small_pair_runs(pairs: Sequence[tuple[Any, Any]], max_bytes: int) -> list[tuple[int, int]] | None:
    """`_pair_tasks`' runs (first, end) where every pair is small, in C order and in order at `Span`s of one
    file a side (found per run, as `engine` finds runs of small tensors), else None."""
    if not pairs:
        return None
    sides = tuple(zip(*pairs, strict=True))
    starts, ends = [], []
    for side in sides:
        if (
            set(map(type, map(_LOCATION, side))) != {Span}
            or len(set(map(_FILE, side))) != 1
            or None in set(map(_ARRAY_DTYPE, side))
            or set(map(_FORTRAN, side)) != {False}
        ):
            return None
        sizes = np.fromiter(map(_NBYTES, side), np.int64, len(side))
        offsets = np.fromiter(map(_OFFSET, map(_LOCATION, side)), np.int64, len(side))
        gaps = offsets[1:] - (offsets + sizes)[:-1]
        if sizes.max() > SMALL_TENSOR or not ((gaps >= 0) & (gaps <= GAP)).all():
            return None
        starts.append(offsets.tolist())
        ends.append(offsets + sizes)
    runs, i = [], 0
    while i < len(pairs):  # a run takes the pairs ending within max_bytes of its start on both sides (one at least)
        limit = min(int(np.searchsorted(e, s[i] + max_bytes, "right")) for s, e in zip(starts, ends, strict=True))
        j = max(i + 1, limit)
        runs.append((i, j))
        i = j
    return runs


_NBYTES, _LOCATION, _FILE, _ARRAY_DTYPE, _FORTRAN, _OFFSET = map(
    operator.attrgetter, ("nbytes", "location", "file", "array_dtype", "fortran_order", "offset")
)


class _PairWorker(Worker):
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

    def do(self, kernel: Any, task: _PairTask, progress: Callable[[int], None], buffers: Buffers) -> None:
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

    def _pair_batch(self, kernel: Any, ids: tuple[int, ...], progress: Callable[[int], None], buffers: Buffers) -> None:
        """Whole small pairs lying together: each side's bytes read at once, then the kernel's `batch` (or its
        `pair`, pair by pair)."""
        raws, starts = [], []
        for k, reader in enumerate(self.readers):
            ts = [self.pairs[i][k] for i in ids]
            first = ts[0].location.offset
            buf = buffers.get(ts[-1].location.offset + ts[-1].nbytes - first, k)
            reader.pread(ts[0] if len(ts) == 1 else Range(ts[0], buf.size), 0, buf)
            if len(ts) > 1:
                check_each(reader, ts, buf, first)
            raws.append(buf)
            starts.append(starts_in(ts, first))
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
    """Whether both tensors of a pair lie just after those of `last` in their files (at most GAP bytes on),
    each side of the run from `first` taking at most `max_bytes`."""
    return _follows(pair[0], last[0], first[0], max_bytes) and _follows(pair[1], last[1], first[1], max_bytes)


def _follows(t: Any, last: Any, first: Any, max_bytes: int) -> bool:
    offset = t.location.offset
    gap = offset - last.location.offset - last.nbytes
    return 0 <= gap <= GAP and offset + t.nbytes - first.location.offset <= max_bytes and t.file == last.file


def _itemsize(t: Any) -> int:
    """Bytes per element as a pair is read: a type carried as bytes is paired byte by byte."""
    return t.array_dtype.itemsize if t.array_dtype is not None else 1
