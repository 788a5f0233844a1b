"""Tensors stored in rectangular pieces (a distributed checkpoint's chunks) read in their own C order."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clipcli.checkpoint import Checkpoint, TensorInfo
from clipcli.checkpoint.tensor import Piece, Pieces


def _split(shape, cuts):
    """Rectangular pieces of a tensor of `shape`: the grid that `cuts` (per dimension) makes."""
    bounds = [sorted({0, n, *(c for c in cut if 0 < c < n)}) for n, cut in zip(shape, cuts, strict=True)]
    spans = [list(itertools.pairwise(b)) for b in bounds]
    for corner in itertools.product(*spans):
        yield tuple(a for a, _ in corner), tuple(b - a for a, b in corner)


def _stored(tmp_path, array, cuts, seed=0):
    """The array's pieces written in a shuffled order over two files; a TensorInfo that reads them."""
    pieces = list(_split(array.shape, cuts)) if array.ndim else [((), ())]
    np.random.default_rng(seed).shuffle(pieces)
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    handles = [open(f, "wb") for f in files]  # noqa: SIM115 (closed below)
    placed = []
    for i, (offsets, sizes) in enumerate(pieces):
        block = array[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
        f = handles[i % 2]
        placed.append(Piece(offsets, sizes, str(files[i % 2]), f.tell()))
        f.write(np.ascontiguousarray(block).tobytes())
    for f in handles:
        f.close()
    location = Pieces(array.shape, array.itemsize, tuple(placed))
    info = TensorInfo("t", array.dtype.name, array.shape, array.nbytes, str(files[0]), array.dtype, location=location)
    return Checkpoint(tmp_path, "distcp", {}, [info], files), info


@pytest.mark.parametrize(
    ("shape", "cuts"),
    [
        ((6, 10), ([3], [4])),  # rows, then columns
        ((6, 10), ([], [3, 7])),  # columns only
        ((6, 10), ([1, 2, 5], [])),  # rows only
        ((4, 5, 6), ([2], [], [3])),  # a middle dimension whole
        ((4, 5, 6), ([1, 3], [2], [])),
        ((17,), ([5, 9],)),
        ((), ()),
        ((0, 4), ([], [2])),
    ],
)
def test_pieces_read_in_the_tensors_c_order(tmp_path, shape, cuts):
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    ckpt, info = _stored(tmp_path, array, cuts)
    with ckpt:
        assert ckpt.read(info).tobytes() == array.tobytes()
        for chunk in (4, 12, 28, 1000):
            got = b"".join(c.tobytes() for c in ckpt.chunks(info, max_bytes=chunk))
            assert got == array.tobytes()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple),
    data=st.data(),
)
def test_any_span_of_any_split_reads_right(tmp_path_factory, shape, data):
    tmp_path = tmp_path_factory.mktemp("pieces")
    cuts = tuple(data.draw(st.lists(st.integers(1, n), max_size=2)) for n in shape)
    array = np.random.default_rng(0).standard_normal(shape)
    ckpt, info = _stored(tmp_path, array, cuts, data.draw(st.integers(0, 9)))
    start = data.draw(st.integers(0, array.size - 1))
    stop = data.draw(st.integers(start + 1, array.size))
    buf = np.empty((stop - start) * 8, np.uint8)
    with ckpt:
        ckpt.pread(info, start * 8, buf)
    assert buf.tobytes() == array.reshape(-1)[start:stop].tobytes()
