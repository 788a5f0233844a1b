"""TorchScript archives (torch.jit.save, issue 24 item 3): their parameters, buffers and constants, named as
`state_dict()` names them, against files written by real torch 2.13 (tests/data/torch/script, make_torch_files.py);
hand-made archives for the hostile and malformed cases. The cross-checks against torch run only where it is
installed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from clipcli.checkpoint import open_checkpoint
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats._torchscript import NOT_MODULE, code_record, declared_classes
from clipcli.checkpoint.formats.torch import read_torch
from clipcli.checkpoint.registry import file_format
from clipcli.errors import ClipcliError, MalformedError, UnsupportedError
from tests.helpers import DATA, ROOT, byte_mutations, pickletools_calls, run, run_bounded, torch_tensor_pickle

SCRIPT = DATA / "torch" / "script"
REFERENCED = sorted(p for p in SCRIPT.iterdir() if p.with_name(p.name + ".json").exists())
SENTINEL = "clipcli-pwned"  # what a hostile file's payload would create in the current directory
ONE = np.arange(1, 5, dtype=np.float32).tobytes()  # the 4 float32 of the hand-made archives' storage


def reference(path: Path) -> dict:
    return json.loads(path.with_name(path.name + ".json").read_text())


def norm(values: np.ndarray) -> float:
    """sqrt(fsum of squares) in float64, as make_torch_files.py computes it from torch's values."""
    wide = values.astype(np.float64).reshape(-1)
    return math.sqrt(math.fsum((wide * wide).tolist()))


def sha(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def test_the_corpus_holds_every_kind() -> None:
    assert [p.name for p in REFERENCED] == ["nested.pt", "sequential.pt", "tied.ptl", "traced.jit"]
    assert any(reference(p)["shared"] for p in REFERENCED)  # tied weights, kept by TorchScript
    assert any(t["name"].startswith("CONSTANTS.") for p in REFERENCED for t in reference(p)["tensors"])
    with zipfile.ZipFile(SCRIPT / "tied.ptl") as z:
        assert "tied/bytecode.pkl" in z.namelist()  # the lite interpreter's zip
    assert (SCRIPT / "mobile.ff").read_bytes()[4:8] == b"PTMF"
    assert sum(p.stat().st_size for p in SCRIPT.iterdir()) < 100_000


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_an_archive_under_another_formats_suffix_is_named_for_what_it_is(tmp_path: Path, suffix: str) -> None:
    # found by a new user: under .npz it read as 42 byte members ("npz, 42 tensors"), under .safetensors it was
    # "a zip archive" (torch.jit.save writes a storage first, not data.pkl)
    path = tmp_path / f"model{suffix}"
    shutil.copy(SCRIPT / "sequential.pt", path)
    result = run("inspect", path)
    assert result.exit_code == 3, result.stdout
    assert "a PyTorch zip checkpoint (name it .pt, .pth or .bin)" in result.stderr, result.stderr


@pytest.mark.parametrize("path", REFERENCED, ids=lambda p: p.name)
def test_parameters_buffers_and_constants_read_as_torch_jit_load_gives_them(path: Path) -> None:
    want = reference(path)
    assert file_format(path) == "torch"  # by the zip's records, whatever the suffix
    with open_checkpoint(path) as ckpt:
        assert [t.name for t in ckpt.tensors] == [w["name"] for w in want["tensors"]]
        for t, w in zip(ckpt.tensors, want["tensors"], strict=True):
            assert (t.dtype, list(t.shape), t.skip) == (w["dtype"], w["shape"], None), t.name
            values = ckpt.read(t)
            assert sha(values) == w["sha256"], t.name
            assert math.isclose(norm(values), w["norm"], rel_tol=1e-12, abs_tol=0), t.name
        assert ckpt.metadata == want["metadata"] == {}
    _, tensors = read_torch(path)
    shared: dict[str, list[str]] = {}
    for t in tensors:
        shared.setdefault(t.storage_key, []).append(t.name)
    assert sorted(names for names in shared.values() if len(names) > 1) == want["shared"]


def test_attributes_that_are_neither_parameters_nor_buffers_give_no_names() -> None:
    # nested.pt's blocks hold a plain tensor (`offset`), a dict, a list and flags beside their state
    names = [t.name for t in read_torch(SCRIPT / "nested.pt")[1]]
    assert "encoder.first.norm.running_var" in names and "encoder.second.cache" in names
    assert not [n for n in names if n.rsplit(".", 1)[-1] in ("offset", "sizes", "widths", "verbose", "training")]


@pytest.mark.parametrize("path", REFERENCED, ids=lambda p: p.name)
def test_conversions_to_safetensors_equal_torchs_tensors_byte_for_byte(tmp_path: Path, path: Path) -> None:
    want = {w["name"]: w for w in reference(path)["tensors"]}
    out = tmp_path / "out.safetensors"
    result = run("convert", path, "-o", out)
    assert result.exit_code == 0, result.stderr
    loaded = load_file(out)
    assert set(loaded) == set(want)
    for name, values in loaded.items():
        assert sha(values) == want[name]["sha256"], name
        assert (str(values.dtype), list(values.shape)) == (want[name]["dtype"], want[name]["shape"]), name


@pytest.mark.parametrize("name", ["model", "model.data", "model.pt", "model.pth", "model.jit", "model.ptl"])
def test_any_suffix_reads_the_same(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    shutil.copy(SCRIPT / "traced.jit", path)
    result = run("global-norm", path, "--format", "json")
    assert result.exit_code == 0, result.stderr
    tensors = json.loads(result.stdout)["checkpoints"][0]["tensors"]
    assert [t["name"] for t in tensors] == [w["name"] for w in reference(SCRIPT / "traced.jit")["tensors"]]


@pytest.mark.parametrize("path", REFERENCED, ids=lambda p: p.name)
def test_the_audit_covers_the_archives_pickles_and_torchs_verdict(path: Path) -> None:
    result = run("inspect", path, "--format", "json", "--fail-unsafe-pickle")
    assert (result.exit_code, result.stderr) == (0, "")  # its own classes are no call to warn of
    audit = json.loads(result.stdout)["checkpoints"][0]["pickle"]
    assert audit["loads_with_weights_only"] is reference(path)["loads_with_weights_only"] is False
    calls = {g["name"] for g in audit["globals"] if g["use"] == "call"}
    with zipfile.ZipFile(path) as z:
        pickles = [n for n in z.namelist() if n.endswith(".pkl") and n.count("/") == 1]
        expected = set().union(*(pickletools_calls(z.read(n)) for n in pickles))
    assert calls == expected and any(c.startswith("__torch__.") for c in calls)
    assert ("tied/bytecode.pkl" in pickles) is (path.name == "tied.ptl")


@pytest.mark.parametrize("name", ["mobile.ff", "mobile.pt"])
def test_a_mobile_flatbuffer_is_refused_saying_what_it_is(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    shutil.copy(SCRIPT / "mobile.ff", path)
    result = run("inspect", path)
    assert result.exit_code == 3
    assert "a PyTorch Mobile flatbuffer" in result.stderr and len(result.stderr.splitlines()) == 1


# -- hand-made archives: hostile and malformed ------------------------------------------------------------

NET = 'class Net(Module):\n  __parameters__ = ["weight", ]\n  __buffers__ = []\n  weight : Tensor\n'


def module(state: bytes, cls: bytes = b"__torch__\nNet") -> bytes:
    """Opcodes of a module object as torch.jit.save writes one: NEWOBJ of its class, BUILD of its attributes."""
    return b"c" + cls + b"\n)\x81}(" + state + b"ub"


def archive(path: Path, data_pkl: bytes, code: str | None = NET, constants: bytes = b"\x80\x02).", **pickles: bytes):
    """A TorchScript archive as torch.jit.save lays it out: storages first, data.pkl, code/ (deflated),
    constants.pkl; `pickles` are other records (bytecode.pkl)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/data/0", ONE)
        z.writestr("model/data.pkl", data_pkl)
        if code is not None:
            z.writestr("model/code/__torch__.py", code, zipfile.ZIP_DEFLATED)
        z.writestr("model/constants.pkl", constants)
        for name, data in pickles.items():
            z.writestr(f"model/{name}.pkl", data)
        z.writestr("model/version", "10\n")
    return path


WEIGHT = b"X\x06\x00\x00\x00weight" + torch_tensor_pickle()
TRAINING = b"X\x08\x00\x00\x00training\x88"
SYSTEM = b"cos\nsystem\n(X" + len(f"touch {SENTINEL}").to_bytes(4, "little") + f"touch {SENTINEL}".encode() + b"tR"


def test_a_hand_made_archive_reads_its_declared_parameters() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = archive(Path(tmp) / "m.pt", b"\x80\x02" + module(WEIGHT + TRAINING) + b".")
        metadata, tensors = read_torch(path)
    assert metadata == {} and [(t.name, t.shape) for t in tensors] == [("weight", (4,))]


@pytest.mark.parametrize("where", ["data.pkl", "bytecode.pkl"])
def test_a_hostile_archive_runs_nothing_warns_and_fails_the_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # run in tmp_path, where a payload would leave its sentinel
    hostile = b"X\x07\x00\x00\x00payload" + SYSTEM
    if where == "data.pkl":
        path = archive(tmp_path / "model.pt", b"\x80\x02" + module(WEIGHT + TRAINING + hostile) + b".")
        payload = zipfile.ZipFile(path).read("model/data.pkl")
    else:
        payload = b"\x80\x02(K\x08" + SYSTEM + b"t."
        path = archive(tmp_path / "model.pt", b"\x80\x02" + module(WEIGHT) + b".", bytecode=payload)
    assert "os.system" in pickletools_calls(payload)
    warning = "clipcli: warning: model.pt: torch.load would call os.system (never called here)"
    for command, extra in [("inspect", []), ("global-norm", []), ("convert", ["-o", "out.safetensors"])]:
        r = run_bounded(command, "model.pt", *extra, seconds=30, cwd=tmp_path)
        assert (r.returncode, r.stderr.splitlines()) == (0, [warning]), r
        r = run_bounded(command, "model.pt", *extra, "--fail-unsafe-pickle", "--quiet", seconds=30, cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.splitlines()[0] == warning, r
    assert load_file(tmp_path / "out.safetensors")["weight"].tobytes() == ONE
    assert not (tmp_path / SENTINEL).exists()
    audit = Audit()
    read_torch(path, audit=audit)
    result = audit.result(str(path))
    assert not result.loads_with_weights_only and "os.system" in result.unsafe_calls


def test_a_class_without_declarations_lists_every_tensor_attribute(tmp_path: Path) -> None:
    # no code/ for the class (a hand-made archive): tensors and __torch__ objects are taken as its state
    inner = b"X\x05\x00\x00\x00inner" + module(b"X\x01\x00\x00\x00b" + torch_tensor_pickle(), b"__torch__\nGone")
    path = archive(tmp_path / "m.pt", b"\x80\x02" + module(WEIGHT + TRAINING + inner, b"__torch__\nGone") + b".")
    assert [t.name for t in read_torch(path)[1]] == ["weight", "inner.b"]


def test_constants_take_the_codes_names_and_non_tensors_are_metadata(tmp_path: Path) -> None:
    constants = b"\x80\x02(" + torch_tensor_pickle() + b"K\x07X\x01\x00\x00\x00at."
    path = archive(tmp_path / "m.pt", b"\x80\x02" + module(WEIGHT) + b".", constants=constants)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("model/constants/0", ONE[::-1])
    metadata, tensors = read_torch(path)
    assert [(t.name, t.storage_key) for t in tensors] == [("weight", "0"), ("CONSTANTS.c0", "constants/0")]
    assert metadata == {"CONSTANTS.c1": "7", "CONSTANTS.c2": "a"}
    with open_checkpoint(path) as ckpt:
        assert ckpt.read(ckpt.tensors[1]).tobytes() == ONE[::-1] and not ckpt.tensors[0].storage


@pytest.mark.parametrize(
    ("data_pkl", "code", "error", "words"),
    [
        (b"\x80\x02}.", NET, MalformedError, "holds a dict, not a module"),
        (b"\x80\x02c__torch__\nNet\n)\x81q\x00}(X\x04\x00\x00\x00selfh\x00ub.", NET, MalformedError, "holds itself"),
        (b"\x80\x02" + module(WEIGHT) + b".", "class Net(Module):\n  __parameters__ = [f()]\n", MalformedError,
         "declares its parameters"),
        (b"\x80\x02" + module(b"X\x09\x00\x00\x00CONSTANTS" + module(WEIGHT)) + b".", NET, UnsupportedError,
         "named CONSTANTS"),
    ],
    ids=["not a module", "a cycle", "bad declaration", "a name clash"],
)  # fmt: skip
def test_malformed_archives_are_refused(tmp_path: Path, data_pkl: bytes, code: str, error: type, words: str) -> None:
    constants = b"\x80\x02(K\x01t." if "CONSTANTS" in repr(data_pkl) else b"\x80\x02)."
    path = archive(tmp_path / "m.pt", data_pkl, code, constants)
    with pytest.raises(error, match=words):
        read_torch(path)
    result = run("inspect", path)
    assert result.exit_code == 3 and len(result.stderr.splitlines()) == 1, result.stderr


def test_an_older_archive_without_data_pkl_is_refused_saying_so(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("old/version", "1\n")
        z.writestr("old/model.json", "{}")
        z.writestr("old/code/old.py", "")
        z.writestr("old/tensors/0", ONE)
    with pytest.raises(UnsupportedError, match=r"older TorchScript archive \(model\.json, no data\.pkl\)"):
        read_torch(path)


def test_deeply_nested_modules_are_refused(tmp_path: Path) -> None:
    state = WEIGHT
    for _ in range(300):
        state = b"X\x01\x00\x00\x00m" + module(state)
    path = archive(tmp_path / "m.pt", b"\x80\x02" + module(state) + b".")
    with pytest.raises(MalformedError, match="nested deeper"):
        read_torch(path)


def test_declarations_are_read_from_the_code_as_text() -> None:
    text = (
        'class Linear(Module):\n  __parameters__ = ["weight", "bias", ]\n  __buffers__ = []\n'
        '  weight : Tensor\n  def forward(self: __torch__.Linear) -> None:\n    __buffers__ = ["no"]\n'
        'class Old(Module):\n  __parameters__ = ["w", ]\n  w : Tensor\n'
        "class Config:\n  x : int\n"
    )
    assert declared_classes(text, "code/__torch__.py") == {
        "Linear": (("weight", "bias"), ()),
        "Old": (("w",), None),
        "Config": NOT_MODULE,
    }
    assert code_record("__torch__.torch.nn.modules.linear.___torch_mangle_0.Linear") == (
        "code/__torch__/torch/nn/modules/linear/___torch_mangle_0.py",
        "Linear",
    )
    assert code_record("__torch__.Net") == ("code/__torch__.py", "Net") and code_record("os.system") is None


# -- fuzz: mutated archives -------------------------------------------------------------------------------

EXAMPLES = int(os.environ.get("CLIPCLI_FUZZ_EXAMPLES", "120"))


@settings(
    max_examples=EXAMPLES,
    deadline=5000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    derandomize=EXAMPLES <= 1000,
)
@given(st.data())
def test_mutated_archives_read_or_are_refused_in_one_line(tmp_path_factory: pytest.TempPathFactory, data) -> None:
    source = data.draw(st.sampled_from(REFERENCED))
    path = tmp_path_factory.mktemp("fuzz") / source.name
    path.write_bytes(data.draw(byte_mutations(source.read_bytes())))
    modules = set(sys.modules)
    try:
        read_torch(path, audit=Audit())
    except ClipcliError as e:
        assert "\n" not in str(e)
    assert not {m for m in set(sys.modules) - modules if not m.startswith(("clipcli.", "encodings."))}


# -- against torch itself ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", REFERENCED, ids=lambda p: p.name)
def test_loads_with_weights_only_is_torchs_verdict(path: Path) -> None:
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's about dispatching to torch.jit.load
        with pytest.raises(RuntimeError, match="TorchScript"):
            torch.load(path, weights_only=True)  # refused before anything is unpickled
    with open_checkpoint(path) as ckpt:
        assert ckpt.pickle_audits[0].loads_with_weights_only is False


def test_a_module_scripted_now_reads_as_its_state_dict(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(2, 3, 2), torch.nn.LayerNorm(2), torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False))
    )
    path = tmp_path / "model.bin"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        torch.jit.save(torch.jit.script(model), str(path))
    state = model.state_dict()
    with open_checkpoint(path) as ckpt:
        assert [t.name for t in ckpt.tensors] == list(state)
        for t in ckpt.tensors:
            assert ckpt.read(t).tobytes() == state[t.name].numpy().tobytes(), t.name
    torch.save(state, tmp_path / "state.pt")  # the same names, values, shapes, dtypes and (no) metadata
    assert run("diff", path, tmp_path / "state.pt", "--fail-different", "--quiet").exit_code == 0
