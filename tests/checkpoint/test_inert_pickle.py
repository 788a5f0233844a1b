"""Pickles that name globals beyond the tensor allowlist (issue 24): inert placeholders, NumPy inside pickles,
and the pickle audit, against files written by real torch 2.13 (tests/data/torch/inert, make_torch_files.py)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import sys
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from clipcli.checkpoint import open_checkpoint
from clipcli.checkpoint.formats import _torch_names, _torch_records
from clipcli.checkpoint.formats._pickle import unpickle
from clipcli.checkpoint.formats._pickle_audit import WEIGHTS_ONLY_GLOBALS, Audit
from clipcli.checkpoint.formats.torch import read_torch
from clipcli.errors import ClipcliError, MalformedError
from tests.helpers import (
    DATA,
    ROOT,
    byte_mutations,
    distcp_pickles,
    pickletools_calls,
    run,
    run_bounded,
    torch_zip_file,
)

INERT = DATA / "torch" / "inert"
REFERENCED = sorted(p for p in INERT.glob("*.pt") if p.with_name(p.name + ".json").exists())
HOSTILE = [INERT / "hostile.pt", INERT / "hostile_legacy.pt"]
SENTINEL = "clipcli-pwned"  # what the hostile files' payloads would create in the current directory
EXAMPLES = int(os.environ.get("CLIPCLI_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=5000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    derandomize=EXAMPLES <= 1000,
)


def reference(path: Path) -> list[dict]:
    return json.loads(path.with_name(path.name + ".json").read_text())["tensors"]


def norm(values: np.ndarray) -> float:
    """sqrt(fsum of squares) in float64, as make_torch_files.py computes it from torch's values."""
    if values.dtype.kind == "c":
        values = values.astype(np.complex128).view(np.float64)
    wide = values.astype(np.float64).reshape(-1)
    return math.sqrt(math.fsum((wide * wide).tolist()))


def test_the_corpus_holds_every_kind() -> None:
    names = {p.name for p in REFERENCED}
    for stem in ("namespace", "objects", "numpy", "rng_state"):
        assert {f"{stem}.pt", f"{stem}_legacy.pt"} <= names
    assert {"numpy_protocol4.pt", "numpy_protocol5.pt"} <= names and all(p.exists() for p in HOSTILE)
    assert sum(p.stat().st_size for p in INERT.iterdir()) < 200_000


@pytest.mark.parametrize("path", REFERENCED, ids=lambda p: p.name)
def test_tensors_inside_objects_and_numpy_arrays_read_as_torch_and_numpy_hold_them(path: Path) -> None:
    want = reference(path)
    with open_checkpoint(path) as ckpt:
        readable = [t for t in ckpt.tensors if t.skip is None]
        assert [t.name for t in readable] == [w["name"] for w in want]
        for t, w in zip(readable, want, strict=True):
            assert (t.dtype, list(t.shape)) == (w["dtype"], w["shape"]), t.name
            values = ckpt.read(t)
            assert hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest() == w["sha256"], t.name
            assert math.isclose(norm(values), w["norm"], rel_tol=1e-12, abs_tol=0), t.name


@pytest.mark.parametrize("path", REFERENCED, ids=lambda p: p.name)
def test_conversions_to_safetensors_equal_torchs_tensors_byte_for_byte(tmp_path: Path, path: Path) -> None:
    want = {w["name"]: w for w in reference(path)}
    out = tmp_path / "out.safetensors"
    result = run("convert", path, "-o", out)
    assert result.exit_code == 0, result.stderr
    loaded = load_file(out)
    assert set(loaded) == set(want)
    for name, values in loaded.items():
        assert hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest() == want[name]["sha256"], name


def test_placeholders_are_metadata_with_their_attributes_below() -> None:
    metadata, _ = read_torch(INERT / "namespace.pt")
    assert metadata["args"] == "<argparse.Namespace>" and metadata["args.sub"] == "<argparse.Namespace>"
    assert (metadata["args.lr"], metadata["args.arch"], metadata["args.betas.1"]) == ("0.0003", "tiny", "0.95")
    metadata, _ = read_torch(INERT / "objects.pt")
    gone = "clipcli_gone_project.config"
    assert metadata["config"] == f"<{gone}.TrainConfig>"
    assert metadata["config.color"] == f"<{gone}.Color(2)>"
    assert metadata["config.path"] == "<pathlib.PosixPath('ckpt', 'last.pt')>"
    assert metadata["config.took"] == "<datetime.timedelta(0, 90, 0)>"
    assert metadata[f"by_color.<{gone}.Color(1)>"] == "warm"
    assert metadata["slots"] == f"<{gone}.Slotted>" and metadata["slots.bias"] == "0.5"
    metadata, _ = read_torch(INERT / "numpy.pt")
    assert (metadata["config.scalar"], metadata["config.count"], metadata["config.on"]) == ("0.125", "7", "True")
    assert metadata["config.objects"] == "<numpy.ndarray((2,), 'O8')>" and metadata["config.objects.0.k"] == "1"
    assert metadata["config.words"] == "<numpy.ndarray((2,), 'U2')>"


# -- the audit and hostile files ----------------------------------------------------------------------


def data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def test_the_audit_of_a_hostile_file_equals_what_pickletools_shows() -> None:
    audits = {}
    for path in HOSTILE:
        audit = Audit()
        read_torch(path, audit=audit)
        audits[path.name] = audit.result(str(path))
    calls = {g.name for g in audits["hostile.pt"].globals if g.use == "call"}
    assert calls == pickletools_calls(data_pkl(HOSTILE[0]))
    assert {g.name for g in audits["hostile_legacy.pt"].globals if g.use == "call"} == calls
    for result in audits.values():
        assert not result.loads_with_weights_only
        assert set(result.unsafe_calls) == {
            "posix.system",
            "builtins.eval",
            "builtins.exec",
            "subprocess.Popen",
            "importlib.import_module",
            "functools.partial",
        }


@pytest.mark.parametrize("path", HOSTILE, ids=lambda p: p.name)
@pytest.mark.parametrize("command", ["inspect", "global-norm", "hash", "convert"])
def test_hostile_files_run_nothing_warn_and_fail_the_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: Path, command: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # run in tmp_path, where a payload would leave its sentinel
    local = tmp_path / path.name
    shutil.copy(path, local)
    extra = ["-o", "out.safetensors"] if command == "convert" else []
    calls = "builtins.eval, builtins.exec, functools.partial, importlib.import_module, posix.system, subprocess.Popen"
    warning = f"clipcli: warning: {local.name}: torch.load would call {calls} (never called here)"
    r = run_bounded(command, local.name, *extra, seconds=30, cwd=tmp_path)
    assert (r.returncode, r.stderr.splitlines()) == (0, [warning]), r
    r = run_bounded(command, local.name, *extra, "--fail-unsafe-pickle", "--quiet", seconds=30, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr.splitlines()[0] == warning, r
    assert "--fail-unsafe-pickle" in r.stderr.splitlines()[1]
    assert not (tmp_path / SENTINEL).exists()


def test_a_weights_only_file_has_no_warning_and_passes_the_gate() -> None:
    result = run("inspect", DATA / "torch" / "model_state.pt", "--format", "json", "--fail-unsafe-pickle")
    assert (result.exit_code, result.stderr) == (0, "")
    audit = json.loads(result.stdout)["checkpoints"][0]["pickle"]
    assert audit["loads_with_weights_only"] is True
    assert {g["name"] for g in audit["globals"] if g["use"] == "call"} <= WEIGHTS_ONLY_GLOBALS


def test_safetensors_checkpoints_carry_no_pickle_audit() -> None:
    result = run("inspect", DATA / "torch" / "model_state.pt", "--format", "json")
    assert "pickle" in json.loads(result.stdout)["checkpoints"][0]
    sample = next((DATA.parent.parent / "samples").glob("*.safetensors"), None)
    if sample is not None:
        assert "pickle" not in json.loads(run("inspect", sample, "--format", "json").stdout)["checkpoints"][0]


# -- against torch itself ----------------------------------------------------------------------------------

TORCH_INPUTS = sorted(
    p for p in (DATA / "torch").rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".ckpt") and p.is_file()
)


def test_the_allowlist_is_torchs() -> None:
    torch = pytest.importorskip("torch")
    from torch._weights_only_unpickler import _get_allowed_globals

    assert set(_get_allowed_globals()) == WEIGHTS_ONLY_GLOBALS, torch.__version__


@pytest.mark.parametrize("path", TORCH_INPUTS, ids=lambda p: str(p.relative_to(DATA / "torch")))
def test_loads_with_weights_only_is_torchs_verdict(path: Path) -> None:
    torch = pytest.importorskip("torch")
    if path.name == "untyped_legacy.pt":  # never loaded unrestricted here: the hostile files would run
        pytest.skip("torch 2.x cannot load it at all (legacy untyped storages)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's about sparse, quantized and complex32 tensors
        try:
            torch.load(path, weights_only=True)
            loads = True
        except Exception:  # torch's refusal: UnpicklingError, or a RuntimeError naming it
            loads = False
    audit = Audit()
    try:
        read_torch(path, audit=audit)
    except ClipcliError:
        assert not loads  # a file clipcli refuses (torch 2.x's legacy untyped storages) torch refuses too
        return
    assert audit.weights_only == loads


# -- the machine's limits hold for placeholders ---------------------------------------------------------


def namespace_dag(levels: int) -> bytes:
    """A Namespace whose attribute is L(levels), L(k+1) = [Lk, Lk]: 2**levels paths from a few bytes a level."""
    import argparse

    inner: list = [1]
    for _ in range(levels):
        inner = [inner, inner]
    return pickle.dumps({"args": argparse.Namespace(a=inner)}, protocol=2)


def nested_namespaces(depth: int) -> bytes:
    """Namespaces each holding the next as its attribute `a`, `depth` deep (NEWOBJ, {'a': ...}, BUILD)."""
    level = b"cargparse\nNamespace\n)\x81}X\x01\x00\x00\x00a"
    return b"\x80\x02" + level * depth + b"N" + b"sb" * depth + b"."


@pytest.mark.parametrize(
    ("payload", "words"),
    [(namespace_dag(60), "would not end"), (nested_namespaces(5000), "deeper than")],
    ids=["memo amplification", "depth"],
)
def test_placeholders_are_held_to_the_machines_limits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: bytes, words: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    path = torch_zip_file(tmp_path / "bomb.pt", payload)
    for command in ("inspect", "global-norm"):
        r = run_bounded(command, path, seconds=20, memory_mb=1024, cwd=tmp_path)
        lines = r.stderr.splitlines()
        assert r.returncode == 3 and len(lines) == 1 and words in lines[0], r
        assert r.seconds < 5 and r.peak_mb < 300, r


def test_a_shallow_namespace_dag_reads() -> None:
    metadata, _ = read_torch_bytes(namespace_dag(3))
    assert metadata["args"] == "<argparse.Namespace>" and metadata["args.a.1.1.0.0"] == "1"


def read_torch_bytes(payload: bytes) -> tuple[dict[str, str], list]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return read_torch(torch_zip_file(Path(tmp) / "x.pt", payload))


# -- fuzz: the placeholder machine ---------------------------------------------------------------------------

OPCODES = sorted({op for op in (getattr(pickle, n) for n in dir(pickle) if n.isupper()) if type(op) is bytes})
_ARGS = {b"c": b"os\nsystem\n", b"i": b"argparse\nNamespace\n", b"X": b"\x01\x00\x00\x00a", b"K": b"\x01"}
# NumPy's globals, and the arguments its arrays, dtypes and scalars take
_NUMPY = [
    b"cnumpy.core.multiarray\n_reconstruct\n",
    b"cnumpy\nndarray\n",
    b"cnumpy\ndtype\n",
    b"cnumpy.core.multiarray\nscalar\n",
    b"cnumpy._core.numeric\n_frombuffer\n",
    b"X\x02\x00\x00\x00f4",
    b"X\x01\x00\x00\x00<",
    b"C\x04\x00\x00\x80?",
    b"K\x00",
    b"K\x03",
    b"\x89",
    b"\x88",
]


_TOKENS = [
    op + _ARGS.get(op, b"")
    for op in (b"c", b"i", b"R", b"\x81", b"b", b"(", b"t", b"s", b"u", b"a", b"e", b"]", b"}", b")", b"N", b"X", b"K")
] + [b"\x94", b"h\x00", b"h\x01", b"o", b"0", b"2", b"\x85", b"\x86", b"\x87", *_NUMPY]


@st.composite
def opcode_streams(draw: st.DrawFn) -> bytes:
    """Opcodes, mostly those that build placeholders and NumPy records and call them, with arguments that often
    parse, and a few of any kind."""
    tokens = draw(st.lists(st.sampled_from(_TOKENS), max_size=80))
    extra = draw(st.lists(st.sampled_from([o for o in OPCODES if len(o) == 1]), max_size=5))
    return b"\x80\x02" + b"".join(tokens + extra) + b"."


def imported_beyond(modules: set[str]) -> set[str]:
    """Modules imported since `modules` besides clipcli's own and the codecs of protocol 0's text."""
    return {m for m in set(sys.modules) - modules if not m.startswith(("clipcli.", "encodings."))}


def _unpickled_or_refused(data: bytes) -> None:
    """The pickle run on the machine and its object named (as a torch.save file's), or one error line."""
    storages = _torch_records.Storages(legacy=False)
    try:
        root = unpickle(data, _torch_records.resolve, storages.persistent_load, Audit(), True)
        _torch_names.flatten(root, "x", storages, False, len(data))
    except ClipcliError as e:
        assert "\n" not in str(e)


@FUZZ
@given(opcode_streams())
def test_random_opcode_streams_run_inert(data: bytes) -> None:
    modules = set(sys.modules)
    tracemalloc.start()
    try:
        _unpickled_or_refused(data)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
    assert not imported_beyond(modules)


@FUZZ
@given(st.data())
def test_inert_files_mutated(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    source = data.draw(st.sampled_from(REFERENCED + HOSTILE))
    path = tmp_path_factory.mktemp("fuzz") / source.name
    path.write_bytes(data.draw(byte_mutations(source.read_bytes())))
    modules = set(sys.modules)
    try:
        read_torch(path, audit=Audit())
    except ClipcliError as e:
        assert "\n" not in str(e)
    assert not imported_beyond(modules)


def test_mutated_hostile_files_on_the_command_line_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    data = bytearray((INERT / "hostile.pt").read_bytes())
    for i, pos in enumerate(range(40, len(data), max(1, len(data) // 12))):
        mutated = bytearray(data)
        mutated[pos] ^= 0x5A
        path = tmp_path / f"m{i}.pt"
        path.write_bytes(bytes(mutated))
        r = run_bounded("inspect", path.name, seconds=20, memory_mb=1024, cwd=tmp_path)
        assert r.returncode in (0, 3) and "Traceback" not in r.stderr, r
    assert not (tmp_path / SENTINEL).exists()


DCP = sorted(p.parent for p in (DATA / "dcp").glob("*/.metadata") if p.parent.name != "safetensors_format")


@pytest.mark.parametrize("directory", DCP, ids=lambda p: p.name)
def test_a_distributed_checkpoints_metadata_is_audited_without_a_warning(directory: Path) -> None:
    # items/ holds objects torch.load would call (a Namespace, NumPy scalars): tests/cli/test_dcp_items.py
    result = run("inspect", directory, "--format", "json", *["--fail-unsafe-pickle"] * (directory.name != "items"))
    assert (result.exit_code, bool(result.stderr)) == (0, directory.name == "items")
    audit = json.loads(result.stdout)["checkpoints"][0]["pickle"]
    calls = {g["name"] for g in audit["globals"] if g["use"] == "call"}
    assert calls == set().union(*map(pickletools_calls, distcp_pickles(directory)))  # .metadata and the .distcp files'
    assert any(name.endswith("Metadata") for name in calls)


@pytest.mark.parametrize("directory", DCP, ids=lambda p: p.name)
def test_a_distributed_checkpoints_weights_only_verdict_is_torchs(directory: Path) -> None:
    pytest.importorskip("torch")
    import io

    from torch._weights_only_unpickler import load

    try:
        load(io.BytesIO((directory / ".metadata").read_bytes()))
        loads = True
    except Exception:
        loads = False
    with open_checkpoint(directory) as ckpt:
        assert ckpt.pickle_audits[0].loads_with_weights_only == loads


class AttrDict(dict):
    """Like Lightning's AttributeDict: a dict subclass (NEWOBJ, then SETITEMS)."""


class Items(list):
    """A list subclass (NEWOBJ, then APPENDS)."""


def test_placeholders_take_items_appends_and_every_build() -> None:
    here = __name__
    payload = pickle.dumps({"hp": AttrDict(lr=0.1, name="x"), "seq": Items([1, 2])}, protocol=2)
    metadata, _ = read_torch_bytes(payload)
    assert metadata["hp"] == f"<{here}.AttrDict>" and (metadata["hp.lr"], metadata["hp.name"]) == ("0.1", "x")
    assert metadata["seq"] == f"<{here}.Items>" and (metadata["seq.0"], metadata["seq.1"]) == ("1", "2")
    # BUILD twice: the second updates the first, as Python's would; INST and OBJ make objects as NEWOBJ does.
    # An object saved alone is named after the file, its attributes by their names (as a dict's items).
    twice = b"\x80\x02cfoo\nBar\n)\x81}X\x01\x00\x00\x00aK\x01sb}X\x01\x00\x00\x00aK\x02sb."
    assert read_torch_bytes(twice)[0] == {"x": "<foo.Bar>", "a": "2"}
    inst = b"(K\x01K\x02ifoo\nPoint\n}X\x01\x00\x00\x00zK\x03sb."
    assert read_torch_bytes(inst)[0] == {"x": "<foo.Point(1, 2)>", "z": "3"}
    obj = b"\x80\x02(cfoo\nPoint\nK\x01o."
    assert read_torch_bytes(obj)[0] == {"x": "<foo.Point(1)>"}
    for data in (twice, inst, obj):
        assert {g.name: g.use for g in audit_of(data).globals} == {"foo.Bar" if data is twice else "foo.Point": "call"}
        assert pickletools_calls(data) == {"foo.Bar" if data is twice else "foo.Point"}


def audit_of(payload: bytes):
    audit = Audit()
    unpickle(payload, _torch_records.resolve, None, audit, True)
    return audit.result("x")


def test_every_command_takes_the_gate() -> None:
    import typer

    from clipcli.cli import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        options = {opt for p in command.params for opt in getattr(p, "opts", [])}
        assert "--fail-unsafe-pickle" in options, name


@pytest.mark.parametrize(
    "args",
    [
        ["clip-norm", "--clip-norm", "1", "--dry-run"],
        ["clip-value", "--min", "-1", "--max", "1", "--dry-run"],
        ["clip-global-norm", "--clip-norm", "1", "--dry-run"],
        ["trajectory"],
    ],
    ids=lambda a: a[0],
)
def test_the_other_commands_warn_and_gate(args: list[str]) -> None:
    path = INERT / "namespace.pt"
    warning = f"clipcli: warning: {path}: torch.load would call argparse.Namespace (never called here)\n"
    result = run(args[0], path, *args[1:], "--quiet")
    assert (result.exit_code, result.stderr) == (0, warning)
    result = run(args[0], path, *args[1:], "--quiet", "--fail-unsafe-pickle")
    assert result.exit_code == 1 and result.stderr.startswith(warning)


def test_pytorch_shards_are_audited_together() -> None:
    directory = DATA / "torch" / "sharded_bin"
    result = run("inspect", directory, "--format", "json", "--fail-unsafe-pickle")
    assert (result.exit_code, result.stderr) == (0, "")
    audit = json.loads(result.stdout)["checkpoints"][0]["pickle"]
    shards = sorted(directory.glob("*.bin"))
    assert len(shards) > 1 and audit["loads_with_weights_only"] is True
    calls: dict[str, int] = {}
    for shard in shards:
        one = Audit()
        read_torch(shard, audit=one)
        for g in one.result(str(shard)).globals:
            if g.use == "call":
                calls[g.name] = calls.get(g.name, 0) + g.count
    assert {g["name"]: g["count"] for g in audit["globals"] if g["use"] == "call"} == calls


def test_a_numpy_array_without_its_state_is_refused() -> None:
    bare = b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R."
    with pytest.raises(MalformedError, match="never gives its state"):
        read_torch_bytes(bare)
    wrong_size = bare[:-1] + b"(K\x01K\x02\x85cnumpy\ndtype\nX\x02\x00\x00\x00f4\x89\x88\x87R\x89C\x04\x00\x00\x80?tb."
    with pytest.raises(MalformedError, match="holds 4 bytes"):
        read_torch_bytes(wrong_size)


def test_the_audit_from_python() -> None:
    import clipcli

    with clipcli.open(INERT / "namespace.pt") as ckpt:
        audit = ckpt.pickle
    assert (
        audit
        == json.loads(run("inspect", INERT / "namespace.pt", "--format", "json").stdout)["checkpoints"][0]["pickle"]
    )
    assert audit["loads_with_weights_only"] is False
    with clipcli.open(DATA / "torch" / "model_state.pt") as ckpt:
        assert ckpt.pickle["loads_with_weights_only"] is True
