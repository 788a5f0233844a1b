"""clipcli trajectory: a run's checkpoints step by step, against exact references; identical steps flagged."""

from __future__ import annotations

import math
import shutil
import struct
from fractions import Fraction

import numpy as np
import pytest

import clipcli
from clipcli.commands.trajectory import natural_key, step_of
from tests.helpers import DATA, js, run, write_st

F32 = np.float32


def exact_norm(arrays) -> float:
    return math.sqrt(sum(Fraction(float(v)) ** 2 for a in arrays for v in np.ravel(a)))


def exact_cosine(a, b) -> float:
    dot = sum(Fraction(float(x)) * Fraction(float(y)) for x, y in zip(np.ravel(a), np.ravel(b), strict=True))
    return float(dot) / (exact_norm([a]) * exact_norm([b]))


@pytest.fixture
def steps(tmp_path):
    """A run at steps 20, 100, 300 (a byte-identical copy of 100) and 1000, written out of natural order."""
    rng = np.random.default_rng(11)
    base = {"layers.0.w": rng.standard_normal((6, 5)), "layers.1.w": rng.standard_normal((4, 4)), "step": None}
    values = {}
    for step in (20, 100, 1000):
        noise = np.random.default_rng(step)
        values[step] = {
            k: (v + noise.standard_normal(v.shape) * step / 1000).astype(F32) if v is not None else np.array(step)
            for k, v in base.items()
        }
        write_st(tmp_path / f"step-{step}.safetensors", values[step])
    shutil.copyfile(tmp_path / "step-100.safetensors", tmp_path / "step-300.safetensors")
    values[300] = values[100]
    return tmp_path, values


def floats(v):
    return [v["layers.0.w"], v["layers.1.w"]]


def test_each_step_against_exact_references(steps):
    d, values = steps
    # the shell's order (lexicographic: 100, 1000, 20, 300) is put in natural order
    report = js("trajectory", *sorted(d.glob("step-*.safetensors")))
    rows = report["checkpoints"]
    assert [r["step"] for r in rows] == [20, 100, 300, 1000]
    order = [20, 100, 300, 1000]
    for i, (row, step) in enumerate(zip(rows, order, strict=True)):
        v = values[step]
        assert math.isclose(row["global_norm"], exact_norm(floats(v)), rel_tol=1e-12)
        assert row["tensor_count"] == 2
        if i == 0:
            assert (row["delta"], row["rel"], row["cosine"], row["cosine_first"]) == (None, None, None, None)
            continue
        prev, first = values[order[i - 1]], values[order[0]]
        delta = exact_norm([a.astype(np.float64) - b for a, b in zip(floats(v), floats(prev), strict=True)])
        assert math.isclose(row["delta"], delta, rel_tol=1e-12, abs_tol=0)
        assert row["rel"] == (0.0 if delta == 0 else pytest.approx(delta / exact_norm(floats(prev)), rel=1e-12))
        flat = lambda x: np.concatenate([a.ravel() for a in floats(x)])  # noqa: E731
        assert math.isclose(row["cosine"], exact_cosine(flat(prev), flat(v)), rel_tol=1e-12)
        assert math.isclose(row["cosine_first"], exact_cosine(flat(first), flat(v)), rel_tol=1e-12)
    assert [r["identical_to_previous"] for r in rows] == [False, False, True, False]
    assert report["identical"] == [str(d / "step-300.safetensors")]
    assert rows[1]["hash"] == rows[2]["hash"] != rows[3]["hash"]


def test_the_hash_is_the_hash_command_s(steps):
    d, _ = steps
    path = d / "step-20.safetensors"
    report = js("trajectory", path, d / "step-100.safetensors")
    assert report["checkpoints"][0]["hash"] == js("hash", path)["checkpoints"][0]["hash"]


def test_a_copy_under_another_format_is_identical_too(steps, tmp_path):
    # content hashes, not bytes: the same tensors as an .npz are the same step
    d, values = steps
    npz = tmp_path / "step-150.npz"
    np.savez(npz, **values[100])
    report = js("trajectory", d / "step-100.safetensors", npz)
    assert report["checkpoints"][1]["identical_to_previous"] is True
    assert report["checkpoints"][1]["delta"] == 0.0


def test_byte_strings_that_differ_are_never_identical_nor_tensors_that_cannot_be_compared(tmp_path):
    # found by a red team: byte strings (then without a content hash) that differ were flagged identical, and
    # files of quantized tensors alone (no values compared) identical by a checkpoint hash of nothing
    a, b, c = (tmp_path / f"step-{i}.npz" for i in (1, 2, 3))
    np.savez(a, f=np.ones(3, F32), x=np.array([b"abc"]))
    np.savez(b, f=np.ones(3, F32), x=np.array([b"abd"]))
    np.savez(c, f=np.ones(3, F32), x=np.array([b"abd"]))
    report = js("trajectory", a, b, c)
    assert [r["identical_to_previous"] for r in report["checkpoints"]] == [False, False, True]
    (tmp_path / "q").mkdir()
    for i in (1, 2):
        shutil.copy(DATA / "torch" / "special.pt", tmp_path / "q" / f"step-{i}.pt")
    steps = js("trajectory", tmp_path / "q" / "step-1.pt", tmp_path / "q" / "step-2.pt")["checkpoints"]
    assert steps[1]["identical_to_previous"] is False  # its quantized tensors were not compared


def test_keep_order_and_steps_from_names(steps):
    d, _ = steps
    given = [d / "step-1000.safetensors", d / "step-20.safetensors"]
    assert [r["step"] for r in js("trajectory", *given)["checkpoints"]] == [20, 1000]
    assert [r["step"] for r in js("trajectory", *given, "--keep-order")["checkpoints"]] == [1000, 20]
    assert sorted(["b10", "b9", "a100", "a20"], key=natural_key) == ["a20", "a100", "b9", "b10"]
    assert step_of("run/ckpt-epoch3-step12000.safetensors") == 12000 and step_of("final.safetensors") is None
    assert step_of("checkpoint-500") == 500


def test_depth_gives_each_group_s_movement(steps):
    d, values = steps
    report = js("trajectory", d / "step-20.safetensors", d / "step-100.safetensors", "--depth", "2")
    groups = {g["name"]: g for g in report["checkpoints"][1]["groups"]}
    assert set(groups) == {"layers.0", "layers.1"}
    a, b = values[20]["layers.1.w"], values[100]["layers.1.w"]
    assert math.isclose(groups["layers.1"]["norm"], exact_norm([b]), rel_tol=1e-12)
    assert math.isclose(groups["layers.1"]["delta"], exact_norm([b.astype(np.float64) - a]), rel_tol=1e-12)
    assert math.isclose(groups["layers.1"]["cosine"], exact_cosine(a, b), rel_tol=1e-12)
    assert all(g["delta"] is None for g in report["checkpoints"][0]["groups"])


def test_table_csv_jobs_and_python_agree(steps):
    d, _ = steps
    paths = sorted(d.glob("step-*.safetensors"))
    table = run("trajectory", *paths).stdout
    assert table.startswith("4 checkpoints; 1 identical to the one before:") and "yes" in table
    csv = run("trajectory", *paths, "--format", "csv").stdout.splitlines()
    assert csv[0].startswith("path,step,name,norm,delta") and len(csv) == 5
    outs = {run("trajectory", *paths, "--format", "json", "--jobs", j).stdout for j in ("1", "2")}
    assert len(outs) == 1
    assert clipcli.trajectory_of(*paths).to_dict() == js("trajectory", *paths)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_or_svg_figure(steps, tmp_path):
    pytest.importorskip("matplotlib")
    d, _ = steps
    paths = sorted(d.glob("step-*.safetensors"))
    png = tmp_path / "t.png"
    assert run("trajectory", *paths, "--plot", png, "-q").exit_code == 0
    assert png_size(png.read_bytes()) == (800, 900)
    svg = tmp_path / "t.svg"
    assert run("trajectory", *paths, "--depth", "2", "--plot", svg, "-q").exit_code == 0
    import xml.etree.ElementTree as ET

    root = ET.fromstring(svg.read_bytes())
    assert root.tag.endswith("svg") and root.get("width") == "576pt" and root.get("height") == "648pt"
    bad = run("trajectory", *paths, "--plot", tmp_path / "t.jpg")
    assert bad.exit_code == 2 and ".png or .svg" in bad.output and not (tmp_path / "t.jpg").exists()


def test_the_readme_figure_is_the_samples_trajectory(tmp_path):
    pytest.importorskip("matplotlib")
    from tests.helpers import SAMPLES

    committed = (SAMPLES / "trajectory.png").read_bytes()
    assert png_size(committed) == (800, 900)
    fresh = tmp_path / "t.png"
    assert (
        run("trajectory", *sorted((SAMPLES / "run").glob("*.safetensors")), "--depth", "3", "--plot", fresh).exit_code
        == 0
    )
    assert png_size(fresh.read_bytes()) == (800, 900)


def test_plot_without_matplotlib_is_a_usage_error_naming_the_extra(steps, tmp_path, monkeypatch):
    import sys

    d, _ = steps
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    done = run("trajectory", d / "step-20.safetensors", d / "step-100.safetensors", "--plot", tmp_path / "t.png")
    assert done.exit_code == 2 and "pip install 'clipcli[plot]'" in done.output
    assert not (tmp_path / "t.png").exists()


def test_an_unreadable_step_is_exit_3(steps, tmp_path):
    d, _ = steps
    broken = tmp_path / "step-50.safetensors"
    broken.write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    done = run("trajectory", d / "step-20.safetensors", broken)
    assert done.exit_code == 3 and "LFS" in done.output


def test_checkpoints_without_a_tensor_in_common_have_no_movement_measured(steps, tmp_path):
    # found by a new user: two checkpoints sharing no tensor showed |Δ| 0 ("did not move")
    d, _ = steps
    other = write_st(tmp_path / "step-50.safetensors", {"head.w": np.ones(3, F32)})
    report = js("trajectory", d / "step-20.safetensors", other)
    row = report["checkpoints"][1]
    assert (row["delta"], row["rel"], row["cosine"], row["cosine_first"]) == (None, None, None, None)
    assert row["identical_to_previous"] is False


def test_the_table_in_ascii_names_delta_in_words(steps):
    # found by a new user: an ASCII terminal showed the escape |\u0394|
    import subprocess
    import sys

    d, _ = steps
    env = {"PYTHONIOENCODING": "ascii", "NO_COLOR": "1", "PATH": "/usr/bin:/bin"}
    code = "import sys; from clipcli.cli import main; sys.argv[0] = 'clipcli'; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, "trajectory", d / "step-20.safetensors", d / "step-100.safetensors"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "|delta|" in done.stdout and "\\u" not in done.stdout
