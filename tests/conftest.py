"""Shared helpers: reference writers and readers built on the safetensors library and NumPy."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import safetensors.numpy
from safetensors import deserialize, serialize

try:  # safetensors >= 0.8 takes TensorSpec objects; older releases took dicts of bytes
    from safetensors import TensorSpec
except ImportError:  # pragma: no cover
    TensorSpec = None


def st_bytes(arrays: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file made by the reference library, for any dtype it knows (bf16 and fp8 included)."""
    keep = {name: np.array(a, order="C") for name, a in arrays.items()}  # ascontiguousarray makes 0-d 1-d
    if all(a.dtype.kind in "biufc" for a in keep.values()):
        return safetensors.numpy.save(keep, metadata)
    if TensorSpec is None:  # pragma: no cover
        specs = {n: {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()} for n, a in keep.items()}
    else:
        specs = {
            n: TensorSpec(dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
            for n, a in keep.items()
        }
    return bytes(serialize(specs, metadata))


def st_read(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """What the reference library reads from a file: name -> (dtype code, shape, raw bytes)."""
    return {name: (t["dtype"], list(t["shape"]), bytes(t["data"])) for name, t in deserialize(path.read_bytes())}


def raw_safetensors(header: dict, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file from a header dict as given (no validation), for malformed-file tests."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def first_tensor_norm_and_peak(path: Path):
    """The norm statistics of a checkpoint's first tensor, read in chunks, and the peak bytes allocated."""
    from clipcli.checkpoint import open_checkpoint
    from clipcli.core import NormAccumulator

    tracemalloc.start()
    try:
        with open_checkpoint(path) as ckpt:
            acc = NormAccumulator(2)
            for chunk in ckpt.chunks(ckpt.tensors[0]):
                acc.add(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return acc.result(), peak
