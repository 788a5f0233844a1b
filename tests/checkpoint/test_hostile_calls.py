"""Hostile pickles written by hand: every dangerous global, every way of calling it, in every pickle-based form.

A zip `.pt`, a legacy file, a distributed checkpoint's `.metadata` and one of its `.distcp` items, each calling
os.system, posix.system, builtins.eval/exec, subprocess.Popen, importlib.import_module, and functools.partial
around them, by REDUCE (of GLOBAL or STACK_GLOBAL), NEWOBJ, OBJ and INST. Nothing runs; the audit's calls are
what pickletools' opcodes show (tests/helpers.py's symbolic run, which knows nothing of clipcli); the warning
names them; `--fail-unsafe-pickle` exits 1. The files are never loaded by pickle or torch unrestricted.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clipcli.checkpoint.formats._dcp_records import TRUSTED
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats.dcp import read_dcp
from clipcli.checkpoint.formats.torch import read_torch
from clipcli.errors import ClipcliError
from tests.helpers import (
    DATA,
    ROOT,
    PickleCall,
    PickleGlobal,
    dcp_checkpoint,
    pickletools_calls,
    run_bounded,
    torch_legacy,
    torch_tensor_pickle,
    torch_zip_file,
)

SENTINEL = "clipcli-pwned"  # what each payload would create in the current directory
ONE = struct.pack("<f", 1.0) * 4
CODE = f"open({SENTINEL!r}, 'w').close()"
# the global as the pickle names it, what the audit calls it, and the argument that would create the sentinel
TARGETS = [
    ("os", "system", "os.system", f"touch {SENTINEL}"),
    ("posix", "system", "posix.system", f"touch {SENTINEL}"),
    ("builtins", "eval", "builtins.eval", CODE),
    ("builtins", "exec", "builtins.exec", CODE),
    ("__builtin__", "eval", "builtins.eval", CODE),  # Python 2's name, which protocols 0-2 map (fix_imports)
    ("subprocess", "Popen", "subprocess.Popen", ["touch", SENTINEL]),
    ("importlib", "import_module", "importlib.import_module", "clipcli_pwned"),
]
FORMS = ["reduce", "stack_global", "newobj", "obj", "inst", "partial"]


def ops(x: object) -> bytes:
    return pickle.dumps(x, 2)[2:-1]


def call(module: str, name: str, arg: object, form: str) -> bytes:
    """Opcodes (no PROTO or STOP) that call module.name(arg) when unpickled, in the given form."""
    line = f"{module}\n{name}\n".encode()
    if form == "reduce":
        return b"c" + line + b"(" + ops(arg) + b"tR"
    if form == "stack_global":
        return ops(module) + ops(name) + b"\x93(" + ops(arg) + b"tR"
    if form == "newobj":  # cls.__new__(cls, arg): a call of the global as REDUCE's
        return b"c" + line + b"(" + ops(arg) + b"t\x81"
    if form == "obj":
        return b"(c" + line + ops(arg) + b"o"
    if form == "inst":
        return b"(" + ops(arg) + b"i" + line
    assert form == "partial"  # functools.partial(module.name, arg)()
    return b"cfunctools\npartial\n(c" + line + ops(arg) + b"tR)R"


def state_dict(payloads: dict[str, bytes], protocol: int = 2) -> bytes:
    """A pickle of {"w": a tensor of storage "0", name: payload, ...}: protocol 2, as torch.save writes."""
    body = b"X\x01\x00\x00\x00w" + torch_tensor_pickle()
    body += b"".join(ops(name) + payload for name, payload in payloads.items())
    return b"\x80" + bytes([protocol]) + b"}(" + body + b"u."


def torch_file(path: Path, pkl: bytes, legacy: bool) -> Path:
    if legacy:  # a legacy file's storage ids have a sixth item (the view)
        return torch_legacy(path, pkl.replace(b"cpuK\x04tQ", b"cpuK\x04NtQ"), {"0": ONE})
    return torch_zip_file(path, pkl, {"0": ONE})


def expected(module: str, name: str, audited: str, form: str) -> set[str]:
    """The unsafe calls the audit must report: the target, or functools.partial, which calls it. Python maps
    Python 2's names in protocols 0-2 only: under protocol 4 (STACK_GLOBAL's), __builtin__ stays what it is."""
    if form == "partial":
        return {"functools.partial"}
    return {f"{module}.{name}" if form == "stack_global" else audited}


def imported_since(modules: set[str]) -> set[str]:
    """Modules imported since `modules`, but clipcli's own and the codecs zip names and text are decoded with."""
    return {m for m in set(sys.modules) - modules if not m.startswith(("clipcli.", "encodings."))}


@pytest.fixture
def recorders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """os.system, subprocess.Popen and importlib.import_module replaced by recorders, in tmp_path."""
    import importlib

    calls: list[tuple] = []
    monkeypatch.chdir(tmp_path)
    for owner, name in ((os, "system"), (subprocess, "Popen"), (importlib, "import_module")):
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: calls.append((_n, a)))
    return calls


# -- every global, every form: the audit as pickletools shows it -----------------------------------------


# STACK_GLOBAL is protocol 4's: torch writes legacy files in protocol 2
@pytest.mark.parametrize(
    ("form", "legacy"), [(f, legacy) for f in FORMS for legacy in (False, True) if not (legacy and f == "stack_global")]
)
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}.{t[1]}")
def test_each_call_is_audited_as_pickletools_shows_and_never_run(
    tmp_path: Path, recorders: list, target: tuple, form: str, legacy: bool
) -> None:
    module, name, audited, arg = target
    pkl = state_dict({"x": call(module, name, arg, form)}, 4 if form == "stack_global" else 2)
    path = torch_file(tmp_path / "h.pt", pkl, legacy)
    reference = pickletools_calls(pkl)
    modules = set(sys.modules)
    audit = Audit()
    metadata, tensors = read_torch(path, audit=audit)
    result = audit.result(str(path))
    assert [t.name for t in tensors] == ["w"] and metadata["x"].startswith("<")
    assert {g.name for g in result.globals if g.use == "call"} == reference
    unsafe = expected(module, name, audited, form)
    assert set(result.unsafe_calls) == unsafe and not result.loads_with_weights_only
    assert (audited if form != "stack_global" else f"{module}.{name}") in {g.name for g in result.globals}
    assert recorders == [] and not (tmp_path / SENTINEL).exists() and not imported_since(modules)


def test_the_reference_sees_through_python2_names_and_the_memo() -> None:
    """pickletools_calls maps __builtin__ as Python does, and follows a callee through PUT/GET."""
    assert pickletools_calls(b"\x80\x02c__builtin__\neval\nq\x000h\x00(X\x01\x00\x00\x001tR.") == {"builtins.eval"}
    assert pickletools_calls(b"\x80\x02cos\nsystem\nX\x01\x00\x00\x00a\x85.") == set()  # named, never called


# -- the command line on one file of each form holding them all --------------------------------------------

ALL = {f"{t[2]}:{form}": call(t[0], t[1], t[3], form) for t in TARGETS for form in ("reduce", "partial")}
UNSAFE = sorted({t[2] for t in TARGETS} | {"functools.partial"})
WARNING = "clipcli: warning: {}: torch.load would call " + ", ".join(UNSAFE) + " (never called here)"


def hostile_files(tmp_path: Path) -> dict[str, tuple[Path, bytes]]:
    """The zip, legacy and DCP-item forms, each with its pickle (the one pickletools reads)."""
    pkl = state_dict(ALL)
    zipped = torch_file(tmp_path / "zip.pt", pkl, legacy=False)
    legacy = torch_file(tmp_path / "legacy.pt", pkl, legacy=True)
    item = {f"{t[2]}": PickleCall(PickleGlobal(t[0], t[1]), (t[3],)) for t in TARGETS}
    item["partial"] = PickleCall(PickleCall(PickleGlobal("functools", "partial"), (PickleGlobal("os", "system"),)), ())
    dcp = dcp_checkpoint(tmp_path / "dcp", {"w": ((4,), [((0,), np.ones(4, np.float32))])}, {("extra",): item})
    return {"zip": (zipped, pkl), "legacy": (legacy, pkl), "dcp-item": (dcp, b"")}


def gate_runs(tmp_path: Path, path: Path) -> tuple:
    """inspect as JSON, and global-norm with and without --fail-unsafe-pickle, run in tmp_path."""
    shown = run_bounded("inspect", path.name, "--format", "json", seconds=30, cwd=tmp_path)
    plain = run_bounded("global-norm", path.name, "--quiet", seconds=30, cwd=tmp_path)
    gated = run_bounded("global-norm", path.name, "--quiet", "--fail-unsafe-pickle", seconds=30, cwd=tmp_path)
    return shown, plain, gated


@pytest.mark.parametrize("form", ["zip", "legacy"])
def test_a_file_of_every_hostile_call_runs_nothing_warns_and_fails_the_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # clipcli runs in tmp_path, where a payload would leave its sentinel
    path, pkl = hostile_files(tmp_path)[form]
    shown, plain, gated = gate_runs(tmp_path, path)
    warning = WARNING.format(path.name)
    assert (shown.returncode, shown.stderr.splitlines()) == (0, [warning]), shown
    audit = json.loads(shown.stdout)["checkpoints"][0]["pickle"]
    assert {g["name"] for g in audit["globals"] if g["use"] == "call"} == pickletools_calls(pkl)
    assert audit["loads_with_weights_only"] is False
    assert (plain.returncode, plain.stderr.splitlines()) == (0, [warning]), plain
    assert gated.returncode == 1 and gated.stderr.splitlines()[0] == warning, gated
    assert "--fail-unsafe-pickle" in gated.stderr.splitlines()[1]
    assert not (tmp_path / SENTINEL).exists()


def test_a_distributed_checkpoint_item_of_every_hostile_call_warns_and_fails_the_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    path, _ = hostile_files(tmp_path)["dcp-item"]
    shown, plain, gated = gate_runs(tmp_path, path)
    assert not (tmp_path / SENTINEL).exists()
    assert shown.returncode == 0 and plain.returncode == 0 and "Traceback" not in shown.stderr + plain.stderr
    assert "functools.partial" in plain.stderr and gated.returncode == 1, (plain, gated)


def test_a_distributed_checkpoint_item_runs_nothing(tmp_path: Path, recorders: list) -> None:
    """The item is read as placeholders: nothing called, nothing imported."""
    path, _ = hostile_files(tmp_path)["dcp-item"]
    modules = set(sys.modules)
    metadata, tensors = read_dcp(path)
    assert [t.name for t in tensors] == ["w"]
    assert metadata["extra.os.system"] == f"<os.system('touch {SENTINEL}')>"
    assert metadata["extra.partial"] == "<functools.partial>"
    assert recorders == [] and not (tmp_path / SENTINEL).exists() and not imported_since(modules)


def hostile_metadata(tmp_path: Path, payload: bytes) -> Path:
    """single/ with `payload` spliced into its .metadata after PROTO, its result dropped by POP; without memo
    opcodes (PUT), which would shift the indices that the Metadata's MEMOIZE opcodes give."""
    payload = pickletools.optimize(b"\x80\x02" + payload + b".")[2:-1]
    directory = shutil.copytree(DATA / "dcp" / "single", tmp_path / "ckpt")
    original = (directory / ".metadata").read_bytes()
    assert original[:1] == b"\x80"  # PROTO, then the Metadata: the hostile call goes between
    (directory / ".metadata").write_bytes(original[:2] + payload + b"0" + original[2:])
    return directory


# found in review: a .metadata naming a foreign global was refused (exit 3); it is a pickle like any other
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t[0]}.{t[1]}")
@pytest.mark.parametrize("form", ["reduce", "stack_global", "partial"])
def test_a_hostile_metadata_is_audited_as_pickletools_shows_and_never_run(
    tmp_path: Path, recorders: list, target: tuple, form: str
) -> None:
    module, name, _, arg = target
    payload = call(module, name, arg, form)
    directory = hostile_metadata(tmp_path, payload)
    modules = set(sys.modules)
    audit = Audit()
    _, tensors = read_dcp(directory, audit=audit)
    _, plain = read_dcp(DATA / "dcp" / "single")
    assert [t.name for t in tensors] == [t.name for t in plain]
    result = audit.result(str(directory / ".metadata"), TRUSTED)
    # torch pickles .metadata in protocol 4, where Python 2's names stay as they are (__builtin__.eval)
    reference = pickletools_calls(b"\x80\x04" + payload + b".")
    assert reference == expected(module, name, f"{module}.{name}", form)
    assert set(result.unsafe_calls) == reference and not result.loads_with_weights_only
    assert recorders == [] and not (tmp_path / SENTINEL).exists() and not imported_since(modules)


def test_a_hostile_metadata_on_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    directory = hostile_metadata(tmp_path, call("os", "system", f"touch {SENTINEL}", "reduce"))
    shown, plain, gated = gate_runs(tmp_path, directory)
    warning = "clipcli: warning: ckpt/.metadata: torch.load would call os.system (never called here)"
    assert (shown.returncode, shown.stderr.splitlines()) == (0, [warning]), shown
    assert {"name": "os.system", "use": "call", "count": 1} in json.loads(shown.stdout)["checkpoints"][0]["pickle"][
        "globals"
    ]
    assert (plain.returncode, plain.stderr.splitlines()) == (0, [warning]), plain
    assert gated.returncode == 1 and gated.stderr.splitlines()[0] == warning, gated
    assert not (tmp_path / SENTINEL).exists()


# -- torch's own verdict, from a Python that has torch --------------------------------------------------------

_VERDICTS = """
import io, json, pickle, sys, warnings
import torch
from torch._weights_only_unpickler import load
verdicts = {}
for path in sys.argv[1:]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if path.endswith(".metadata"):  # as torch's FileSystemReader.read_metadata loads it
                load(io.BytesIO(open(path, "rb").read()))
            else:
                torch.load(path, weights_only=True)
            verdicts[path] = True
        except pickle.UnpicklingError:  # the weights-only unpickler's refusal
            verdicts[path] = False
        except RuntimeError as e:  # torch refuses a TorchScript archive with weights_only=True, unread
            verdicts[path] = False if "weights_only=True`` with TorchScript" in str(e) else None
        except Exception:  # torch cannot load it at all
            verdicts[path] = None
print(json.dumps(verdicts))
"""


def torch_python() -> str | None:
    """A Python that imports torch: $TORCH_PYTHON (as benchmarks/run.py takes it), or this one if it has torch."""
    import importlib.util

    named = os.environ.get("TORCH_PYTHON")
    if named:
        return named
    return sys.executable if importlib.util.find_spec("torch") is not None else None


def test_loads_with_weights_only_is_torchs_verdict_on_every_pickle_in_the_test_data(tmp_path: Path) -> None:
    """torch.load(weights_only=True) (its weights-only unpickler, for a .metadata) never runs what a file names:
    safe on the hostile files too. Run in a subprocess of $TORCH_PYTHON; skipped without torch."""
    python = torch_python()
    if python is None:
        pytest.skip("no torch: set TORCH_PYTHON to a Python that has it")
    torch_files = [
        p for p in (DATA / "torch").rglob("*") if p.is_file() and p.suffix in (".pt", ".pth", ".bin", ".ckpt")
    ]
    metadata = sorted((DATA / "dcp").rglob(".metadata")) + sorted((DATA / "dcp" / "foreign").glob("*.metadata"))
    made = [hostile_files(tmp_path)[form][0] for form in ("zip", "legacy")]
    files = sorted(torch_files) + metadata + made
    out = subprocess.run(
        [python, "-c", _VERDICTS, *map(str, files)], capture_output=True, text=True, timeout=300, check=True
    )
    verdicts = json.loads(out.stdout.splitlines()[-1])
    mismatches = {}
    for path in files:
        audit = Audit()
        if path.parent.name == "foreign":  # read with the files of sharded/, as make_dcp.py made them
            directory = shutil.copytree(DATA / "dcp" / "sharded", tmp_path / path.stem)
            shutil.copy(path, directory / ".metadata")
            read_dcp(directory, audit=audit)
        elif path.name == ".metadata":
            with contextlib.suppress(ClipcliError):  # safetensors_format is refused after its .metadata is read
                read_dcp(path.parent, audit=audit)
        else:
            read_torch(path, audit=audit)
        if verdicts[str(path)] is not None and audit.weights_only != verdicts[str(path)]:
            mismatches[str(path)] = verdicts[str(path)]
    assert mismatches == {}
    # torch 2.x fails on legacy untyped storages (an AttributeError inside torch.load, either way it loads)
    assert [Path(p).name for p, v in verdicts.items() if v is None] == ["untyped_legacy.pt"]
    assert sum(v is True for v in verdicts.values()) >= 10 and sum(v is False for v in verdicts.values()) >= 10


@pytest.mark.parametrize("place", ["bare", "magic", "version", "sys_info", "keys"])
def test_a_call_in_a_legacy_files_other_pickles_is_named_in_its_refusal(tmp_path: Path, place: str) -> None:
    # found by a red team: os.system in place of the magic number (torch.load runs it, then refuses the file),
    # or a bare pickle named .pt, were refused as "a Python pickle" without a word of the call
    command = f"touch {SENTINEL}".encode()
    call = b"\x80\x02cos\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R."
    path = tmp_path / "evil.pt"
    if place == "bare":
        path.write_bytes(call)
    else:  # torch_legacy's pickles, one replaced
        sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 8}}
        parts = [pickle.dumps(x, 2) for x in (0x1950A86A20F9469CFC6C, 1001, sys_info)]
        parts += [b"\x80\x02" + torch_tensor_pickle(legacy=True) + b".", pickle.dumps(["0"], 2)]
        parts.append(struct.pack("<q", 4) + ONE)
        parts[{"magic": 0, "version": 1, "sys_info": 2, "keys": 4}[place]] = call
        path.write_bytes(b"".join(parts))
    r = run_bounded("inspect", path, "--fail-unsafe-pickle", cwd=tmp_path)
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r
    assert "torch.load would call os.system (never called here)" in r.stderr, r
    assert not (tmp_path / SENTINEL).exists()


def test_a_magic_number_made_by_a_call_has_every_later_call_audited(tmp_path: Path) -> None:
    # found in picklescan's test data (pytorch_magic_bypass.pt): eval('0x1950A86A20F9469CFC6C') is torch's magic
    # number, so torch.load goes on and calls posix.system from the object's pickle; only builtins.eval was named
    eval_magic = b"\x80\x02c__builtin__\neval\nX\x16\x00\x00\x000x1950A86A20F9469CFC6C\x85R."
    command = f"touch {SENTINEL}".encode()
    call = b"cposix\nsystem\nX" + struct.pack("<I", len(command)) + command + b"\x85R"
    obj = b"\x80\x02}(X\x01\x00\x00\x00w" + torch_tensor_pickle(legacy=True) + b"X\x01\x00\x00\x00x" + call + b"u."
    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 8}}
    parts = [eval_magic, pickle.dumps(1001, 2), pickle.dumps(sys_info, 2), obj, pickle.dumps(["0"], 2)]
    path = tmp_path / "bypass.pt"
    path.write_bytes(b"".join(parts) + struct.pack("<q", 4) + ONE)
    r = run_bounded("inspect", path, "--fail-unsafe-pickle", cwd=tmp_path)
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r
    assert (
        "a Python pickle, not a torch.save file; torch.load would call builtins.eval, and then, if that gives its "
        "magic number, posix.system (never called here)"
    ) in r.stderr, r
    assert not (tmp_path / SENTINEL).exists()
