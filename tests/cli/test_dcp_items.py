"""Non-tensor items of a distributed checkpoint (NumPy scalars and arrays, bytes, objects): listed with their
pickle audit, never making the checkpoint unreadable; the tensors around and inside them equal torch's.

`tests/data/dcp/items` and `items.json` were written by real torch 2.13 (`make_dcp.py items`).
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from safetensors import safe_open

from tests.helpers import (
    DATA,
    PickleCall,
    PickleGlobal,
    dcp_checkpoint,
    distcp_pickles,
    js,
    ok,
    pickletools_calls,
    run,
)

ITEMS = DATA / "dcp" / "items"
EXPECTED = json.loads((DATA / "dcp" / "items.json").read_text())


def test_every_item_is_listed_and_the_tensors_are_torchs():
    listing = js("inspect", ITEMS)["checkpoints"][0]
    assert listing["metadata"] == {**listing["metadata"], **EXPECTED["metadata"]}
    want = {t["name"]: (t["dtype"], t["shape"]) for t in EXPECTED["tensors"]}
    assert {t["name"]: (t["dtype"], t["shape"]) for t in listing["tensors"]} == want
    outputs = [ok("global-norm", ITEMS, "--format", "json", "--jobs", jobs).stdout for jobs in (1, 2)]
    assert outputs[0] == outputs[1]
    report = json.loads(outputs[0])["checkpoints"][0]
    norms = {t["name"]: t["norm"] for t in report["tensors"]}
    for t in EXPECTED["tensors"]:
        assert norms[t["name"]] == pytest.approx(t["norm"], rel=1e-12, abs=0)
    exact = math.sqrt(math.fsum(t["norm"] ** 2 for t in EXPECTED["tensors"]))
    assert report["global_norm"] == pytest.approx(exact, rel=1e-12)


def test_a_numpy_array_inside_an_item_converts_byte_for_byte(tmp_path):
    # gh: a NumPy array pickled in an item was an internal error (exit 70: "no readable storage")
    out = tmp_path / "items.safetensors"
    ok("convert", ITEMS, "-o", out)
    with safe_open(out, "np") as f:
        names = list(f.keys())
        got = {n: hashlib.sha256(np.ascontiguousarray(f.get_tensor(n)).tobytes()).hexdigest() for n in names}
    assert got == {t["name"]: t["sha256"] for t in EXPECTED["tensors"]}
    ok("clip-global-norm", ITEMS, "-o", tmp_path / "clipped.safetensors", "--clip-norm", "1")


def test_the_audit_covers_the_items_pickles_exactly_and_warns_once_for_the_file_that_holds_them():
    distcp = ITEMS / "__0_0.distcp"
    pickles = distcp_pickles(ITEMS)
    assert len(pickles) >= 9  # .metadata, and an archive per item and per tensor
    calls = set().union(*map(pickletools_calls, pickles))
    result = run("inspect", ITEMS, "--format", "json")
    audit = json.loads(result.stdout)["checkpoints"][0]["pickle"]
    assert {g["name"] for g in audit["globals"] if g["use"] == "call"} == calls
    assert {"argparse.Namespace", "numpy._core.multiarray.scalar", "_io.BytesIO"} <= calls
    assert result.stderr == (
        f"clipcli: warning: {distcp}: torch.load would call _io.BytesIO, argparse.Namespace, "
        "numpy._core.multiarray._reconstruct, numpy._core.multiarray.scalar, numpy.dtype (never called here)\n"
    )


def test_a_hostile_item_is_read_inert_warned_and_gated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the payload would create PWNED
    payload = PickleCall(PickleGlobal("os", "system"), ("touch PWNED",))
    ckpt = dcp_checkpoint(
        tmp_path / "dcp", {"w": ((2,), [((0,), np.array([3.0, 4.0], np.float32))])}, {("cfg",): payload}
    )
    warning = f"clipcli: warning: {ckpt / '__0_0.distcp'}: torch.load would call os.system (never called here)\n"
    for command in (["inspect"], ["global-norm"], ["convert", "-o", "out.safetensors"]):
        result = run(command[0], ckpt, *command[1:])
        assert (result.exit_code, result.stderr) == (0, warning), result.output
        result = run(command[0], ckpt, *command[1:], "--fail-unsafe-pickle")
        assert result.exit_code == 1
        assert result.stderr.endswith("os.system (--fail-unsafe-pickle)\n")
    report = js("global-norm", ckpt)["checkpoints"][0]
    assert report["global_norm"] == 5.0
    assert js("inspect", ckpt)["checkpoints"][0]["metadata"]["cfg"] == "<os.system('touch PWNED')>"
    assert not (tmp_path / "PWNED").exists()
