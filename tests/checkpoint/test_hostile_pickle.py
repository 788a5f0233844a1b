"""PyTorch files and the pickle machine: hostile and misread files, crafted here without torch."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import tarfile
import warnings
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from clipcli.checkpoint import open_checkpoint
from clipcli.checkpoint.formats.torch import read_torch
from clipcli.checkpoint.registry import describe as sniff
from clipcli.checkpoint.registry import file_format
from clipcli.errors import MalformedError, UnsupportedError
from tests.helpers import DATA, run_bounded, torch_legacy, torch_tensor_pickle, torch_zip_file, torchscript_jit

ONE = struct.pack("<f", 1.0) * 4  # the bytes of a 4-element float32 storage of ones

# T(k+1) = (Tk, Tk), 60 levels through DUP: 2**60 tuples for hash() to walk, from 2 bytes a level
TUPLE_DAG = b"K\x00K\x00\x86" + b"2\x86" * 60
# the same as a dict key: hashing it never returns (and SIGTERM is never handled inside C)
HASH_BOMB = b"\x80\x02}" + TUPLE_DAG + b"Ns."


def refused(r, words: str = "") -> bool:
    """Exit 3 with one `clipcli: error:` line (holding `words`), quickly and in little memory."""
    lines = r.stderr.splitlines()
    return (
        r.returncode == 3
        and len(lines) == 1
        and lines[0].startswith("clipcli: error: ")
        and words in lines[0]
        and r.seconds < 5
        and r.peak_mb < 300
    )


# -- One zip, at byte 0 ----------------------------------------------------------------------------------


def test_one_file_of_a_distributed_checkpoint_is_refused_naming_its_directory(tmp_path: Path) -> None:
    # issue 22 item 1: __0_0.distcp named alone was read as its last archive: one tensor __0_0, exit 0
    directory = tmp_path / "ckpt"
    shutil.copytree(DATA / "dcp" / "megatron", directory)
    r = run_bounded("global-norm", directory / "__0_0.distcp", seconds=30)
    assert refused(r, "one file of a distributed checkpoint"), r
    assert f"name its directory ({directory})" in r.stderr
    assert run_bounded("global-norm", directory, seconds=30).returncode == 0


def test_two_concatenated_archives_are_refused(tmp_path: Path) -> None:
    # issue 22 item 1: zipfile reads the last of two archives in one file; torch reads only one at byte 0
    first = torch_zip_file(
        tmp_path / "a.pt", b"\x80\x02}X\x01\x00\x00\x00a" + torch_tensor_pickle() + b"s.", {"0": ONE}
    )
    second = torch_zip_file(
        tmp_path / "b.pt", b"\x80\x02}X\x01\x00\x00\x00b" + torch_tensor_pickle() + b"s.", {"0": ONE}
    )
    both = tmp_path / "both.pt"
    both.write_bytes(first.read_bytes() + second.read_bytes())
    with pytest.raises(MalformedError, match=f"first record is at byte {first.stat().st_size}, not 0"):
        read_torch(both)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"PK\x03\x04" + bytes(60) + first.read_bytes())
    with pytest.raises(MalformedError, match="not 0"):
        read_torch(garbage)
    assert refused(run_bounded("global-norm", both), "not 0")
    assert [t.name for t in read_torch(first)[1]] == ["a"]


# -- Hash bombs -------------------------------------------------------------------------------------------


def test_tuple_hash_bomb_in_a_legacy_file_is_refused_quickly(tmp_path: Path) -> None:
    # issue 22 item 3: a 60-level tuple DAG as a dict key: hash() walked 2**60 tuples, never ending
    path = torch_legacy(tmp_path / "bomb.pt", HASH_BOMB)
    assert path.stat().st_size < 300
    r = run_bounded("inspect", path, seconds=10, memory_mb=1024)
    assert refused(r, "once its shared members are expanded"), r


def test_tuple_hash_bomb_in_a_zip_file_and_a_dcp_metadata_is_refused_quickly(tmp_path: Path) -> None:
    # issue 22 item 3: the same bomb in a zip .pt's data.pkl, and in a distributed checkpoint's .metadata
    r = run_bounded("inspect", torch_zip_file(tmp_path / "bomb.pt", HASH_BOMB), seconds=10, memory_mb=1024)
    assert refused(r, "expanded"), r
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    signature = b"ctorch.distributed.checkpoint.metadata\nMetadata\n"
    (dcp / ".metadata").write_bytes(HASH_BOMB[:-1] + b"0" + signature + b"0N.")
    r = run_bounded("inspect", dcp, seconds=10, memory_mb=1024)
    assert refused(r, "expanded"), r


def test_shared_tuples_that_are_hashed_again_and_again_are_charged(tmp_path: Path) -> None:
    # issue 22 item 3: a tuple of 2**12 items (its expansion allowed) used as a key 20,000 times in 40 kB
    dag = b"K\x00K\x00\x86" + b"2\x86" * 12 + b"q\x00"
    data = b"\x80\x02" + dag + b"0}(" + b"h\x00N" * 20_000 + b"u."
    with pytest.raises(MalformedError, match="more data than it holds"):
        read_torch(torch_zip_file(tmp_path / "keys.pt", data))


def test_frozenset_dag_rendered_as_metadata_is_refused_quickly(tmp_path: Path) -> None:
    # issue 22 item 3: FS(k+1) = frozenset({FS(k), (FS(k),)}) as a leaf: rendering it walked 2**k members
    level = b"0(h\x00h\x00\x85\x91q\x00"  # POP FSk, MARK, FSk, (FSk,), FROZENSET, memoized as the next FSk
    data = b"\x80\x04}X\x01\x00\x00\x00x(\x91q\x00" + level * 40 + b"s."
    r = run_bounded("inspect", torch_zip_file(tmp_path / "sets.pt", data), seconds=10, memory_mb=1024)
    assert refused(r), r
    assert "expanded" in r.stderr or "its dicts and sets more data than it holds" in r.stderr


def test_nested_tuples_within_the_budget_are_read(tmp_path: Path) -> None:
    # issue 22 item 3: the bound counts items as hashing visits them; a plain nested key is untouched
    key = (1, (2, (3, "a")), frozenset({4}))
    data = pickle.dumps({key: 1.5, "t": tuple(range(1000))}, 4)
    metadata, _ = read_torch(torch_zip_file(tmp_path / "ok.pt", data))
    assert metadata["(1, (2, (3, 'a')), frozenset({4}))"] == "1.5" and metadata["t.999"] == "999"


# -- A compressed pickle -------------------------------------------------------------------------------


def test_compressed_data_pkl_is_refused_before_unpickling(tmp_path: Path) -> None:
    # issue 22 item 4: 20 MB of EMPTY_DICT deflated to ~20 kB: 20 M dicts (1.3 GB) from a small file
    data = b"\x80\x02](" + b"}" * 20_000_000 + b"e."
    path = torch_zip_file(tmp_path / "deflated.pt", data, compression=zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 100_000
    r = run_bounded("inspect", path, seconds=10, memory_mb=1024)
    assert refused(r, "record archive/data.pkl is compressed"), r


# -- Names fanned out through the memo -------------------------------------------------------------------


def fan_out(k: int) -> bytes:
    """One tensor in a list of k references, that list k times: k*k names from 4*k bytes."""
    return b"\x80\x02" + torch_tensor_pickle() + b"q\x00]q\x01(" + b"h\x00" * k + b"e](" + b"h\x01" * k + b"e."


def test_one_tensor_named_490000_times_is_refused_quickly(tmp_path: Path) -> None:
    # issue 22 item 5: 3 kB naming one tensor 490,000 times: inspect 22-49 s and 800 MB; now 2 units a byte
    path = torch_zip_file(tmp_path / "fan.pt", fan_out(700), {"0": ONE})
    assert path.stat().st_size < 4000
    for command in ("inspect", "global-norm"):
        r = run_bounded(command, path, seconds=10, memory_mb=1024)
        assert refused(r, f"more tensors and values than its {len(fan_out(700))} bytes justify"), r


def test_the_largest_fan_out_a_small_file_is_allowed_stays_cheap(tmp_path: Path) -> None:
    # issue 22 item 5: just inside the budget (42*42 names from 300 bytes): ~1 s and 50 MB alone (the
    # bounds leave room for a loaded machine, and for pytest's own size, which a forked child's peak includes)
    path = torch_zip_file(tmp_path / "fan.pt", fan_out(42), {"0": ONE})
    r = run_bounded("global-norm", path, seconds=20, memory_mb=1024)
    assert r.returncode == 0 and "over 1,764 tensors" in r.stdout and r.seconds < 10 and r.peak_mb < 300, r
    with pytest.raises(MalformedError, match="more tensors"):
        read_torch(torch_zip_file(tmp_path / "f.pt", fan_out(60), {"0": ONE}))


# -- Tensor flags ------------------------------------------------------------------------------------------


def flagged(path: Path, flags: dict[str, bool]) -> Path:
    metadata = b"ccollections\nOrderedDict\n)R" + b"".join(pickle.dumps(k, 2)[2:-1] + b"\x88s" for k in flags)
    return torch_zip_file(
        path, b"\x80\x02}X\x01\x00\x00\x00w" + torch_tensor_pickle(flags=metadata) + b"s.", {"0": ONE}
    )


def test_unknown_tensor_flags_are_named_escaped_and_bounded(tmp_path: Path) -> None:
    # issue 22 item 10: a flag named "\x1b]0;...\x07\x1b[2J" set the terminal's title and cleared it
    path = flagged(tmp_path / "esc.pt", {"\x1b]0;owned\x07\x1b[2J": True})
    (t,) = read_torch(path)[1]
    assert t.skip_reason == "tensor flags that torch never writes (\\x1b]0;owned\\x07\\x1b[2J)"
    r = run_bounded("global-norm", path)
    assert r.returncode == 0 and "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout + r.stderr
    (t,) = read_torch(flagged(tmp_path / "many.pt", {f"{i}" * 10_000: True for i in range(9)}))[1]
    assert len(t.skip_reason) < 200 and t.skip_reason.endswith(" and 6 more)")


def test_torchs_own_flags_keep_their_reasons(tmp_path: Path) -> None:
    # issue 22 item 10: conj and neg are the flags torch writes (torch._utils.get_tensor_metadata)
    reasons = {
        "conj": "conjugate view: torch conjugates the stored values on load",
        "neg": "negative view: torch negates the stored values on load",
    }
    for flag, reason in reasons.items():
        assert read_torch(flagged(tmp_path / f"{flag}.pt", {flag: True}))[1][0].skip_reason == reason
    both = read_torch(flagged(tmp_path / "both.pt", {"neg": True, "conj": True}))[1][0].skip_reason
    assert both == "conjugate and negative view: torch conjugates and negates the stored values on load"


# -- Every float8 type torch saves -------------------------------------------------------------------------

FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


@pytest.mark.parametrize("name", FLOAT8)
def test_float8_tensors_and_their_views_read_as_ml_dtypes_casts(tmp_path: Path, name: str) -> None:
    # issue 22 item 13: a strided float8_e5m2 view exited 70 ('<f1' not understood in as_strided) and
    # float8_e8m0fnu was listed with 0 bytes; float8.pt is torch's (tests/data/torch/make_torch_files.py)
    dtype = np.dtype(getattr(ml_dtypes, name))
    want = {t["name"]: t for t in json.loads((DATA / "torch" / "float8.pt.json").read_text())["tensors"]}
    with open_checkpoint(DATA / "torch" / "float8.pt") as ckpt:
        by_name = {t.name: t for t in ckpt.tensors}
        base = np.concatenate(list(ckpt.chunks(by_name[name]))).reshape(3, 4)
        assert base.dtype == dtype and by_name[name].nbytes == 12
        for suffix, view in (("", base), ("_t", base.T), ("_step", base.reshape(-1)[1::3])):
            t = by_name[name + suffix]
            values = np.concatenate(list(ckpt.chunks(t)))
            assert values.tobytes() == np.ascontiguousarray(view).tobytes()
            wide = values.astype(np.float64)
            assert np.sqrt(np.sum(wide * wide)) == pytest.approx(want[t.name]["norm"], rel=1e-12)
    out = tmp_path / "out.safetensors"
    r = run_bounded("convert", DATA / "torch" / "float8.pt", "-o", out, "--include", f"{name}*", seconds=30)
    assert r.returncode == 0, r
    with open_checkpoint(out) as converted:
        t = next(t for t in converted.tensors if t.name == name + "_t")
        assert bytes(b"".join(c.tobytes() for c in converted.chunks(t))) == np.ascontiguousarray(base.T).tobytes()


def test_float8_e8m0fnu_reads_as_ml_dtypes_casts_without_torch(tmp_path: Path) -> None:
    # issue 22 item 13: every byte of an e8m0 storage reads as ml_dtypes' cast of it (0xff is its NaN)
    raw = bytes(range(256))
    # as torch writes it: _rebuild_tensor_v3 of an UntypedStorage, the dtype where v2 has the flags
    tensor = torch_tensor_pickle(numel=256, size=(16, 16), stride=(1, 16), flags=b"ctorch\nfloat8_e8m0fnu\n")
    tensor = tensor.replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v3")
    data = (
        b"\x80\x02}X\x01\x00\x00\x00e"
        + tensor.replace(b"torch\nFloatStorage", b"torch.storage\nUntypedStorage")
        + b"s."
    )
    with open_checkpoint(torch_zip_file(tmp_path / "e8.pt", data, {"0": raw})) as ckpt:
        (t,) = ckpt.tensors
        values = np.concatenate(list(ckpt.chunks(t)))
    want = np.frombuffer(raw, ml_dtypes.float8_e8m0fnu).reshape(16, 16).T.reshape(-1)
    assert values.dtype == want.dtype and values.tobytes() == want.tobytes()
    assert np.isnan(values.astype(np.float32)).sum() == 1


def test_types_nothing_holds_are_listed_with_their_reason(tmp_path: Path) -> None:
    # issue 22 item 13: complex32 (two float16) and float4_e2m1fn_x2 (two 4-bit floats a byte) are skipped
    (packed,) = [t for t in read_torch(DATA / "torch" / "float8.pt")[1] if t.name == "packed"]
    assert packed.skip_reason == "dtype float4_e2m1fn_x2 has no NumPy type" and packed.dtype is None


# -- Torch archives and legacy files under any name -------------------------------------------------------


def test_torchscript_under_an_unknown_suffix_reads_as_torchscript(tmp_path: Path) -> None:
    # issue 22 item 21: a .jit whose first record is not data.pkl was read as an .npz (126 byte tensors); issue 24
    # item 3: it reads as the TorchScript archive it is
    path = torchscript_jit(tmp_path)
    assert file_format(path) == "torch"
    r = run_bounded("inspect", path)
    assert r.returncode == 0 and "linear.weight" in r.stdout and "float32" in r.stdout, r
    npz = tmp_path / "arrays.data"
    np.savez(npz.with_suffix(".npz"), x=np.ones(2))
    npz.with_suffix(".npz").rename(npz)
    assert file_format(npz) == "npz"


@pytest.mark.parametrize("protocol", [0, 1, 2, 3, 4, 5])
def test_legacy_files_of_every_pickle_protocol_are_recognised(tmp_path: Path, protocol: int) -> None:
    # issue 22 item 21: legacy files saved with pickle protocols 1, 4 and 5 were not sniffed as PyTorch
    obj = b"\x80\x02}X\x01\x00\x00\x00w" + torch_tensor_pickle(legacy=True) + b"s."
    path = torch_legacy(tmp_path / "weights.data", obj, {"0": ONE}, protocol)
    assert file_format(path) == "torch"
    r = run_bounded("global-norm", path)
    assert r.returncode == 0 and "global norm 2 over 1 tensor" in r.stdout, r


def test_the_tar_format_names_the_right_torch_version(tmp_path: Path) -> None:
    # issue 22 item 21: torch.save dropped the tar format in 0.1.x (early 2017), not in 0.4
    path = tmp_path / "old.pt"
    with tarfile.open(path, "w") as t:
        info = tarfile.TarInfo("sys_info")
        info.size = 4
        t.addfile(info, __import__("io").BytesIO(b"\x80\x02N."))
    with pytest.raises(UnsupportedError, match=r"until early 2017 \(torch 0\.1\.x\)"):
        read_torch(path)
    assert "early 2017" in sniff(path.read_bytes()[:512]) and "0.4" not in sniff(path.read_bytes()[:512])


def test_real_torchscript_and_legacy_files_of_every_protocol_under_unknown_names(tmp_path: Path) -> None:
    # issue 22 item 21: as torch writes them (torch 2.x: torch.jit.save puts its storages before data.pkl)
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():  # torch.jit.script is deprecated
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(torch.nn.Linear(3, 2)), str(tmp_path / "model.jit"))
    r = run_bounded("inspect", tmp_path / "model.jit", "--format", "json", seconds=30)
    assert r.returncode == 0, r
    assert [t["name"] for t in json.loads(r.stdout)["checkpoints"][0]["tensors"]] == ["weight", "bias"]
    weights = {"w": torch.arange(6.0).reshape(2, 3)}
    for protocol in (1, 2, 4, 5):
        path = tmp_path / f"weights{protocol}.data"
        torch.save(weights, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
        r = run_bounded("global-norm", path, "--format", "json", seconds=30)
        assert r.returncode == 0, r
        assert json.loads(r.stdout)["checkpoints"][0]["global_norm"] == pytest.approx(
            float(torch.linalg.norm(weights["w"].double())), rel=1e-15
        )
