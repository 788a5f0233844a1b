"""A distributed checkpoint's chunk layouts: whether the chunks of a tensor tile it exactly, checked in bounded work."""

from __future__ import annotations

import math

from clipcli.errors import UnsupportedError

# Chunk layouts are checked by a sweep that splits the chunks at their bounds, one dimension after another
# (see layout_error): real sharding splits one to three dimensions, and its chunks' bounds meet, so the
# sweep's work is a few steps a chunk. More dimensions than this, or more steps, are refused.
_MAX_SPLIT_DIMS = 16
_MAX_SWEEP_STEPS = 1 << 22
_MAX_PAIR_CHECKS = 1_000_000  # comparisons spent naming two overlapping chunks in a message


def layout_error(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """Why the chunks (offsets, sizes) do not tile a tensor of `shape` exactly, or None when they do.

    Each chunk must lie inside the tensor; then the chunks tile it iff their indicator functions, less the
    tensor's, add up to zero (every element covered exactly once): see `_adds_to_zero`. Dimensions that
    every chunk spans whole drop out, and so do empty chunks.
    """
    for offsets, sizes in boxes:
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            return f"the chunk at offsets {offsets} with shape {sizes} runs past the tensor's shape {shape}"
    total = math.prod(shape)
    if total == 0:  # every chunk inside an empty tensor is empty
        return None
    full = [(offsets, sizes) for offsets, sizes in boxes if math.prod(sizes)]
    covered = sum(math.prod(sizes) for _, sizes in full)
    if covered < total:
        return f"the chunks hold {covered} of the tensor's {total} elements: they leave a hole"
    if covered > total:
        return f"the chunks hold {covered} elements, more than the tensor's {total}: {_overlap(full)}"
    split = [d for d, n in enumerate(shape) if any(offsets[d] or sizes[d] != n for offsets, sizes in full)]
    if len(split) > _MAX_SPLIT_DIMS:
        raise UnsupportedError(
            f"{len(full)} chunks that split {len(split)} dimensions: more than clipcli checks for overlaps"
        )
    weights: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for offsets, sizes, sign in [*((o, s, 1) for o, s in full), ((0,) * len(shape), shape, -1)]:
        box = (tuple(offsets[d] for d in split), tuple(offsets[d] + sizes[d] for d in split))
        weights[box] = weights.get(box, 0) + sign
    if _adds_to_zero({box: w for box, w in weights.items() if w}, [_MAX_SWEEP_STEPS]):
        return None
    return f"{_overlap(full)}, and so leave a hole"


def _adds_to_zero(
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], int], budget: list[int], known: set | None = None
) -> bool:
    """Whether boxes ([lo, hi) per dimension) times their weights add up to zero everywhere.

    Along the first dimension the sum is a step function of boxes over the other dimensions: zero
    everywhere iff each step is, the boxes that begin at a coordinate less those that end there. Boxes
    equal in the other dimensions cancel before going on (one chunk ending where the next begins, as
    every sharding lays them), so a sharding's chunks take a few steps each. A step found zero before
    (or its negative: a step up and a step down) is not checked again, and `budget` (steps left) bounds
    what crafted layouts cost.

    Raises:
        UnsupportedError: when the budget runs out.
    """
    known = set() if known is None else known
    if not boxes:
        return True
    if not next(iter(boxes))[0]:  # no dimension left, and a weight that is not zero
        return False
    steps: dict[int, dict[tuple[tuple[int, ...], tuple[int, ...]], int]] = {}
    for (lo, hi), w in boxes.items():
        budget[0] -= 1
        if budget[0] < 0:
            raise UnsupportedError("chunks laid out so that checking them for overlaps takes more than clipcli spends")
        rest = (lo[1:], hi[1:])
        for at, weight in ((lo[0], w), (hi[0], -w)):
            step = steps.setdefault(at, {})
            total = step.pop(rest, 0) + weight
            if total:
                step[rest] = total
    for step in steps.values():
        key = frozenset(step.items())
        if key in known:
            continue
        if not _adds_to_zero(step, budget, known):
            return False
        known.update((key, frozenset((box, -w) for box, w in step.items())))
    return True


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """Names two chunks that overlap, found by a sweep along the first dimension (bounded in work)."""
    if boxes and not boxes[0][0]:  # a 0-d tensor: any two chunks are the same element
        return "the tensor's one element is saved more than once"
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    budget = _MAX_PAIR_CHECKS
    for offsets, sizes in sorted(boxes):
        active = [(o, s) for o, s in active if o[0] + s[0] > offsets[0]]
        budget -= 1 + len(active)
        if budget < 0:
            break
        for o, s in active:
            if all(a < b + m and b < a + n for a, n, b, m in zip(offsets, sizes, o, s, strict=True)):
                return f"the chunks at offsets {o} and {offsets} overlap"
        active.append((offsets, sizes))
    return "the chunks overlap"
