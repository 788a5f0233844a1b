"""`--count-shared-once`: tied names counted once in the global norm, as torch's clip_grad_norm_ counts them.

`tests/data/torch/tied_grads.pt` holds the gradients of a model whose output layer is its embedding, by every
parameter name (the tied pair on one storage); `tied_grads.clip.json` what real torch 2.13's
`clip_grad_norm_(model.parameters(), 1.0)` returned and left, and the same norm summed exactly in float64
(make_torch_files.py).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers import DATA, js, ok, run

TIED = DATA / "torch" / "tied_grads.pt"
TORCH = json.loads((DATA / "torch" / "tied_grads.clip.json").read_text())
LISTED = json.loads((DATA / "torch" / "tied_grads.pt.json").read_text())
NAMES = ["emb.weight", "mid.weight", "mid.bias", "head.weight"]


def test_tied_names_count_once_as_clip_grad_norm_counts_them_and_each_keeps_its_row():
    outputs = [ok("global-norm", TIED, "--count-shared-once", "--format", "json", "--jobs", j).stdout for j in (1, 2)]
    assert outputs[0] == outputs[1]
    report = json.loads(outputs[0])["checkpoints"][0]
    assert report["global_norm"] == pytest.approx(TORCH["exact_norm"], rel=1e-15)
    assert report["global_norm"] == pytest.approx(TORCH["total_norm"], rel=1e-6)  # torch sums in float32
    assert [t["name"] for t in report["tensors"]] == NAMES
    assert report["shared_storage"] == [["emb.weight", "head.weight"]]
    shares = {t["name"]: t["share"] for t in report["tensors"]}
    assert shares["emb.weight"] == shares["head.weight"]
    assert math.fsum(shares[n] for n in NAMES[:3]) == pytest.approx(1.0, rel=1e-14)
    # without the option, both names count (the state dict's view): the norms listed by torch, all four
    every = js("global-norm", TIED)["checkpoints"][0]["global_norm"]
    assert every == pytest.approx(math.sqrt(math.fsum(t["norm"] ** 2 for t in LISTED["tensors"])), rel=1e-15)
    assert every > report["global_norm"]


def test_other_views_of_a_storage_still_count():
    views = DATA / "torch" / "views.pt"
    once = js("global-norm", views, "--count-shared-once")["checkpoints"][0]
    assert once == js("global-norm", views)["checkpoints"][0]


def test_with_depth_a_tied_tensor_counts_once_in_each_group():
    report = js("global-norm", TIED, "--count-shared-once", "--depth", "1")["checkpoints"][0]
    norms = {t["name"]: t["norm"] for t in report["tensors"]}
    groups = {g["name"]: g["norm"] for g in report["groups"]}
    assert groups["emb"] == norms["emb.weight"] and groups["head"] == norms["head.weight"]
    assert groups["mid"] == pytest.approx(math.hypot(norms["mid.weight"], norms["mid.bias"]), rel=1e-15)


@pytest.mark.parametrize("jobs", [1, 2])
def test_clip_global_norm_writes_every_name_scaled_by_the_one_scale(tmp_path, jobs):
    out = tmp_path / "clipped.safetensors"
    report = js("clip-global-norm", TIED, "-o", out, "--clip-norm", 1, "--count-shared-once", "--jobs", jobs)
    c = report["checkpoints"][0]
    scale = 1.0 / TORCH["exact_norm"]
    assert c["scale"] == pytest.approx(scale, rel=1e-15)
    assert c["global_norm_after"] == pytest.approx(1.0, rel=1e-6)
    got = load_file(out)
    assert sorted(got) == sorted(NAMES)
    for name in NAMES:
        before = np.array(TORCH["before"][name], np.float32)
        # clipcli's arithmetic: float32(x) * float32(scale), one rounding
        want = before * np.float32(c["scale"])
        assert got[name].reshape(-1).tobytes() == want.tobytes(), name
        # torch's clip_grad_norm_ scales by max_norm / (total_norm + 1e-6), in float32
        np.testing.assert_allclose(got[name].reshape(-1), np.array(TORCH["after"][name], np.float32), rtol=2e-6)


def test_clip_global_norm_without_the_option_counts_both_names(tmp_path):
    c = js("clip-global-norm", TIED, "--clip-norm", 1, "--dry-run")["checkpoints"][0]
    assert c["global_norm"] == pytest.approx(math.sqrt(math.fsum(t["norm"] ** 2 for t in LISTED["tensors"])))


def test_the_option_is_a_usage_error_where_it_means_nothing():
    result = run("clip-norm", TIED, "--clip-norm", 1, "--dry-run", "--count-shared-once")
    assert result.exit_code == 2
    assert "--count-shared-once" in result.stderr
