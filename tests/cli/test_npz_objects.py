"""Object members of an .npz (pickled arrays): listed with their pickle audit, skipped by norms, carried through.

The files in tests/data/npz were written by NumPy (make_npz_files.py), the hostile one opcode by opcode. No test
here loads a pickle of a hostile file: references come from NumPy's header reader, `zipfile` and `pickletools`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

import clipcli
from tests.helpers import DATA, byte_mutations, fnorm, js, ok, pickletools_calls, run

NPZ = DATA / "npz"
OBJECTS = ["objects.npz", "objects_deflate.npz", "objects_bzip2.npz", "objects_lzma.npz"]
NUMERIC = ("w", "b")
CARRIED = {"cfg": "object", "mixed": "object", "rows": "structured"}
HOSTILE = NPZ / "hostile_object.npz"


def members(path: Path) -> dict[str, tuple[bytes, int]]:
    """Each member's bytes and compression method, as `zipfile` reads them."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: (z.read(i), i.compress_type) for i in z.infolist()}


def header_and_pickle(member: bytes) -> tuple[tuple[int, ...], bytes]:
    """A .npy member's shape (NumPy's own header reader) and the bytes after its header."""
    import io

    f = io.BytesIO(member)
    np.lib.format.read_magic(f)
    shape, _, _ = np.lib.format.read_array_header_1_0(f)
    return shape, member[f.tell() :]


def numeric(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:  # the numeric members only: no pickle is loaded
        return {k: z[k] for k in NUMERIC}


@pytest.mark.parametrize("name", OBJECTS)
def test_object_members_are_listed_with_numpys_shapes_and_the_audit_of_their_pickles(name):
    path = NPZ / name
    result = run("inspect", path, "--format", "json")
    assert (result.exit_code, result.stderr) == (0, "")  # NumPy's own globals only: no warning
    listing = json.loads(result.stdout)["checkpoints"][0]
    rows = {t["name"]: t for t in listing["tensors"]}
    raw = members(path)
    for member, (data, _) in raw.items():
        shape, pickled = header_and_pickle(data)
        row = rows[member[:-4]]
        assert row["shape"] == list(shape)
        if member[:-4] in CARRIED:
            assert (row["dtype"], row["nbytes"]) == (CARRIED[member[:-4]], len(pickled))
    # gh-24: the summary counted object members among the tensors and their items among the parameters
    numeric_rows = [t for t in listing["tensors"] if t["dtype"] != "object"]
    objects = sum(1 for n, d in CARRIED.items() if d == "object")
    assert (listing["tensor_count"], listing["object_count"]) == (len(numeric_rows), objects)
    assert listing["elements"] == sum(int(np.prod(t["shape"])) for t in numeric_rows)
    assert listing["nbytes"] == sum(t["nbytes"] for t in listing["tensors"])
    head = ok("inspect", path).stdout.splitlines()[0]
    assert head.startswith(f"{path}: npz, {len(numeric_rows)} tensors, {listing['elements']} parameters, {objects} "
                           "pickled objects, ")  # fmt: skip
    calls = set().union(*(pickletools_calls(header_and_pickle(raw[f"{n}.npy"][0])[1]) for n in CARRIED))
    audit = listing["pickle"]
    assert {g["name"] for g in audit["globals"] if g["use"] == "call"} == calls
    assert audit["loads_with_weights_only"] is False  # torch's allowlist holds no NumPy global


def test_the_library_reads_an_object_member_as_its_pickles_bytes():
    # gh: clipcli.open(...).read of an object member raised NumPy's "cannot create an OBJECT array from memory buffer"
    path = NPZ / "objects_deflate.npz"
    with clipcli.open(path) as ckpt:
        got = ckpt.read("cfg")
        assert ckpt.pickle["globals"]
    assert got.dtype == np.uint8 and got.tobytes() == header_and_pickle(members(path)["cfg.npy"][0])[1]


def test_the_table_names_numpys_loader_not_torchs_for_an_npz_audit():
    # found in review: the inspect table said "torch.load(weights_only=True) does not load" of an .npz
    text = run("inspect", NPZ / "objects.npz").stdout
    assert "np.load(allow_pickle=True)" in text and "torch.load" not in text, text


def test_an_npz_without_object_members_has_no_audit(tmp_path):
    path = tmp_path / "plain.npz"
    np.savez(path, w=np.ones(3, np.float32))
    assert "pickle" not in js("inspect", path)["checkpoints"][0]


@pytest.mark.parametrize("name", OBJECTS)
def test_norms_skip_object_members_with_the_reason_and_jobs_give_the_same_bytes(name):
    path = NPZ / name
    outputs = [ok("global-norm", path, "--format", "json", "--jobs", jobs).stdout for jobs in (1, 2)]
    assert outputs[0] == outputs[1]
    report = json.loads(outputs[0])["checkpoints"][0]
    assert report["global_norm"] == pytest.approx(fnorm(numeric(path).values()), rel=1e-15)
    assert {s["name"]: (s["dtype"], s["reason"]) for s in report["skipped"]} == {
        n: (d, f"no arithmetic on {d} (carried as bytes)") for n, d in CARRIED.items()
    }


@pytest.mark.parametrize("name", OBJECTS)
@pytest.mark.parametrize(
    "command",
    [
        ["clip-global-norm", "--clip-norm", "1"],
        ["clip-norm", "--clip-norm", "1"],
        ["clip-value", "--min", "-0.5", "--max", "0.5"],
        ["convert"],
    ],
    ids=lambda c: c[0],
)
def test_clips_and_convert_carry_object_members_byte_for_byte_in_their_compression(tmp_path, name, command):
    path, out = NPZ / name, tmp_path / "out.npz"
    ok(command[0], path, "-o", out, *command[1:])
    before, after = members(path), members(out)
    assert list(after) == list(before)
    for member in (f"{n}.npy" for n in CARRIED):
        assert after[member] == before[member]
    assert {m: c for m, (_, c) in after.items()} == {m: c for m, (_, c) in before.items()}
    if command[0] == "convert":
        assert all(after[m] == before[m] for m in before)
        with np.load(out, allow_pickle=True) as z:  # written by NumPy itself (make_npz_files.py): safe to load
            assert z["cfg"].item() == {"lr": 0.1, "betas": (0.9, 0.999), "name": "run-7"}


def test_an_object_member_cannot_go_into_safetensors_unless_left_out(tmp_path):
    path, out = NPZ / "objects.npz", tmp_path / "out.safetensors"
    result = run("convert", path, "-o", out)
    assert result.exit_code == 3
    assert result.stderr.startswith(f"clipcli: error: {out}: tensor cfg: ")
    assert result.stderr.count("\n") == 1
    assert not out.exists()
    ok("convert", path, "-o", out, *(x for n in CARRIED for x in ("--exclude", n)))
    got, want = load_file(out), numeric(path)
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in want.items()}


def test_an_object_npy_is_listed_with_its_audit_and_written_back_whole(tmp_path):
    path = tmp_path / "cfg.npy"
    np.save(path, np.array({"lr": 0.1}, dtype=object), allow_pickle=True)
    listing = js("inspect", path)["checkpoints"][0]
    assert [(t["name"], t["dtype"], t["shape"]) for t in listing["tensors"]] == [("cfg", "object", [])]
    _, pickled = header_and_pickle(path.read_bytes())
    assert {g["name"] for g in listing["pickle"]["globals"] if g["use"] == "call"} == pickletools_calls(pickled)
    (tmp_path / "copy").mkdir()
    ok("convert", path, "-o", tmp_path / "copy" / "cfg.npy")
    assert (tmp_path / "copy" / "cfg.npy").read_bytes() == path.read_bytes()


def test_a_hostile_object_member_is_audited_warned_and_gated_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the payloads would create PWNED
    raw = members(HOSTILE)
    calls = set().union(*(pickletools_calls(header_and_pickle(raw[m][0])[1]) for m in ("system.npy", "eval.npy")))
    assert calls == {"os.system", "builtins.eval"}
    warning = (
        f"clipcli: warning: {HOSTILE}: np.load(allow_pickle=True) would call builtins.eval, os.system "
        "(never called here)\n"
    )
    for command in (["inspect"], ["global-norm"], ["hash"], ["clip-global-norm", "-o", "out.npz", "--clip-norm", "1"]):
        result = run(command[0], HOSTILE, *command[1:])
        assert (result.exit_code, result.stderr) == (0, warning), result.output
        result = run(command[0], HOSTILE, *command[1:], "--fail-unsafe-pickle")
        assert result.exit_code == 1
        assert result.stderr.endswith(" (--fail-unsafe-pickle)\n")
    audit = js("inspect", HOSTILE)["checkpoints"][0]["pickle"]
    assert {g["name"] for g in audit["globals"] if g["use"] == "call"} == calls
    assert hashlib.sha256(members(Path("out.npz"))["system.npy"][0]).digest() == (
        hashlib.sha256(raw["system.npy"][0]).digest()
    )
    report = js("global-norm", HOSTILE)["checkpoints"][0]
    assert report["global_norm"] == pytest.approx(fnorm([np.load(HOSTILE, allow_pickle=False)["w"]]), rel=1e-15)
    assert not (tmp_path / "PWNED").exists()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_mutated_object_members_are_read_or_refused_in_one_line_and_nothing_is_imported(data, tmp_path_factory):
    # the hostile members' pickles and a real object array's, mutated: exit 0 (with or without a warning) or 3
    raw = members(HOSTILE)
    name = data.draw(st.sampled_from(["system.npy", "eval.npy"]))
    member = raw[name][0]
    header_length = len(member) - len(header_and_pickle(member)[1])
    mutated = member[:header_length] + data.draw(byte_mutations(member[header_length:]))
    path = tmp_path_factory.mktemp("fuzz") / "m.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("w.npy", raw["w.npy"][0])
        z.writestr(name, mutated)
    run("inspect", HOSTILE, "--format", "json")  # what reading any object member imports, imported
    modules = set(sys.modules)
    result = run("inspect", path, "--format", "json")
    assert result.exit_code in (0, 3), result.output
    lines = result.stderr.splitlines()
    assert all(line.startswith(("clipcli: warning: ", "clipcli: error: ")) for line in lines) and len(lines) <= 1
    assert set(sys.modules) == modules  # nothing a pickle names is imported
    assert not Path("PWNED").exists()
