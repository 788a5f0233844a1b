"""One way to run a pass over checkpoints' chunks: the kernel, the workers, the progress, the results."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from clipcli.checkpoint import Checkpoint, TensorInfo, run
from clipcli.core.blocks import BLOCK
from clipcli.errors import MalformedError


class Progress:
    """Where a command says how far it is: a named pass over so many bytes, then bytes done. Does nothing."""

    def phase(self, label: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


NO_PROGRESS = Progress()


def workers(jobs: int | None = None) -> int:
    """`jobs`, or the cores this process may run on: never more workers than cores (more would only
    contend for them, and each takes memory)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(jobs, cores) if jobs else cores


# A pass may read at most this many bytes of values beyond EXPANSION times its files' bytes: views that repeat
# values (an expand, overlapping strides) or many names on one storage show more values than a file holds, and
# every value shown is streamed (a 1.5 KB .pt expanded to 10**10 values took minutes; 20,000 names on one storage
# 22 s). A model sharing one weight among a dozen layers stays well within it. Compressed members are bounded by
# their own ratio (npz).
EXPANSION, EXPANSION_SLACK = 64, 1 << 31
_NBYTES = operator.attrgetter("nbytes")


def _sides(source: Checkpoint | tuple[Checkpoint, Checkpoint], items: Sequence[Any]) -> tuple[tuple, tuple]:
    if isinstance(source, tuple):
        return source, tuple(zip(*items, strict=True)) if items else ((), ())
    return (source,), (items,)


def check_cost(ckpt: Checkpoint, tensors: Sequence[TensorInfo]) -> None:
    """Refuses a pass (or a write) whose tensors show far more bytes of values than the checkpoint's files hold.

    Raises:
        MalformedError: naming the largest such tensor.
    """
    if sum(map(_NBYTES, tensors)) <= EXPANSION_SLACK:  # (most passes: one sum, no filter)
        return
    shown = [t for t in tensors if t.location is not None and not t.compression]
    total = sum(map(_NBYTES, shown))
    stored = sum(ckpt.store.size(f) for f in ckpt.files)
    if total > EXPANSION * stored + EXPANSION_SLACK:
        largest = max(shown, key=_NBYTES)
        raise MalformedError(
            f"its tensors show {total:,} bytes of values from {stored:,} bytes of files, more than {EXPANSION} "
            f"times as many and 2 GiB (views that repeat values, or many names on one storage; the largest: "
            f"{largest.name}, {largest.nbytes:,} bytes): a file may not cost more than its bytes justify "
            "(`inspect` lists them; the commands that read only the tensors chosen take --include/--exclude)",
            ckpt.path,
        )


def run_pass(
    source: Checkpoint | tuple[Checkpoint, Checkpoint],
    items: Sequence[Any],
    make_kernel: Callable[[], Any],
    jobs: int = 1,
    align: dict[str, int] | None = None,
    progress: Progress = NO_PROGRESS,
) -> Any:
    """Runs a kernel over every chunk of `items` (tensors of one checkpoint, or pairs of two read in lockstep).

    Workers (processes, or threads) each make a kernel and feed it chunks in any order; the result is each
    worker's `result()`. A kernel that needs the chunks in order says so (`ordered = True`): one kernel's
    `chunk(t, offset, values)` is then called by `jobs` threads and the result is an iterator of
    `(tensor, what chunk returned)` in storage order, which the caller consumes and closes. A kernel that needs
    each tensor's chunks in order in one worker, tensors in parallel (a hash), says `whole = True`. Pairs are read in
    blocks of `BLOCK` values, so that a pair's blocks are summed as the array's are.
    """
    for ckpt, tensors in zip(*_sides(source, items), strict=True):
        check_cost(ckpt, tensors)
    if isinstance(source, tuple):
        from clipcli.checkpoint.pairs import run_pairs

        return run_pairs(source, items, make_kernel, jobs, BLOCK, progress.advance)
    kernel = make_kernel()  # (cheap: a kernel holds only what its chunks add up)
    if getattr(kernel, "ordered", False):
        return source.map_chunks(list(items), kernel.chunk, jobs, align=align, unit=BLOCK)
    return run(source, items, make_kernel, jobs, align, progress.advance, unit=BLOCK)


class PerTensor(dict):
    """Each tensor's accumulator by name (or each pair's by number, for diff); those of small tensors measured
    together (`batches`) are made from their `SmallNorms` (`SmallDiffs`) when first asked for (by
    --depth, or a clip)."""

    def __init__(self, batches: Sequence[tuple[list[Any], Any]] = ()):
        super().__init__()
        self.batches = batches
        self._found: dict[Any, tuple[Any, int]] | None = None  # where each batched key is, once asked for

    def __missing__(self, key: Any) -> Any:
        s, i = self._where()[key]
        acc = self[key] = s.accumulator(i)
        return acc

    def _where(self) -> dict[Any, tuple[Any, int]]:
        if self._found is None:
            self._found = {key: (s, i) for keys, s in self.batches for i, key in enumerate(keys)}
        return self._found

    @property
    def batched_count(self) -> int:
        """How many keys were measured among small tensors."""
        return sum(len(keys) for keys, _ in self.batches)

    def batched(self, key: Any) -> bool:
        """Whether `key` was measured among small tensors (its accumulator made when asked for)."""
        return key in self._where()


def gathered(raw: np.ndarray, starts: list[int], tensors: list[TensorInfo], dtype: np.dtype) -> np.ndarray:
    """The values of tensors read together, one after another: a view where they lie without gaps, else a copy
    (gaps between them: an .npz's member headers)."""
    end = starts[-1] + tensors[-1].nbytes
    if end - starts[0] == sum(map(_NBYTES, tensors)):
        return raw[starts[0] : end].view(dtype)
    return np.concatenate([raw[s : s + t.nbytes] for s, t in zip(starts, tensors, strict=True)]).view(dtype)


_NBYTES = operator.attrgetter("nbytes")
