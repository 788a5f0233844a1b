"""A format is one module and one registry line: a format defined here, registered with one call, reads
through the command line like any other."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from clipcli.checkpoint import Format, TensorInfo, register
from clipcli.checkpoint.registry import unregister
from clipcli.checkpoint.source import Store
from clipcli.checkpoint.tensor import Span
from clipcli.cli import app

ENV = {"NO_COLOR": "1", "COLUMNS": "100", "TERMINAL_WIDTH": "100"}
MAGIC = b"CLIPRAW1\n"


def open_raw(path: Path, store: Store) -> tuple[dict[str, str], list[TensorInfo]]:
    """A raw file: a magic line, a line `name dtype dims` for each tensor, `end`, then their bytes in order."""
    with store.open(path) as f:  # every byte through the store, as the formats read them
        data = f.read()
    lines = data.split(b"\n")
    assert lines[0] + b"\n" == MAGIC
    tensors, offset = [], len(MAGIC)
    specs = []
    for line in lines[1:]:
        offset += len(line) + 1
        if line == b"end":
            break
        name, dtype, dims = line.decode().split(" ")
        specs.append((name, np.dtype(dtype), tuple(int(d) for d in dims.split(",") if d)))
    for name, dtype, shape in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        tensors.append(TensorInfo(name, dtype.name, shape, nbytes, str(path), dtype, False, Span(offset)))
        offset += nbytes
    return {}, tensors


RAW = Format(
    "raw",
    (".raw",),
    sniff=lambda head, f=None: head.startswith(MAGIC),
    describe=lambda head: "a raw file" if head.startswith(MAGIC) else None,
    open_file=open_raw,
)


@pytest.fixture
def raw_format():
    register(RAW)
    yield
    unregister("raw")


def write_raw(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    header = b"".join(f"{n} {a.dtype.str} {','.join(map(str, a.shape))}\n".encode() for n, a in tensors.items())
    path.write_bytes(
        MAGIC + header + b"end\n" + b"".join(a.astype(a.dtype.newbyteorder("<")).tobytes() for a in tensors.values())
    )
    return path


def ok(*args: object) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args], env=ENV)
    assert result.exit_code == 0, result.output
    return result.stdout


TENSORS = {
    "w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "b": np.array([1.5, -2.0, 0.25], dtype=np.float64),
    "step": np.array(3, dtype=np.int64),
}


def test_inspect_lists_a_registered_format(tmp_path: Path, raw_format) -> None:
    src = write_raw(tmp_path / "model.raw", TENSORS)
    out = json.loads(ok("inspect", src, "--format", "json"))
    (c,) = out["checkpoints"]
    assert c["format"] == "raw"
    assert [t["name"] for t in c["tensors"]] == list(TENSORS)
    assert [t["shape"] for t in c["tensors"]] == [list(a.shape) for a in TENSORS.values()]


def test_global_norm_of_a_registered_format(tmp_path: Path, raw_format) -> None:
    src = write_raw(tmp_path / "model.raw", TENSORS)
    (c,) = json.loads(ok("global-norm", src, "--format", "json"))["checkpoints"]
    floats = [a for a in TENSORS.values() if a.dtype.kind == "f"]
    expected = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in floats))
    assert c["global_norm"] == pytest.approx(expected, rel=1e-12)


def test_convert_a_registered_format_to_safetensors(tmp_path: Path, raw_format) -> None:
    src = write_raw(tmp_path / "model.raw", TENSORS)
    ok("convert", src, "-o", tmp_path / "model.safetensors")
    back = load_file(tmp_path / "model.safetensors")
    assert set(back) == set(TENSORS)
    for name, a in TENSORS.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape
        np.testing.assert_array_equal(back[name], a)


def test_a_registered_format_is_sniffed_without_its_suffix(tmp_path: Path, raw_format) -> None:
    src = write_raw(tmp_path / "model.weights", TENSORS)
    (c,) = json.loads(ok("inspect", src, "--format", "json"))["checkpoints"]
    assert c["format"] == "raw"


def test_every_builtin_format_is_named_once() -> None:
    """The registry's line of each format (read without importing it) agrees with the format's own record."""
    from clipcli.checkpoint import registry

    for name, module, suffixes, directory in registry._BUILTIN:
        fmt = registry.get(name)
        assert (fmt.name, fmt.suffixes, fmt.recognises is not None) == (name, suffixes, directory), module


def test_inspect_of_a_safetensors_file_imports_no_other_format(tmp_path: Path) -> None:
    # the registry imports one format a run: PyTorch's reader and its unpickler, zipfile, the others wait
    import subprocess
    import sys

    save = "from safetensors.numpy import save_file; import numpy as np; "
    save += f"save_file({{'w': np.ones(3, np.float32)}}, {str(tmp_path / 'm.safetensors')!r})"
    subprocess.run([sys.executable, "-c", save], check=True)
    code = (
        "import sys; from clipcli.cli import main\n"
        f"try: main(['inspect', {str(tmp_path / 'm.safetensors')!r}])\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('clipcli.checkpoint.formats.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # (not safetensors' checking parse, `_strict_json`: a header the reference writer wrote takes the compact one)
    loaded = ["clipcli.checkpoint.formats._common", "clipcli.checkpoint.formats.safetensors"]
    assert done.stdout.strip().splitlines()[-1] == str(loaded)


def test_writing_a_format_that_is_read_only_names_it(tmp_path: Path, raw_format) -> None:
    # found by a new user: a registered read-only format's output was refused as "PyTorch files"
    src = write_raw(tmp_path / "model.raw", TENSORS)
    for output in (["-o", tmp_path / "out.raw"], ["--in-place"]):
        result = CliRunner().invoke(app, ["clip-value", str(src), *map(str, output), "--min", "0", "--max", "1"])
        assert result.exit_code == 2
        assert "clipcli reads raw files but does not write them; " in result.stderr, result.stderr
    assert not (tmp_path / "out.raw").exists()
