"""Strided views and distributed checkpoints under hostile or heavy layouts."""

from __future__ import annotations

import itertools
import json
import math
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from clipcli.checkpoint import Checkpoint, TensorInfo, open_checkpoint
from clipcli.checkpoint.tensor import Piece, Pieces
from clipcli.cli import app
from clipcli.errors import MalformedError, UnsupportedError
from tests.helpers import (
    PickleCall,
    PickleGlobal,
    dcp_checkpoint,
    dcp_two_regions,
    run_bounded,
    torch_view,
    torch_zip,
)


def cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"NO_COLOR": "1", "COLUMNS": "100"})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def view_file(path, storage: np.ndarray, shape, strides, offset=0):
    """A torch.save file of one view (`shape`, `strides` and `offset` in elements) of `storage`'s bytes."""
    obj = torch_view(storage.dtype.name, storage.size, tuple(shape), tuple(strides), offset)
    path.write_bytes(torch_zip(obj, {"0": storage.tobytes()}))
    return path


def numpy_view(storage: np.ndarray, shape, strides, offset=0) -> np.ndarray:
    item = storage.itemsize
    return np.lib.stride_tricks.as_strided(storage[offset:], shape, [s * item for s in strides])


# -- Strided views streamed, never materialized -----------------------------------------------------------


def test_an_expanded_scalar_is_normed_in_bounded_memory(tmp_path):
    # issue 22 item 6: torch.save(x.expand(2**29)) (a 4-byte storage) took 2 GB: its view was made whole
    n = 1 << 29
    path = tmp_path / "expand.pt"
    path.write_bytes(torch_zip(torch_view("float32", 1, (n,), (0,)), {"0": struct.pack("<f", 3.0)}))
    r = run_bounded("global-norm", path, "--format", "json", seconds=60, memory_mb=1500)
    assert r.returncode == 0, r
    assert json.loads(r.stdout)["checkpoints"][0]["global_norm"] == math.sqrt(9.0 * n)  # exact
    assert r.peak_mb < 300, r
    assert r.seconds < 30, r


@pytest.mark.parametrize(
    ("views", "storage"),
    [
        ([((100_000, 100_000), (0, 0))], 1),  # found by a red team: torch.ones(1).expand(10**5, 10**5), 12.6 s
        ([((500,) * 4, (1,) * 4)], 2000),  # as_strided over 2,000 floats: 6.25 * 10**10 values, never finished
        ([((2**31 - 1, 2**31 - 1), (0, 0))], 1),  # 4.6 * 10**18 values
        ([((2**29,), (0,))] * 2, 1),  # each within the slack (2 GiB), not both
        ([((1 << 18,), (1,))] * 3000, 1 << 18),  # 3,000 names on one 1 MiB storage: 3 GiB (found by a review)
    ],
)
def test_passes_over_far_more_values_than_the_files_hold_are_refused_at_once(tmp_path, views, storage):
    # a file may not cost more time than its bytes justify: every command streams each value a view shows
    obj = {f"v{i}": torch_view("float32", storage, shape, strides) for i, (shape, strides) in enumerate(views)}
    obj["w"] = torch_view("float32", storage, (1,), (1,))
    path = tmp_path / "repeat.pt"
    path.write_bytes(torch_zip(obj, {"0": bytes(4 * storage)}))
    assert run_bounded("inspect", path, seconds=20).returncode == 0  # listed (with its pickle's audit)
    for command in ("global-norm", "hash", "stats"):
        r = run_bounded(command, path, seconds=20, memory_mb=500)
        assert r.returncode == 3 and r.seconds < 5, r
        assert r.stderr.count("\n") == 1 and "a file may not cost more than its bytes justify" in r.stderr, r
    r = run_bounded("global-norm", path, "--exclude", "v*", seconds=20)
    assert r.returncode == 0, r  # the others read
    for out in ("out.npz", "out.safetensors"):  # a write too, copies included (found by a review: .npz, 21 GB)
        r = run_bounded("convert", path, "-o", tmp_path / out, seconds=20)
        assert r.returncode == 3 and "a file may not cost more than its bytes justify" in r.stderr, r
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repeat.pt"]


@pytest.mark.parametrize(("names", "refused"), [(12, False), (64, False), (65, True)])
def test_the_bound_is_64_times_the_files_bytes(tmp_path, monkeypatch, names, refused):
    # found by a review: nn.Sequential(*[lin] * 12) (12 names on one 676 MB storage) was refused at 8x the file
    from clipcli.commands import passes

    monkeypatch.setattr(passes, "EXPANSION_SLACK", 0)  # (the 2 GiB of slack would need a file of 200 MB)
    obj = {f"{i}.weight": torch_view("float32", 1 << 18, (512, 512), (512, 1)) for i in range(names)}
    path = tmp_path / "shared.pt"
    path.write_bytes(torch_zip(obj, {"0": bytes(1 << 20)}))  # ~1 MiB, the pickle's bytes besides
    with open_checkpoint(path) as ckpt:
        if refused:
            with pytest.raises(MalformedError, match="more than 64 times as many"):
                passes.check_cost(ckpt, ckpt.tensors)
        else:
            passes.check_cost(ckpt, ckpt.tensors)


def test_a_distributed_checkpoint_of_a_stride_0_chunk_is_refused_at_once(tmp_path):
    # found by a review: a 12 KB DCP whose one chunk is a stride-0 view of 10**10 values took 11.9 s, exit 0
    n = 10**10
    dcp_checkpoint(tmp_path / "big", {"e": ((n,), [((0,), np.ones(1, np.float32), ((n,), (0,)))])})
    r = run_bounded("global-norm", tmp_path / "big", seconds=20)
    assert r.returncode == 3 and r.seconds < 5 and "a file may not cost more than its bytes justify" in r.stderr, r


def test_a_view_past_the_limit_never_hides_the_pickles_calls(tmp_path):
    # found by a review: a file refused at open for its view showed no audit, so os.system went unnamed
    obj = {"e": torch_view("float32", 1, (1 << 30,), (0,)), "x": PickleCall(PickleGlobal("os", "system"), ("true",))}
    path = tmp_path / "evil.pt"
    path.write_bytes(torch_zip(obj, {"0": bytes(4)}))
    r = run_bounded("inspect", path, "--fail-unsafe-pickle", seconds=20)
    assert r.returncode == 1 and "torch.load would call os.system" in r.stderr, r
    r = run_bounded("global-norm", path, seconds=20)
    assert r.returncode == 3 and "torch.load would call os.system" in r.stderr, r


@pytest.mark.parametrize(
    ("shape", "strides", "offset"),
    [
        ((50, 30), (1, 50), 0),  # a transpose
        ((3, 4, 5), (1, 3, 12), 0),  # the axes reversed
        ((10, 7), (14, 2), 3),  # every other row and column, from an offset
        ((4, 6), (0, 1), 2),  # a row repeated (expand)
        ((2, 1, 3, 1), (0, 5, 1, 9), 1),  # dimensions of one element with any stride
        ((5, 3), (1, 0), 0),  # each value repeated
    ],
)
def test_views_read_as_numpy_sees_them(tmp_path, shape, strides, offset):
    # issue 22 item 6: views are read chunk by chunk from their storage; the values are NumPy's
    storage = np.arange(2000, dtype=np.float32) - 777.5
    path = view_file(tmp_path / "v.pt", storage, shape, strides, offset)
    want = numpy_view(storage, shape, strides, offset)
    with open_checkpoint(path) as ckpt:
        (t,) = ckpt.tensors
        assert np.array_equal(ckpt.read(t), want)
        for max_bytes in (4, 12, 40, 1 << 20):
            got = np.concatenate([c.copy() for c in ckpt.chunks(t, max_bytes)])
            assert np.array_equal(got, want.reshape(-1))
    code, _, err = cli("convert", path, "-o", tmp_path / "v.safetensors", "--quiet")
    assert code == 0, err
    with open_checkpoint(tmp_path / "v.safetensors") as out:
        assert np.array_equal(out.read(out.tensors[0]), want)


def test_views_torch_saves_read_as_torch_sees_them(tmp_path):
    # issue 22 item 6: the same, against real torch's views (transposes, permutes, slices, expands, unfold)
    torch = pytest.importorskip("torch")
    x = torch.randn(6, 7, 5)
    views = {
        "t": x.transpose(0, 2),
        "p": x.permute(1, 2, 0),
        "s": x[::2, 1::3],
        "e": torch.randn(1, 5).expand(4, 5),
        "e0": torch.tensor(3.0).expand(3, 4),
        "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "d": x.diagonal(dim1=0, dim2=1),
        "u": torch.arange(24.0).reshape(4, 6).unfold(1, 3, 2),
        "h": torch.randn(8, 3).half()[1::3].t(),
    }
    torch.save(views, tmp_path / "views.pt")
    with open_checkpoint(tmp_path / "views.pt") as ckpt:
        for t in ckpt.tensors:
            want = views[t.name].contiguous().numpy()
            assert np.array_equal(ckpt.read(t), want), t.name
            assert np.array_equal(np.concatenate([c.copy() for c in ckpt.chunks(t, 16)]), want.reshape(-1)), t.name


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_strided_view_reads_right(tmp_path_factory, data):
    # issue 22 item 6: any view (non-negative strides, gaps, repeats, another order), any chunk size
    shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    strides = tuple(data.draw(st.integers(0, 40)) for _ in shape)
    offset = data.draw(st.integers(0, 3))
    span = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1 if math.prod(shape) else 1
    storage = np.random.default_rng(0).standard_normal(max(span, 1))
    path = view_file(tmp_path_factory.mktemp("view") / "v.pt", storage, shape, strides, offset)
    want = numpy_view(storage, shape, strides, offset).reshape(-1)
    with open_checkpoint(path) as ckpt:
        (t,) = ckpt.tensors
        max_bytes = data.draw(st.sampled_from([8, 24, 56, 4096]))
        got = [c.copy() for c in ckpt.chunks(t, max_bytes)]
        assert np.array_equal(np.concatenate(got) if got else np.empty(0), want)


def test_a_transposed_view_is_held_once_not_copied_whole(tmp_path):
    # issue 22 item 6: a transposed view was read whole, then copied whole into C order (twice its bytes)
    storage = np.random.default_rng(1).standard_normal(1 << 24).astype(np.float32)  # 64 MiB
    path = view_file(tmp_path / "t.pt", storage, (4096, 4096), (1, 4096))
    r = run_bounded("convert", path, "-o", tmp_path / "t.safetensors", "--quiet", seconds=60, memory_mb=1500)
    assert r.returncode == 0, r
    assert r.peak_mb < 64 + 80, r  # its storage's bytes, once, and chunks (before: 2 x 64 MiB more)
    with open_checkpoint(tmp_path / "t.safetensors") as out:
        assert np.array_equal(out.read(out.tensors[0]), storage.reshape(4096, 4096).T)


def test_strided_chunks_of_a_distributed_checkpoint_are_not_put_together_whole(tmp_path):
    # issue 22 item 6: a tensor with a strided (transposed) chunk was put together whole in memory
    w = np.random.default_rng(4).standard_normal((2048, 4096)).astype(np.float32)  # 32 MiB in 4 chunks
    chunks = [
        ((k * 512, 0), np.ascontiguousarray(w[k * 512 : (k + 1) * 512].T), ((512, 4096), (1, 512))) for k in range(4)
    ]
    ckpt = dcp_checkpoint(tmp_path / "dcp", {"w": (w.shape, chunks)})
    r = run_bounded("convert", ckpt, "-o", tmp_path / "w.safetensors", "--quiet", seconds=60, memory_mb=1500)
    assert r.returncode == 0, r
    assert r.peak_mb < 75, r  # one chunk's bytes (8 MiB) and a few reads' (before: the whole 32 MiB more)
    with open_checkpoint(tmp_path / "w.safetensors") as out:
        assert out.read(out.tensors[0]).tobytes() == w.tobytes()


def _grid(shape, cuts):
    """The pieces (offsets, sizes) of the grid that `cuts` (per dimension) make."""
    bounds = [sorted({0, n, *(c for c in cut if 0 < c < n)}) for n, cut in zip(shape, cuts, strict=True)]
    for corner in itertools.product(*[list(itertools.pairwise(b)) for b in bounds]):
        yield tuple(a for a, _ in corner), tuple(b - a for a, b in corner)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), data=st.data())
def test_strided_pieces_stream_right(tmp_path_factory, shape, data):
    # issue 22 item 6: a distributed checkpoint's strided chunks (transposed) were put together whole
    tmp_path = tmp_path_factory.mktemp("pieces")
    array = np.random.default_rng(0).standard_normal(shape)
    cuts = tuple(data.draw(st.lists(st.integers(1, n), max_size=2)) for n in shape)
    placed = []
    with open(tmp_path / "a.bin", "wb") as f:
        for offsets, sizes in _grid(shape, cuts):
            block = array[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
            transposed = data.draw(st.booleans())
            strides = tuple(s // 8 for s in np.asfortranarray(block).strides) if transposed else None
            placed.append(Piece(offsets, sizes, str(tmp_path / "a.bin"), f.tell(), strides and (strides, block.nbytes)))
            f.write(block.tobytes(order="F" if transposed else "C"))
    location = Pieces(shape, 8, tuple(placed))
    info = TensorInfo("t", "float64", shape, array.nbytes, str(tmp_path / "a.bin"), array.dtype, location=location)
    with Checkpoint(tmp_path, "distcp", {}, [info], [tmp_path / "a.bin"]) as ckpt:
        max_bytes = data.draw(st.sampled_from([8, 24, 40, 4096]))
        got = np.concatenate([c.copy() for c in ckpt.chunks(info, max_bytes)])
    assert got.tobytes() == array.tobytes()


# -- Distributed checkpoints of many chunks --------------------------------------------------------------


def test_a_layout_splitting_many_dimensions_is_checked_quickly(tmp_path):
    # issue 22 item 7: the tiling check walked 2**k corners a chunk (256 chunks, 15 dimensions: 48 s)
    shape, chunks = dcp_two_regions(7)
    ckpt = dcp_checkpoint(tmp_path / "dcp", {"t": (shape, chunks)})
    r = run_bounded("global-norm", ckpt, "--format", "json", seconds=20, memory_mb=1000)
    assert r.returncode == 0, r
    assert json.loads(r.stdout)["checkpoints"][0]["global_norm"] == math.sqrt(2**15)
    assert r.seconds < 10, r
    shape, chunks = dcp_two_regions(7, bump=True)
    ckpt = dcp_checkpoint(tmp_path / "bumped", {"t": (shape, chunks)})
    r = run_bounded("global-norm", ckpt, seconds=20, memory_mb=1000)
    assert r.returncode == 3, r
    assert r.stderr.count("clipcli: error:") == 1 and "overlap, and so leave a hole" in r.stderr, r
    assert r.seconds < 10, r


def test_column_shards_are_read_right_and_fast(tmp_path):
    # issue 22 item 7: a column shard was read one row at a time (a Python step and a preadv each: 19 s here)
    rows = 1 << 20
    w = np.random.default_rng(3).standard_normal((rows, 8)).astype(np.float32)
    ckpt = dcp_checkpoint(
        tmp_path / "dcp", {"w": ((rows, 8), [((0, 2 * k), w[:, 2 * k : 2 * k + 2]) for k in range(4)])}
    )
    r = run_bounded("global-norm", ckpt, "--format", "json", seconds=30, memory_mb=1000)
    assert r.returncode == 0, r
    assert r.seconds < 8, r
    norm = json.loads(r.stdout)["checkpoints"][0]["global_norm"]
    assert norm == pytest.approx(math.sqrt(math.fsum((w.astype(np.float64) ** 2).ravel())), rel=1e-15)
    with open_checkpoint(ckpt) as got:
        assert got.read(got.tensors[0]).tobytes() == w.tobytes()


def test_a_read_looks_only_at_the_chunks_it_touches(tmp_path):
    # issue 22 item 7: every read scanned every chunk (4,096 row chunks read a row at a time: over a minute)
    w = np.tile(np.random.default_rng(5).standard_normal((8, 1024)).astype(np.float32), (512, 1))  # 8 rows' files
    ckpt = dcp_checkpoint(tmp_path / "dcp", {"w": (w.shape, [((i, 0), w[i : i + 1]) for i in range(4096)])})
    with open_checkpoint(ckpt) as got:
        start = time.monotonic()
        values = np.concatenate([c.copy() for c in got.chunks(got.tensors[0], max_bytes=4096)])
        assert time.monotonic() - start < 5
    assert values.tobytes() == w.tobytes()


def test_one_byte_range_named_by_many_items_is_read_once(tmp_path):
    # issue 22 item 7: 8,000 items naming one 400 KB torch.save file parsed it 8,000 times (exit 70, 1.9 GB)
    names = tuple(f"item{i}" for i in range(8000))
    ckpt = dcp_checkpoint(tmp_path / "dcp", {"w": ((2,), [((0,), np.ones(2, np.float32))])}, {names: "x" * 400_000})
    r = run_bounded("global-norm", ckpt, seconds=30, memory_mb=1000)
    assert r.returncode == 0, r
    assert r.seconds < 10 and r.peak_mb < 300, r


def test_names_fanned_out_through_one_byte_range_are_refused(tmp_path):
    # issue 22 item 7: 8,000 items naming one list of 20,000 values would make 160 M names (exit 70 at 1.9 GB)
    names = tuple(f"item{i}" for i in range(8000))
    ckpt = dcp_checkpoint(tmp_path / "dcp", {"w": ((2,), [((0,), np.ones(2, np.float32))])}, {names: [0.5] * 20000})
    r = run_bounded("global-norm", ckpt, seconds=30, memory_mb=1000)
    assert r.returncode == 3, r
    assert r.stderr.count("clipcli: error:") == 1 and "named by so many entries" in r.stderr, r
    assert r.seconds < 10 and r.peak_mb < 400, r


# -- More dimensions than NumPy holds --------------------------------------------------------------------


SHAPE_70 = (1,) * 34 + (3,) + (1,) * 34 + (4,)


def _npy_70(path, values: np.ndarray):
    """A Fortran-order .npy of SHAPE_70 holding `values` (3, 4)."""
    header = f"{{'descr': '<f4', 'fortran_order': True, 'shape': {SHAPE_70}, }}".encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + values.tobytes(order="F"))
    return path


def test_seventy_dimensions_read_convert_and_diff(tmp_path):
    # issue 22 item 11: a 70-dimensional view or Fortran-order .npy exited 70 in NumPy's as_strided / reshape
    storage = np.arange(12, dtype=np.float32) - 5
    want = np.lib.stride_tricks.as_strided(storage, (3, 4), (4, 12))  # the view: a transpose
    view = view_file(tmp_path / "v.pt", storage, SHAPE_70, (5,) * 34 + (1,) + (7,) * 34 + (3,))
    (tmp_path / "n").mkdir()
    (tmp_path / "c").mkdir()
    fortran = _npy_70(tmp_path / "n" / "v.npy", want)
    contiguous = view_file(tmp_path / "c" / "v.pt", np.ascontiguousarray(want).ravel(), SHAPE_70, (4,) * 35 + (1,) * 35)
    norm = math.sqrt(float((want.astype(np.float64) ** 2).sum()))
    for source in (view, fortran):
        r = run_bounded("global-norm", source, "--format", "json", seconds=30)
        assert r.returncode == 0, r
        assert json.loads(r.stdout)["checkpoints"][0]["global_norm"] == pytest.approx(norm, rel=1e-15)
        out = tmp_path / f"{source.suffix[1:]}.safetensors"
        r = run_bounded("convert", source, "-o", out, "--quiet", seconds=30)
        assert r.returncode == 0, r
        with open_checkpoint(out) as got:
            (t,) = got.tensors
            assert t.shape == SHAPE_70 and got.read_flat(t).tobytes() == want.tobytes()
    for a, b in ((view, contiguous), (fortran, tmp_path / "pt.safetensors"), (view, fortran)):
        r = run_bounded("diff", a, b, "--fail-different", "--format", "json", seconds=30)
        assert r.returncode == 0, r
    with open_checkpoint(fortran) as ckpt, pytest.raises(UnsupportedError, match="70 dimensions, more than a NumPy"):
        ckpt.read(ckpt.tensors[0])
    r = run_bounded("clip-norm", view, "-o", tmp_path / "x.safetensors", "--clip-norm", "1", "--axes", "0")
    assert r.returncode == 3 and r.stderr.count("clipcli: error:") == 1, r
    assert "--axes on 70 dimensions" in r.stderr


# -- A distributed checkpoint clips like any PyTorch input ------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_distributed_checkpoint_clips_like_its_conversion(tmp_path, suffix):
    # issue 22 item 23: clipping a distributed checkpoint was refused ("convert it first"), dry runs too
    w = np.random.default_rng(2).standard_normal((6, 10)).astype(np.float32)
    b = np.linspace(-3, 3, 7)
    ckpt = dcp_checkpoint(
        tmp_path / "dcp",
        {"w": ((6, 10), [((0, 0), w[:, :4]), ((0, 4), w[:, 4:])]), "b": ((7,), [((0,), b[:3]), ((3,), b[3:])])},
    )
    code, _, err = cli("convert", ckpt, "-o", tmp_path / "whole.safetensors", "--quiet")
    assert code == 0, err
    for source, out in ((ckpt, tmp_path / f"dcp{suffix}"), (tmp_path / "whole.safetensors", tmp_path / f"ref{suffix}")):
        code, _, err = cli("clip-global-norm", source, "-o", out, "--clip-norm", "2", "--quiet")
        assert code == 0, err
    with open_checkpoint(tmp_path / f"dcp{suffix}") as got, open_checkpoint(tmp_path / f"ref{suffix}") as want:
        assert [t.name for t in got.tensors] == ["w", "b"]
        for t, u in zip(got.tensors, want.tensors, strict=True):
            assert got.read(t).tobytes() == want.read(u).tobytes()
    code, out, err = cli("clip-global-norm", ckpt, "--dry-run", "--clip-norm", "2", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["checkpoints"][0]["global_norm"] == pytest.approx(
        math.sqrt(float((w.astype(float) ** 2).sum() + (b**2).sum()))
    )
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp"]


def test_write_costs_are_checked_before_anything_is_written(tmp_path):
    # found by a review: clip-global-norm of several wrote the first output, then refused the second's cost; a
    # dry run passed what its write refused; a .pt output, which keeps tied names on one storage, was refused
    small = tmp_path / "a.pt"
    small.write_bytes(torch_zip({"w": torch_view("float32", 4, (4,), (1,))}, {"0": np.full(4, 10, "f4").tobytes()}))
    big = tmp_path / "b.pt"
    obj = {"x": torch_view("float32", 4, (1 << 29, 4), (0, 1)), "w": torch_view("float32", 4, (4,), (1,))}
    big.write_bytes(torch_zip(obj, {"0": np.full(4, 10, "f4").tobytes()}))
    before = small.read_bytes()
    args = ("clip-global-norm", small, big, "--exclude", "x", "--clip-norm", "1", "--prefix-with-file")
    r = run_bounded(*args, "--in-place", seconds=20)
    assert r.returncode == 3 and "may not cost more" in r.stderr and small.read_bytes() == before, r
    r = run_bounded("clip-value", big, "--include", "w", "--min", "0", "--max", "1", "--dry-run", seconds=20)
    assert r.returncode == 3 and "may not cost more" in r.stderr, r
    tied = tmp_path / "tied.pt"  # 3,000 names on one 1 MiB storage: 3 GiB written to .safetensors, 1 MiB to .pt
    names = {f"layer{i}.weight": torch_view("float32", 1 << 18, (512, 512), (512, 1)) for i in range(3000)}
    tied.write_bytes(torch_zip(names, {"0": bytes(1 << 20)}))
    assert run_bounded("convert", tied, "-o", tmp_path / "t.pt", seconds=60).returncode == 0
    r = run_bounded("convert", tied, "-o", tmp_path / "t.safetensors", seconds=20)
    assert r.returncode == 3 and not (tmp_path / "t.safetensors").exists(), r
