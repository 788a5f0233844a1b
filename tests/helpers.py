"""The tests' shared helpers: reference writers and readers, the command line in-process, hand-written files."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import pickle
import re
import struct
import sys
import tracemalloc
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import ml_dtypes
import numpy as np
import safetensors.numpy
from hypothesis import strategies as st
from safetensors import deserialize, serialize

if TYPE_CHECKING:
    from clipcli.checkpoint.formats.torch import TorchTensor

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
    from clipcli.core.norms import NormAccumulator

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


# Starts clipcli from a small process of its own and reports its peak resident size there: a forked
# child starts with its parent's resident size as its peak (kept through exec), so clipcli forked from a
# test process holding arrays would report theirs.
_LAUNCHER = """
import os, resource, signal, sys
limit, peak_file = int(sys.argv[1]) << 20, sys.argv[2]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(sys.executable, [sys.executable, "-m", "clipcli", *sys.argv[3:]])
_, status, usage = os.wait4(pid, 0)
with open(peak_file, "w") as f:
    f.write(str(usage.ru_maxrss))
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
sys.exit(os.WEXITSTATUS(status))
"""


def run_bounded(*args: object, seconds: float = 10, memory_mb: int = 1024, cwd: Path | None = None) -> Bounded:
    """Run `python -m clipcli ARGS` with its address space capped at `memory_mb` and killed after `seconds`.

    For hostile files: a hang comes back as returncode -9 (killed), a bomb as a MemoryError or a kill, both
    of which the caller's `assert r.returncode == 3` reports with the process's stderr. `peak_mb` is the
    child's own peak resident size (wait4), so a test can also hold a file to "a few hundred MB".
    """
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peak"
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(memory_mb), str(peak_file), *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            cwd=cwd,
            start_new_session=True,  # the kill below reaches clipcli too
        )
        deadline = start + seconds
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.01)
        proc.returncode = os.waitstatus_to_exitcode(status)
        elapsed = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        peak = int(peak_file.read_text()) if peak_file.exists() else usage.ru_maxrss
        return Bounded(
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            peak / 1024,
            elapsed,
        )


# -- torch.save files and distributed checkpoints written by hand (no torch needed) ----------------------


class PickleGlobal(NamedTuple):
    """A GLOBAL opcode in a hand-written pickle."""

    module: str
    name: str


class PickleCall(NamedTuple):
    """A REDUCE of `func` on `args`."""

    func: Any
    args: tuple


class PickleObj(NamedTuple):
    """A dataclass as pickle writes one: NEWOBJ of its class with no arguments, then BUILD `state`."""

    cls: PickleGlobal
    state: Any


class PickleDict(NamedTuple):
    """A dict of (key, value) pairs whose keys need not be hashable here."""

    items: list


class PicklePid(NamedTuple):
    """A BINPERSID of a persistent id."""

    value: Any


def pickle_ops(x: Any) -> bytes:
    """Protocol-2 opcodes that build `x` (no memo): plain data and the records above, nested in any way."""
    if isinstance(x, PickleGlobal):
        return b"c" + x.module.encode() + b"\n" + x.name.encode() + b"\n"
    if isinstance(x, PickleCall):
        return pickle_ops(x.func) + pickle_ops(tuple(x.args)) + b"R"
    if isinstance(x, PickleObj):
        return pickle_ops(x.cls) + b")\x81" + pickle_ops(x.state) + b"b"
    if isinstance(x, PicklePid):
        return pickle_ops(x.value) + b"Q"
    if isinstance(x, PickleDict):
        return b"}" + (b"(" + b"".join(pickle_ops(k) + pickle_ops(v) for k, v in x.items) + b"u" if x.items else b"")
    if isinstance(x, tuple):
        return b"(" + b"".join(pickle_ops(v) for v in x) + b"t"
    if isinstance(x, list):
        return b"]" + (b"(" + b"".join(pickle_ops(v) for v in x) + b"e" if x else b"")
    if isinstance(x, dict):
        return pickle_ops(PickleDict(list(x.items())))
    return pickle.dumps(x, protocol=2)[2:-1]  # plain data: what pickle writes for it, without PROTO and STOP


_STORAGES = {"float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage", "int64": "LongStorage"}


def torch_view(dtype: str, numel: int, shape: tuple[int, ...], strides: tuple[int, ...], offset: int = 0) -> Any:
    """A tensor `_rebuild_tensor_v2` makes: a view (`shape`, `strides`, `offset`) of storage "0" of `numel` elements."""
    pid = PicklePid(("storage", PickleGlobal("torch", _STORAGES[dtype]), "0", "cpu", numel))
    rebuild = PickleGlobal("torch._utils", "_rebuild_tensor_v2")
    ordered = PickleCall(PickleGlobal("collections", "OrderedDict"), ())
    return PickleCall(rebuild, (pid, offset, tuple(shape), tuple(strides), False, ordered))


def torch_zip(obj: Any, storages: dict[str, bytes]) -> bytes:
    """A torch.save zip file of a pickled object and its storages, laid out as torch writes one."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02" + pickle_ops(obj) + b".")
        z.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")
    return buffer.getvalue()


_DCP = "torch.distributed.checkpoint.metadata"


def _dcp_obj(cls: str, state: Any, module: str = _DCP) -> PickleObj:
    return PickleObj(PickleGlobal(module, cls), state)


def _size(dims: tuple[int, ...]) -> PickleCall:
    return PickleCall(PickleGlobal("torch", "Size"), (tuple(dims),))


def dcp_metadata(
    tensors: dict[str, tuple[str, tuple[int, ...], list]], storage: dict[tuple[str, tuple | None], tuple]
) -> bytes:
    """A `.metadata` pickle: tensors (dtype, global shape, chunks as (offsets, sizes)), and where each chunk
    (name, offsets) or non-tensor item (name, None) lies: (relative path, offset, length)."""
    sd: dict[str, Any] = {}
    for name, (dtype, shape, chunks) in tensors.items():
        layout = PickleCall(PickleGlobal("torch.serialization", "_get_layout"), ("torch.strided",))
        memory = PickleCall(PickleGlobal(_DCP, "_MEM_FORMAT_ENCODING"), (0,))
        properties = _dcp_obj("TensorProperties", (PickleGlobal("torch", dtype), layout, False, memory, False))
        chunk_list = [_dcp_obj("ChunkStorageMetadata", {"offsets": _size(o), "sizes": _size(s)}) for o, s in chunks]
        state = {"properties": properties, "size": _size(shape), "chunks": chunk_list}
        sd[name] = _dcp_obj("TensorStorageMetadata", state)
    for name, offsets in storage:
        if offsets is None:
            sd[name] = _dcp_obj("BytesStorageMetadata", {})
    data = PickleDict(
        [
            (
                _dcp_obj(
                    "MetadataIndex",
                    {"fqn": name, "index": 0} if offsets is None else {"fqn": name, "offset": _size(offsets)},
                ),
                _dcp_obj(
                    "_StorageInfo",
                    {"relative_path": path, "offset": at, "length": length},
                    "torch.distributed.checkpoint.filesystem",
                ),
            )
            for (name, offsets), (path, at, length) in storage.items()
        ]
    )
    state = {"state_dict_metadata": sd, "planner_data": None, "storage_data": data, "version": "1.0.0"}
    return b"\x80\x02" + pickle_ops(_dcp_obj("Metadata", state)) + b"."


def distcp_pickles(directory: Path) -> list[bytes]:
    """The pickles of a distributed checkpoint, found without clipcli: `.metadata`, and the data.pkl of every
    torch.save archive laid one after another in its .distcp files, by their local zip headers (torch writes
    each stored, its sizes in a data descriptor), each from its first byte (it runs to its STOP opcode)."""
    out = [(directory / ".metadata").read_bytes()]
    for distcp in sorted(directory.glob("*.distcp")):
        data = distcp.read_bytes()
        for m in re.finditer(b"PK\x03\x04", data):
            name_length, extra_length = struct.unpack("<HH", data[m.start() + 26 : m.start() + 30])
            name = data[m.start() + 30 : m.start() + 30 + name_length]
            if name.endswith(b"/data.pkl"):
                out.append(data[m.start() + 30 + name_length + extra_length :])
    return out


def dcp_checkpoint(
    directory: Path,
    tensors: dict[str, tuple[tuple[int, ...], list]],
    items: dict[tuple[str, ...], Any] | None = None,
    file: str = "__0_0.distcp",
) -> Path:
    """A distributed checkpoint in one `.distcp` file: per tensor its global shape and chunks, each
    (offsets, values) or (offsets, values, (sizes, strides)): a chunk saved as a view of `values`' bytes;
    and non-tensor items, each object saved once under the names that key it. Equal torch.save files are
    written once, every entry that holds one pointing at it. `file` names the `.distcp` file."""
    directory.mkdir(parents=True, exist_ok=True)
    blob = bytearray()
    written: dict[bytes, tuple[str, int, int]] = {}

    def place(data: bytes) -> tuple[str, int, int]:
        if data not in written:
            written[data] = (file, len(blob), len(data))
            blob.extend(data)
        return written[data]

    listed, storage = {}, {}
    for names, value in (items or {}).items():
        where = place(torch_zip(value, {}))
        for name in names:
            storage[(name, None)] = where
    for name, (shape, chunks) in tensors.items():
        boxes = []
        for offsets, values, *strides in chunks:
            values = np.ascontiguousarray(values)
            sizes = values.shape if not strides else strides[0][0]
            view = strides[0][1] if strides else tuple(s // max(values.itemsize, 1) for s in values.strides)
            data = torch_zip(torch_view(values.dtype.name, values.size, sizes, view), {"0": values.tobytes()})
            storage[(name, tuple(offsets))] = place(data)
            boxes.append((tuple(offsets), tuple(sizes)))
        listed[name] = (chunks[0][1].dtype.name, tuple(shape), boxes)
    (directory / file).write_bytes(bytes(blob))
    (directory / ".metadata").write_bytes(dcp_metadata(listed, storage))
    return directory


# -- PyTorch files by hand (no torch) ----------------------------------------------------------------

TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def torch_tensor_pickle(
    key: str = "0",
    numel: int = 4,
    size: tuple[int, ...] = (4,),
    stride: tuple[int, ...] = (1,),
    storage: str = "FloatStorage",
    flags: bytes = b"ccollections\nOrderedDict\n)R",
    legacy: bool = False,
) -> bytes:
    """Protocol-2 opcodes (no PROTO, no STOP) of a tensor as torch.save writes one: _rebuild_tensor_v2 of a
    persistent storage id (a legacy file's has a sixth item, its view); `flags` are the opcodes of its
    metadata argument (an OrderedDict of flags)."""
    import pickle

    def tup(values: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(pickle.dumps(v, 2)[2:-1] for v in values) + b"t"

    pid = b"(X\x07\x00\x00\x00storagectorch\n" + storage.encode() + b"\n" + pickle.dumps(key, 2)[2:-1]
    pid += b"X\x03\x00\x00\x00cpu" + pickle.dumps(numel, 2)[2:-1] + (b"N" if legacy else b"") + b"tQ"
    args = pid + b"K\x00" + tup(size) + tup(stride) + b"\x89ccollections\nOrderedDict\n)R" + flags
    return b"ctorch._utils\n_rebuild_tensor_v2\n(" + args + b"tR"


def torch_zip_file(
    path: Path,
    data_pkl: bytes,
    storages: dict[str, bytes] | None = None,
    prefix: str = "archive",
    compression: int = 0,
) -> Path:
    """A zip laid out as torch.save writes one (its records stored unless `compression` says otherwise)."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{prefix}/data.pkl", data_pkl, compression)
        z.writestr(f"{prefix}/byteorder", "little")
        for key, data in (storages or {}).items():
            z.writestr(f"{prefix}/data/{key}", data)
        z.writestr(f"{prefix}/version", "3\n")
    return path


def torch_legacy(path: Path, obj_pkl: bytes, storages: dict[str, bytes] | None = None, protocol: int = 2) -> Path:
    """A legacy torch.save file: magic, protocol version, sys_info, the object's pickle, the storage keys, then
    each storage behind its element count (float32 elements)."""
    import pickle

    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 8}}
    parts = [pickle.dumps(x, protocol) for x in (TORCH_LEGACY_MAGIC, 1001, sys_info)]
    parts += [obj_pkl, pickle.dumps(list(storages or {}), protocol)]
    parts += [struct.pack("<q", len(data) // 4) + data for data in (storages or {}).values()]
    path.write_bytes(b"".join(parts))
    return path


def npy_header(shape: object, descr: str = "<f4", fortran: bool = False) -> bytes:
    """A version 2.0 .npy header with `shape` written as given (a tuple, or text such as "(0x1f,)")."""
    shape_text = shape if isinstance(shape, str) else repr(tuple(shape))
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape_text}, }}"
    body = (text + " " * (-(len(text) + 13) % 64) + "\n").encode("latin1")
    return b"\x93NUMPY\x02\x00" + struct.pack("<I", len(body)) + body


def zeros_npz(path: Path, nbytes: int, method: int, name: str = "a.npy") -> Path:
    """An .npz of one float32 member of `nbytes` zero bytes compressed by `method` (deflate; bzip2 or LZMA: a bomb).

    Compressed here, LZMA at its fastest preset, and put in the zip as stored bytes whose method, CRC-32 and
    size are then set in both headers (zipfile would compress at its own, slow, preset)."""
    import bz2
    import lzma
    import zipfile
    import zlib

    head = npy_header((nbytes // 4,))
    lzma1 = {"id": lzma.FILTER_LZMA1, "preset": 0, "dict_size": 1 << 20, "lc": 3, "lp": 0, "pb": 2}
    if method == zipfile.ZIP_DEFLATED:
        compressor: Any = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate, as zip holds it
        prefix = b""
    elif method == zipfile.ZIP_BZIP2:
        compressor = bz2.BZ2Compressor(9)
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


def dcp_two_regions(half: int, bump: bool = False) -> tuple[tuple[int, ...], list]:
    """Chunks of a (2,) * (2 * half + 1) tensor splitting every dimension: where the first index is 0, unit
    steps in the next `half` dimensions; where it is 1, in the last `half`. `bump`: one chunk moved onto
    its neighbour (an overlap and a hole)."""
    chunks = []
    for bits in itertools.product((0, 1), repeat=half):
        chunks.append(((0, *bits) + (0,) * half, np.ones((1,) * (1 + half) + (2,) * half, np.float32)))
    for bits in itertools.product((0, 1), repeat=half):
        chunks.append(((1,) + (0,) * half + bits, np.ones((1,) + (2,) * half + (1,) * half, np.float32)))
    if bump:
        offsets, values = chunks[-1]
        chunks[-1] = ((*offsets[:-1], 0), values)
    return (2,) * (2 * half + 1), chunks


def torchscript_jit(d: Path) -> Path:
    """A TorchScript archive (torch.jit.save's records: data.pkl not first, code/, constants.pkl) named .jit: a
    module holding a Linear, whose weight is its one parameter."""
    path = d / "model.jit"
    linear = b"c__torch__.linear\nLinear\n)\x81}(X\x06\x00\x00\x00weight" + torch_tensor_pickle() + b"ub"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/data/0", struct.pack("<f", 1.0) * 4)
        z.writestr("model/data.pkl", b"\x80\x02c__torch__\nModel\n)\x81}X\x06\x00\x00\x00linear" + linear + b"sb.")
        z.writestr("model/code/__torch__/linear.py", _LINEAR_CODE, zipfile.ZIP_DEFLATED)
        z.writestr("model/code/__torch__.py", "class Model(Module):\n  __parameters__ = []\n", zipfile.ZIP_DEFLATED)
        z.writestr("model/constants.pkl", pickle.dumps((), 2))
        z.writestr("model/version", "8\n")
    return path


_LINEAR_CODE = """class Linear(Module):
  __parameters__ = ["weight", ]
  __buffers__ = []
  weight : Tensor
  def forward(self, x): ...
"""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the command line in-process and float64 references --------------------------------------------------


ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
DATA = ROOT / "tests" / "data"
# Every checkpoint real torch wrote in tests/data (each torch.save file, each DCP directory, each TorchScript
# archive of script/): inert/ is a folder of files, each read on its own (tests/checkpoint/test_inert_pickle.py)
WRITTEN_BY_TORCH = [
    *sorted(
        p
        for p in (DATA / "torch").iterdir()
        if (p.is_dir() and p.name not in ("inert", "script")) or p.suffix in (".pt", ".pth", ".bin", ".ckpt")
    ),
    *sorted(p for p in (DATA / "torch" / "script").iterdir() if p.suffix in (".pt", ".jit", ".ptl")),
    DATA / "dcp" / "items",
    DATA / "dcp" / "sharded",
    DATA / "dcp" / "single",
]
GOLDEN = ROOT / "tests" / "golden"
ENV = {"NO_COLOR": "1", "COLUMNS": "100", "TERMINAL_WIDTH": "100"}
NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64, "F64": np.float64}


WIDE = {"NO_COLOR": "1", "COLUMNS": None, "TERMINAL_WIDTH": None}  # not a terminal, no width: no folding


def run(*args: object, env=None):
    """The command line in-process (Click's runner) with a fixed environment; an exception that is not an exit
    is raised here."""
    from typer.testing import CliRunner

    from clipcli.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args], env=env or ENV)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def ok(*args: object):
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result


def js(*args: object) -> dict:
    return json.loads(ok(*args, "--format", "json").stdout)


def reference(path: Path) -> dict[str, np.ndarray]:
    """The tensors as the safetensors library reads them (bf16 bytes viewed through ml_dtypes)."""
    return {n: np.frombuffer(data, NP_DTYPES[dt]).reshape(shape) for n, (dt, shape, data) in st_read(path).items()}


def fnorm(arrays, p=2.0) -> float:
    """A float64 p-norm of all values (math.fsum: exact up to the final rounding for p = 2)."""
    values = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
    if math.isinf(p):
        return float(np.abs(values).max())
    if p == 2:
        return math.sqrt(math.fsum(values * values))
    return math.fsum(np.abs(values) ** p) ** (1 / p)


def write_st(path: Path, tensors: dict[str, np.ndarray], metadata=None) -> Path:
    path.write_bytes(st_bytes(tensors, metadata))
    return path


def npz_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


# -- torch pickles and zips written by hand, read back as the reader would -------------------------------


def read_values(path: Path, t: TorchTensor) -> np.ndarray:
    """The tensor's values, read from its storage's bytes in the file through its view (test-only)."""
    assert t.dtype is not None and t.skip_reason is None
    raw = np.fromfile(path, dtype=np.uint8, count=t.storage_nbytes, offset=t.file_offset)
    assert raw.size == t.storage_nbytes and sys.byteorder == "little"
    raw = raw[: raw.size - raw.size % t.dtype.itemsize]
    if t.big_endian and t.dtype.itemsize > 1:  # swap each number (both halves of a complex one apart)
        unit = t.dtype.itemsize // (2 if t.dtype.kind == "c" else 1)
        raw = raw.view(f"u{unit}").byteswap().view(np.uint8)
    if t.numel == 0:
        return np.zeros(t.shape, t.dtype)
    storage = raw.view(f"V{t.dtype.itemsize}")  # as_strided cannot take ml_dtypes types: stride raw items
    view = np.lib.stride_tricks.as_strided(
        storage[t.storage_offset :],
        shape=t.shape,
        strides=tuple(s * t.dtype.itemsize for s in t.strides),
        writeable=False,
    )
    return view.copy(order="C").view(t.dtype)


class G:
    """A GLOBAL opcode in a hand-written pickle."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class Call:
    """A REDUCE of a callable (usually a G) on a tuple of arguments."""

    def __init__(self, func: Any, *args: Any):
        self.func, self.args = func, args


class PID:
    """A BINPERSID of a persistent id."""

    def __init__(self, value: Any):
        self.value = value


def ops(x: Any) -> bytes:
    """Protocol-2 opcodes that build `x` (no memo): plain data, G, Call and PID."""
    if x is None:
        return b"N"
    if x is True or x is False:
        return b"\x88" if x else b"\x89"
    if isinstance(x, int):
        if -(2**31) <= x < 2**31:
            return b"J" + struct.pack("<i", x)
        raw = x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8b" + struct.pack("<i", len(raw)) + raw
    if isinstance(x, float):
        return b"G" + struct.pack(">d", x)
    if isinstance(x, str):
        raw = x.encode("utf-8", "surrogatepass")
        return b"X" + struct.pack("<I", len(raw)) + raw
    if isinstance(x, bytes):
        return b"C" + bytes([len(x)]) + x if len(x) < 256 else b"B" + struct.pack("<I", len(x)) + x
    if isinstance(x, tuple):
        return b"(" + b"".join(ops(v) for v in x) + b"t"
    if isinstance(x, list):
        return b"]" + (b"(" + b"".join(ops(v) for v in x) + b"e" if x else b"")
    if isinstance(x, dict):
        return b"}" + (b"(" + b"".join(ops(k) + ops(v) for k, v in x.items()) + b"u" if x else b"")
    if isinstance(x, G):
        return b"c" + x.module.encode() + b"\n" + x.name.encode() + b"\n"
    if isinstance(x, Call):
        return ops(x.func) + ops(tuple(x.args)) + b"R"
    if isinstance(x, PID):
        return ops(x.value) + b"Q"
    raise TypeError(type(x))


def zip_file(path: Path, data_pkl: bytes, storages: dict[str, bytes] | None = None, prefix: str = "archive") -> Path:
    """A zip laid out as torch writes one (without its 64-byte alignment, which nothing needs)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", data_pkl)
        z.writestr(f"{prefix}/byteorder", "little")
        for key, data in (storages if storages is not None else {"0": bytes(24)}).items():
            z.writestr(f"{prefix}/data/{key}", data)
        z.writestr(f"{prefix}/version", "3\n")
    return path


def redirect_member(data: bytes, name: str, to: str) -> bytes:
    """A zip whose central directory entry for `name` points at the local header of `to`."""
    out = bytearray(data)
    offsets = {}
    at = out.find(b"PK\x01\x02")
    while at != -1:
        n = struct.unpack("<H", out[at + 28 : at + 30])[0]
        offsets[out[at + 46 : at + 46 + n].decode()] = at
        at = out.find(b"PK\x01\x02", at + 46 + n)
    target = struct.unpack("<I", out[offsets[to] + 42 : offsets[to] + 46])[0]
    out[offsets[name] + 42 : offsets[name] + 46] = struct.pack("<I", target)
    return bytes(out)


# -- fuzzing -------------------------------------------------------------------------------------------


@st.composite
def byte_mutations(draw, data: bytes) -> bytes:
    """Flips, truncations, insertions and rewritten length fields, a few at a time."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "u64", "u32", "zero"]))
        if not out:
            break
        pos = draw(st.integers(0, len(out) - 1))
        if kind == "flip":
            out[pos] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del out[pos:]
        elif kind == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "zero":
            out[pos : pos + draw(st.integers(1, 64))] = bytes(min(64, len(out) - pos))
        else:
            size = 8 if kind == "u64" else 4
            value = draw(
                st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**40, 2**63 - 1, len(out), len(out) + 1])
                if draw(st.booleans())
                else st.integers(0, 2 ** (8 * size) - 1)
            )
            packed = struct.pack("<Q" if size == 8 else "<I", value % 2 ** (8 * size))
            out[pos : pos + size] = packed[: len(out) - pos]
    return bytes(out)


def pickletools_calls(payload: bytes) -> set[str]:
    """The globals a pickle would call, found independently of clipcli: a symbolic run of pickletools' opcodes
    (each pops and pushes what pickletools says), where a global or what it made is the callee of REDUCE,
    NEWOBJ(_EX), INST or OBJ."""
    import pickletools

    calls: set[str] = set()
    stack: list[Any] = []
    marks: list[list[Any]] = []
    memo: dict[int, Any] = {}
    proto = 0
    for op, arg, _ in pickletools.genops(payload):
        name = op.name
        if name == "PROTO":
            proto = arg
        if name in ("GLOBAL", "INST"):
            module, _, attr = arg.partition(" ")
            if proto < 3:  # Python's Unpickler.find_class with fix_imports
                import _compat_pickle

                module, attr = _compat_pickle.NAME_MAPPING.get(
                    (module, attr), (_compat_pickle.IMPORT_MAPPING.get(module, module), attr)
                )
            g = ("global", f"{module}.{attr}")
            if name == "INST":
                calls.add(g[1])
                stack = marks.pop()
                stack.append(("made", g[1]))
            else:
                stack.append(g)
            continue
        if name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            stack.append(("global", f"{module[1]}.{attr[1]}"))
            continue
        if name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ"):
            if name == "OBJ":
                items = stack
                stack = marks.pop()
                callee = items[0]
            else:
                for _ in range({"REDUCE": 1, "NEWOBJ": 1, "NEWOBJ_EX": 2}[name]):
                    stack.pop()
                callee = stack.pop()
            if type(callee) is tuple and callee[0] in ("global", "made"):
                calls.add(callee[1])
                stack.append(("made", callee[1]))
            else:
                stack.append(None)
            continue
        if name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
            continue
        if name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
            continue
        if name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
            continue
        if name == "MARK":
            marks.append(stack)
            stack = []
            continue
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            stack.append(("str", arg))
            continue
        before = op.stack_before
        if pickletools.markobject in before:
            stack = marks.pop()
            before = [b for b in before if b is not pickletools.markobject and b is not pickletools.stackslice]
        for _ in before:
            stack.pop()
        stack.extend(None for _ in op.stack_after)
    return calls
