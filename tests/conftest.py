"""Shared helpers: reference writers and readers built on the safetensors library and NumPy."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path
from typing import Any

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


class Bounded:
    """What a clipcli process did under a time and memory limit: its exit code, output, peak RSS and time."""

    def __init__(self, returncode: int, stdout: str, stderr: str, peak_mb: float, seconds: float):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
        self.peak_mb, self.seconds = peak_mb, seconds

    def __repr__(self) -> str:
        return (
            f"Bounded(rc={self.returncode}, peak={self.peak_mb:.0f} MB, {self.seconds:.1f} s, stderr={self.stderr!r})"
        )


def run_bounded(*args: object, seconds: float = 10, memory_mb: int = 1024, cwd: Path | None = None) -> Bounded:
    """Run `python -m clipcli ARGS` with its address space capped at `memory_mb` and killed after `seconds`.

    For hostile files: a hang comes back as returncode -9 (killed), a bomb as a MemoryError or a kill, both
    of which the caller's `assert r.returncode == 3` reports with the process's stderr. `peak_mb` is the
    child's own peak resident size (wait4), so a test can also hold a file to "a few hundred MB".
    """
    import os
    import resource
    import subprocess
    import sys
    import tempfile
    import time

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))

    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "clipcli", *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            cwd=cwd,
            preexec_fn=limit,
        )
        deadline = start + seconds
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.01)
        proc.returncode = os.waitstatus_to_exitcode(status)
        elapsed = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return Bounded(
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            usage.ru_maxrss / 1024,
            elapsed,
        )


def npy_header(shape: object, descr: str = "<f4", fortran: bool = False) -> bytes:
    """A version 2.0 .npy header with `shape` written as given (a tuple, or text such as "(0x1f,)")."""
    shape_text = shape if isinstance(shape, str) else repr(tuple(shape))
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape_text}, }}"
    body = (text + " " * (-(len(text) + 13) % 64) + "\n").encode("latin1")
    return b"\x93NUMPY\x02\x00" + struct.pack("<I", len(body)) + body


def zeros_npz(path: Path, nbytes: int, method: int, name: str = "a.npy") -> Path:
    """An .npz of one float32 member of `nbytes` zero bytes compressed by `method` (bzip2 or LZMA: a bomb).

    Compressed here, LZMA at its fastest preset, and put in the zip as stored bytes whose method, CRC-32 and
    size are then set in both headers (zipfile would compress at its own, slow, preset)."""
    import bz2
    import lzma
    import zipfile
    import zlib

    head = npy_header((nbytes // 4,))
    lzma1 = {"id": lzma.FILTER_LZMA1, "preset": 0, "dict_size": 1 << 20, "lc": 3, "lp": 0, "pb": 2}
    if method == zipfile.ZIP_BZIP2:
        compressor: Any = bz2.BZ2Compressor(9)
        prefix = b""
    else:
        compressor = lzma.LZMACompressor(lzma.FORMAT_RAW, filters=[lzma1])
        prefix = struct.pack("<BBH", 9, 4, 5) + bytes([(2 * 5 + 0) * 9 + 3]) + (1 << 20).to_bytes(4, "little")
    parts, crc = [prefix, compressor.compress(head)], zlib.crc32(head)
    block = bytes(1 << 22)
    for start in range(0, nbytes, len(block)):
        piece = block[: nbytes - start]
        crc = zlib.crc32(piece, crc)
        parts.append(compressor.compress(piece))
    parts.append(compressor.flush())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(name, b"".join(parts))
    data = bytearray(path.read_bytes())
    central = data.rindex(b"PK\x01\x02")
    for method_at, crc_at, size_at in ((8, 14, 22), (central + 10, central + 16, central + 24)):
        struct.pack_into("<H", data, method_at, method)
        struct.pack_into("<I", data, crc_at, crc)
        struct.pack_into("<I", data, size_at, len(head) + nbytes)
    path.write_bytes(bytes(data))
    return path
