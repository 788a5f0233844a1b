"""Makes the sample checkpoints in this folder, deterministically: `python samples/make_samples.py`.

- grads.safetensors: gradient-like tensors of a tiny two-layer transformer in bfloat16 and float32,
  with an int64 step counter and `__metadata__`.
- grads.npz: its twin for NumPy (bfloat16 widened to float32, exactly, so the norms are the same).
- sharded/: the same tensors split over two shards with a Hugging Face `model.safetensors.index.json`.
- weights-step-1000.safetensors, weights-step-2000.safetensors: the weights of the same tiny model at two
  steps of a run (step 2000: every weight moved a little, layer 1's most, and the embeddings not at all).
- run/step-*.safetensors: the same model at steps 500, 1000, 1500, 2000 and 10000, for `trajectory`; step
  1500 is a byte-identical copy of step 1000 (the accident `trajectory` flags).
- pytorch_model.bin: the gradients as `torch.save` writes them (made with real torch when it is installed:
  `pip install torch`; without torch the committed file is kept as it is).

The safetensors files are written by hand from the format's definition (8-byte header length, JSON
header, data), independently of clipcli's own writer.
"""

from __future__ import annotations

import json
import shutil
import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

HERE = Path(__file__).resolve().parent
CODES = {"float32": "F32", "bfloat16": "BF16", "int64": "I64"}


def gradients() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(20261121)
    d, ff, vocab = 64, 128, 256
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((vocab, d)) * 0.02}
    for layer, scale in ((0, 0.05), (1, 0.8)):  # layer 1's gradients are the large ones
        p = f"model.layers.{layer}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}.self_attn.{name}.weight"] = rng.standard_normal((d, d)) * scale
        tensors[f"{p}.mlp.up_proj.weight"] = rng.standard_normal((ff, d)) * scale
        tensors[f"{p}.mlp.down_proj.weight"] = rng.standard_normal((d, ff)) * scale
        tensors[f"{p}.input_layernorm.weight"] = rng.standard_normal(d) * scale * 0.1
    tensors["model.norm.weight"] = rng.standard_normal(d) * 0.01
    out = {}
    for name, value in tensors.items():
        dtype = ml_dtypes.bfloat16 if "mlp" in name or "embed" in name else np.float32
        out[name] = value.astype(np.float32).astype(dtype)
    out["step"] = np.array(1200, np.int64)
    return out


def weights(step: int) -> dict[str, np.ndarray]:
    """A tiny model's float32 weights at a step of a run: later steps moved the layers (layer 1 most)."""
    rng = np.random.default_rng(7)
    d, ff, vocab = 32, 64, 128
    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, d)) * 0.02}
    for layer in (0, 1):
        p = f"model.layers.{layer}"
        out[f"{p}.self_attn.qkv_proj.weight"] = rng.standard_normal((3 * d, d)) * 0.05
        out[f"{p}.mlp.up_proj.weight"] = rng.standard_normal((ff, d)) * 0.05
        out[f"{p}.mlp.down_proj.weight"] = rng.standard_normal((d, ff)) * 0.05
    moved = np.random.default_rng(step)
    for name in list(out):
        rate = 0.0 if "embed" in name else 1e-4 if "layers.0" in name else 1e-3
        out[name] = (out[name] + moved.standard_normal(out[name].shape) * rate * step / 1000).astype(np.float32)
    return out


def write_pytorch(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """`torch.save` of the tensors, if torch is installed (the file is committed: torch is never required)."""
    try:
        import torch
    except ImportError:
        return
    state = {}
    for name, value in tensors.items():
        if value.dtype == ml_dtypes.bfloat16:
            state[name] = torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16)
        else:
            state[name] = torch.from_numpy(np.array(value))
    torch.save(state, path)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, value in tensors.items():
        header[name] = {
            "dtype": CODES[value.dtype.name],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + value.nbytes],
        }
        offset += value.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for value in tensors.values():
            f.write(np.ascontiguousarray(value).tobytes())


def write_npz(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Like `np.savez`, but with a fixed timestamp so the bytes never change."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, value in tensors.items():
            with z.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w") as member:
                np.lib.format.write_array(member, value, allow_pickle=False)


def main() -> None:
    tensors = gradients()
    metadata = {"format": "pt", "source": "clipcli samples/make_samples.py"}
    write_safetensors(HERE / "grads.safetensors", tensors, metadata)
    twin = {k: v.astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v for k, v in tensors.items()}
    write_npz(HERE / "grads.npz", twin)

    sharded = HERE / "sharded"
    sharded.mkdir(exist_ok=True)
    names = list(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for shard, shard_names in halves.items():
        write_safetensors(sharded / shard, {n: tensors[n] for n in shard_names}, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    for step in (1000, 2000):
        write_safetensors(HERE / f"weights-step-{step}.safetensors", weights(step), {"step": str(step)})
    run = HERE / "run"
    run.mkdir(exist_ok=True)
    for step in (500, 1000, 2000, 10000):
        write_safetensors(run / f"step-{step}.safetensors", weights(step), {"step": str(step)})
    # the classic accident: a step saved as a byte-identical copy of the one before it
    shutil.copyfile(run / "step-1000.safetensors", run / "step-1500.safetensors")
    write_pytorch(HERE / "pytorch_model.bin", tensors)


if __name__ == "__main__":
    main()
