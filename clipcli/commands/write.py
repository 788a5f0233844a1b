"""The one writer: tensors streamed into an output through per-tensor ops, measured as they pass.

It owns the choice between the two ways of writing: workers placing their chunks in the output's files
(`placed`: any order), or, for an output whose bytes must come in order (an .npz; a Fortran-order tensor into
.safetensors; more shards than files held open), chunks computed by threads and written in turn (`save`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from clipcli.checkpoint import (
    Checkpoint,
    FileRange,
    Place,
    TensorInfo,
    check_output,
    check_plan,
    placed,
    save,
    shared_in_output,
    unchanged_range,
)
from clipcli.commands import passes
from clipcli.commands.measure import NormKernel, combined
from clipcli.commands.passes import NO_PROGRESS, PerTensor, Progress
from clipcli.core.norms import NormAccumulator

ChunkOp = Callable[[np.ndarray], np.ndarray]


class Op(NamedTuple):
    """What happens to one tensor's chunks; `align` keeps rows whole (or, at the size, the whole tensor)."""

    apply: ChunkOp
    align: int = 1


class _Through:
    """A worker's kernel: each chunk through its tensor's op, measured after (and before, with `measure_first`),
    and written where it goes (`places`; None on a dry run, where only the tensors with an op are read)."""

    def __init__(self, ops: dict[str, Op], places: dict[str, Place] | None, measure_first: bool, worker_bytes: int):
        self.ops, self.places = ops, places
        self.before = NormKernel(2.0) if measure_first else None
        self.after = NormKernel(2.0)
        self.worker_bytes = worker_bytes  # what one worker takes (see _engine.WORKERS_BUDGET)

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        op = self.ops.get(t.name)
        if op is not None:
            if self.before is not None:
                self.before.chunk(t, offset, values)
            values = op.apply(values)
            self.after.chunk(t, offset, values)
        if self.places is not None:
            self.places[t.name].write(offset, values)

    def result(self) -> tuple[dict[str, NormAccumulator], dict[str, NormAccumulator]]:
        return ({} if self.before is None else self.before.accs), self.after.accs


class _InOrder:
    """Hands out the ordered results of a pass tensor by tensor, as the writer asks for them."""

    def __init__(self, results: Iterator[tuple[TensorInfo, Any]]):
        self._results = results
        self._head: tuple[TensorInfo, Any] | None = None
        self._started = False

    def take(self, t: TensorInfo) -> Iterator[Any]:
        if not self._started:
            self._head, self._started = next(self._results, None), True
        while self._head is not None and self._head[0] is t:
            yield self._head[1]
            self._head = next(self._results, None)


def output_target(ckpt: Checkpoint, output: str | None, in_place: bool = False, dry_run: bool = False) -> Path | None:
    """Where a clip of `ckpt` writes: `output`, or with `in_place` the input's own path; None on a dry run,
    which refuses all the same what the write would refuse.

    Raises:
        UsageError: for an output that cannot be written as asked (`checkpoint.check_output`).
        UnsupportedError, WriteError: for a write that would be refused (`checkpoint.check_plan`).
    """
    target = None
    if not dry_run or in_place or output is not None:
        param = "--in-place" if in_place else "-o"
        target = check_output(ckpt.path if in_place else output, ckpt, param=param)  # type: ignore[arg-type]
    if dry_run and target is not None:
        check_plan(ckpt, target, in_place)  # what the write would refuse, refused on a dry run too
        target = None
    return target


def check_write_cost(ckpt: Checkpoint, output: Path | None, tensors: list[TensorInfo] | None = None) -> None:
    """Refuses a write (or its dry run: `output` None) whose tensors (every one, or `tensors`) show far more
    bytes than the checkpoint's files hold (`passes.check_cost`): each tensor written costs its bytes, those
    copied as they are too, but for the names a .pt output keeps on one storage, written once.

    Raises:
        MalformedError: as `passes.check_cost`.
    """
    written = ckpt.tensors if tensors is None else tensors
    once = {name for group in shared_in_output(output, written) for name in group[1:]}
    passes.check_cost(ckpt, [t for t in written if t.name not in once] if once else written)


def write(
    ckpt: Checkpoint,
    output: Path | None,
    ops: dict[str, Op],
    *,
    in_place: bool | None = False,
    tensors: list[TensorInfo] | None = None,
    max_shard: int | None = None,
    measure_first: bool = False,
    jobs: int = 1,
    progress: Progress = NO_PROGRESS,
    label: str = "writing",
    worker_bytes: int = 6 << 20,
) -> tuple[PerTensor, PerTensor]:
    """Streams the tensors (every one, or `tensors`) into `output`, each through its op where it has one.

    With `output` None (a dry run) only the tensors with an op are read, and nothing is written. Returns the
    norms of what was read (only with `measure_first`: one pass instead of two) and of what was written, for
    the tensors that have an op. `worker_bytes`: what one worker takes (a copy's buffers, or also an op's
    temporaries).

    Raises:
        UsageError, UnsupportedError, WriteError: as `checkpoint.save`.
    """
    align = {n: op.align for n, op in ops.items()}
    opped = [t for t in ckpt.tensors if t.name in ops]
    written = ckpt.tensors if tensors is None else tensors
    check_write_cost(ckpt, output, written)
    if output is None:
        progress.phase("clipping", sum(t.nbytes for t in opped))
        results = passes.run_pass(
            ckpt, opped, lambda: _Through(ops, None, measure_first, worker_bytes), jobs, align, progress
        )
    else:
        with placed(ckpt, output, in_place, tensors, max_shard) as places:
            if places is not None:
                progress.phase(label, sum(t.nbytes for t in written))
                make = lambda: _Through(ops, places, measure_first, worker_bytes)  # noqa: E731
                results = passes.run_pass(ckpt, written, make, jobs, align, progress)
        if places is None:
            return _write_in_order(
                ckpt, output, ops, in_place, written, max_shard, measure_first, jobs, progress, label
            )
    before = combined(2.0, opped, (r[0] for r in results)) if measure_first else PerTensor()
    return before, combined(2.0, opped, (r[1] for r in results))


class _Ordered:
    """The kernel of the ordered pass: a chunk through its tensor's op, with the norms of what was read (with
    `measure_first`) and of what comes out."""

    ordered = True

    def __init__(self, ops: dict[str, Op], measure_first: bool):
        self.ops, self.measure_first = ops, measure_first

    def chunk(self, t: TensorInfo, offset: int, chunk: np.ndarray) -> tuple[np.ndarray, tuple[Any, ...]]:
        op = self.ops.get(t.name)
        if op is None:
            return chunk, ()
        read, written = NormAccumulator(2), NormAccumulator(2)
        if self.measure_first:
            read.add(chunk, offset // chunk.itemsize)
        out = op.apply(chunk)
        written.add(out, offset // out.itemsize)
        return out, (read, written)


def _write_in_order(
    ckpt: Checkpoint,
    output: Path,
    ops: dict[str, Op],
    in_place: bool | None,
    tensors: list[TensorInfo],
    max_shard: int | None,
    measure_first: bool,
    jobs: int,
    progress: Progress,
    label: str,
) -> tuple[PerTensor, PerTensor]:
    """`write` for outputs whose bytes must come in order: chunks read and computed by threads, written in turn
    (a copy's too: the next chunks are read while one is written)."""
    subset = None if tensors is ckpt.tensors else tensors
    before, after = PerTensor(), PerTensor()
    for name in ops:
        before[name], after[name] = NormAccumulator(2), NormAccumulator(2)
    progress.phase(label, sum(t.nbytes for t in tensors))
    align = {n: op.align for n, op in ops.items()}
    copies = {id(t): r for t in tensors if t.name not in ops and (r := unchanged_range(ckpt.store, t)) is not None}
    read = [t for t in tensors if id(t) not in copies]  # the others are copied by the kernel as they are written
    results = passes.run_pass(ckpt, read, lambda: _Ordered(ops, measure_first), jobs, align)
    stream = _InOrder(results)

    def chunks(t: TensorInfo) -> Iterator[np.ndarray | FileRange]:
        copy = copies.get(id(t))
        if copy is not None:
            progress.advance(copy.nbytes)
            yield copy
            return
        for out, norms in stream.take(t):
            if norms:
                before[t.name].combine(norms[0])
                after[t.name].combine(norms[1])
            progress.advance(out.nbytes)
            yield out

    try:
        save(ckpt, output, chunks, in_place, subset, max_shard)
    finally:
        results.close()  # type: ignore[attr-defined]
    return (before if measure_first else PerTensor()), after
