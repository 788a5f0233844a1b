"""`hash`: each selected tensor's content hash over its canonical form, and the checkpoint's hash over them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clipcli.checkpoint import Checkpoint, TensorInfo, byte_layout, c_order_blocks, transposed
from clipcli.commands import passes
from clipcli.commands.audit import pickle_audit
from clipcli.commands.passes import NO_PROGRESS, Progress
from clipcli.commands.select import EVERY, Selection, order, partition, without_values
from clipcli.core.hashing import StoredHasher, TensorHasher, checkpoint_hash
from clipcli.report.hash import CheckpointHashes, HashRow


@dataclass(frozen=True)
class HashOptions:
    """What `hash` hashes: the tensors `selection` takes, rows sorted by `sort` (name, size) and cut to `top`,
    with `jobs` workers (tensors hashed in parallel)."""

    selection: Selection = EVERY
    sort: str | None = None
    top: int | None = None
    jobs: int = 1


class HashKernel:
    """A worker's kernel: each tensor it is given whole (`whole`: its chunks in order, in this worker) through
    its hasher; a tensor stored in Fortran order is gathered first, then hashed in C order."""

    whole = True

    def __init__(self) -> None:
        self.digests: dict[str, str] = {}
        self._open: dict[str, tuple[TensorHasher, np.ndarray | None, int]] = {}

    def chunk(self, t: TensorInfo, offset: int, values: np.ndarray) -> None:
        hasher, whole, at = self._open.pop(t.name, None) or (_hasher(t), _whole(t), 0)
        if whole is None:
            hasher.update(values)
        else:
            whole[at : at + values.size] = values
        at += values.size  # (values; bytes of a type carried as bytes)
        if at < (t.size if t.array_dtype is not None else t.nbytes):
            self._open[t.name] = (hasher, whole, at)
        else:
            self.digests[t.name] = _finish(t, hasher, whole)

    def result(self) -> dict[str, str]:
        return self.digests


def reason_to_skip(t: TensorInfo, selection: Selection) -> str | None:
    """Why `hash` leaves a tensor out: not selected, or no values (sparse, quantized, meta); None to hash it (a
    type carried as bytes, which has no canonical form of values, by its bytes as stored)."""
    if t.array_dtype is None and t.skip is None and t.location is not None and selection.listed(t):
        return None
    return without_values(t, selection, "content hash")


def _hasher(t: TensorInfo) -> TensorHasher | StoredHasher:
    """A tensor's hasher: over its canonical values, or a type carried as bytes over its bytes as stored."""
    if t.array_dtype is not None:
        return TensorHasher(t.array_dtype, t.shape)
    descr, fortran = byte_layout(t)
    return StoredHasher(f"{descr or t.dtype} {'F' if fortran else 'C'}", t.shape, t.nbytes)


def hash_checkpoint(
    ckpt: Checkpoint, options: HashOptions = HashOptions(), progress: Progress = NO_PROGRESS
) -> CheckpointHashes:
    """Each selected tensor's SHA-256 over its canonical form (`core.hashing`) and the checkpoint's hash over
    all of them (whatever `sort` and `top` show).

    `jobs` workers hash tensors in parallel, each tensor's chunks in order in one worker (`HashKernel`); a
    tensor stored in Fortran order is gathered whole and hashed in C order (held once, as `convert` holds it
    to write it in C order).

    Raises:
        UsageError: when --include/--exclude select no tensor.
    """
    selection = options.selection
    selected, skipped = partition(ckpt, selection, lambda t: reason_to_skip(t, selection))
    progress.phase("hashing", sum(t.nbytes for t in selected))
    digests: dict[str, str] = {}
    for part in passes.run_pass(ckpt, selected, HashKernel, options.jobs, progress=progress):
        digests.update(part)
    for t in selected:
        if t.name not in digests:  # no chunks: an empty tensor
            digests[t.name] = _hasher(t).hexdigest()
    rows = [HashRow(t.name, t.dtype, t.shape, t.nbytes, digests[t.name]) for t in selected]
    return CheckpointHashes(
        path=str(ckpt.path),
        format=ckpt.format,
        hash=checkpoint_hash((r.name, r.sha256) for r in rows),
        count=len(rows),
        tensors=order(rows, options.sort, options.top),
        skipped=tuple(skipped),
        pickle=pickle_audit(ckpt),
    )


def _whole(t: TensorInfo) -> np.ndarray | None:
    """The array a Fortran-order tensor is gathered into (its storage order is not C order), or None (a type
    carried as bytes is hashed as stored)."""
    return np.empty(t.size, t.array_dtype) if t.array_dtype is not None and transposed(t) else None


def _finish(t: TensorInfo, hasher: TensorHasher | StoredHasher, whole: np.ndarray | None) -> str:
    if whole is not None:
        for block in c_order_blocks(whole, t.shape):
            hasher.update(block)
    return hasher.hexdigest()
