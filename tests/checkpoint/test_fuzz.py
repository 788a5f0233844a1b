"""Fuzzing the parsers: mutated checkpoints are read correctly or rejected with clipcli's own error.

The normal run tries a bounded number of examples per property; the large run is

    CLIPCLI_FUZZ_EXAMPLES=10000 python -m pytest tests/checkpoint/test_fuzz.py -q

Each example must finish within the deadline (no hang) and allocate no more than a small multiple of the
file's size plus one read buffer (a header that claims a terabyte in a kilobyte is refused before
allocating anything).
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from clipcli.checkpoint import CHUNK_BYTES, MAX_LZMA_DICTIONARY, open_checkpoint
from clipcli.checkpoint.formats import safetensors as safetensors_format
from clipcli.core.norms import NormAccumulator
from clipcli.errors import ClipcliError
from tests.helpers import byte_mutations, first_tensor_norm_and_peak, st_bytes

EXAMPLES = int(os.environ.get("CLIPCLI_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=5000,  # milliseconds: a crafted file must not make clipcli hang
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    derandomize=EXAMPLES <= 1000,  # the normal run is the same every time; the large run explores
)


def read_everything(path: Path) -> str:
    """'ok' after reading every tensor and its norm, or the message of clipcli's error; nothing else."""
    tracemalloc.start()
    try:
        with open_checkpoint(path) as ckpt:
            for t in ckpt.tensors:
                acc = NormAccumulator(2)
                for chunk in ckpt.chunks(t):
                    if t.array_dtype is not None and t.array_dtype.kind in "fc":
                        acc.add(chunk)
        outcome = "ok"
    except ClipcliError as e:
        outcome = str(e)
        assert "\n" not in outcome and outcome.startswith(str(path))
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # an LZMA member's decoder holds its dictionary, up to MAX_LZMA_DICTIONARY
    lzma_dictionary = MAX_LZMA_DICTIONARY if b"PK" in path.read_bytes()[:4] else 0
    assert peak <= 16 * path.stat().st_size + CHUNK_BYTES + (8 << 20) + lzma_dictionary, peak
    return outcome


def base_safetensors() -> list[bytes]:
    rng = np.random.default_rng(0)
    return [
        st_bytes(
            {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": np.arange(5, dtype=np.int64)}, {"format": "pt"}
        ),
        st_bytes(
            {
                "w": rng.standard_normal(16).astype(ml_dtypes.bfloat16),
                "e": np.zeros((0, 3), np.float16),
                "s": np.array(2.5),
            }
        ),
        st_bytes({"f8": rng.standard_normal(8).astype(ml_dtypes.float8_e4m3fn)}),
    ]


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def zip_of(members: dict[str, bytes], method: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", method) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()


BASE_NPY = [
    npy_bytes(np.arange(12, dtype=np.float32).reshape(3, 4)),
    npy_bytes(np.ones((2, 2), ">f8")),
    npy_bytes(np.asfortranarray(np.arange(6.0).reshape(2, 3))),
]
BASE_NPZ = [
    zip_of({"x.npy": BASE_NPY[0], "y.npy": BASE_NPY[1]}, zipfile.ZIP_STORED),
    zip_of({"x.npy": BASE_NPY[2]}, zipfile.ZIP_DEFLATED),
    zip_of({"x.npy": BASE_NPY[0]}, zipfile.ZIP_BZIP2),
    zip_of({"x.npy": BASE_NPY[1]}, zipfile.ZIP_LZMA),
]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10,
)
DTYPE_NAMES = [
    "F32",
    "F16",
    "BF16",
    "F64",
    "I64",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F8_E8M0",
    "F4",
    "F6_E2M3",
    "C64",
    "f32",
    "F128",
    "",
    "I4",
]


@st.composite
def header_mutations(draw, data: bytes) -> bytes:
    """Rewrites of the JSON header: dtypes, shapes, offsets, extra keys, nesting, duplicates, lengths."""
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    for _ in range(draw(st.integers(0, 3))):  # none: the style alone (a -0, a duplicate, padding)
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "whole", "metadata", "extra"]))
        if not isinstance(header[name], dict):
            header[name] = {}
        if field == "dtype":
            header[name]["dtype"] = draw(st.sampled_from(DTYPE_NAMES) | st.text(max_size=6))
        elif field == "shape":
            header[name]["shape"] = draw(
                st.lists(
                    st.integers(-2, 2**62) | st.sampled_from([0, 1, 3, 2**32, 2**40, 2**64 - 1, 2**64]), max_size=5
                )
                | json_values
            )
        elif field == "data_offsets":
            header[name]["data_offsets"] = draw(st.lists(st.integers(-1, 2**64), max_size=3) | json_values)
        elif field == "whole":
            header[name] = draw(json_values)
        elif field == "metadata":
            header["__metadata__"] = draw(json_values)
        else:
            header[draw(st.text(max_size=5))] = draw(json_values)
    # as Python writes it by default, or as the reference writer does (no spaces, not ASCII-escaped: `_compact`)
    compact = draw(st.booleans())
    raw = (json.dumps(header, separators=(",", ":"), ensure_ascii=False) if compact else json.dumps(header)).encode()
    style = draw(st.sampled_from(["plain", "deep", "duplicate", "padded", "bad-length", "minus-zero"]))
    if style == "deep":
        depth = draw(st.integers(1, 100_000))
        raw = raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * draw(st.integers(0, depth)) + b"}"
    elif style == "duplicate" and names:
        raw = (
            raw[:-1] + b", " + json.dumps(names[0]).encode() + b': {"dtype": "F32", "shape": [0], '
            b'"data_offsets": [0, 0]}}'
        )
    elif style == "padded":
        raw += b" " * draw(st.integers(0, 9))
    elif style == "minus-zero":  # JSON's -0, which json.dumps never writes: an integer to Python, a float to Rust
        raw = raw.replace(
            draw(st.sampled_from([b"[0", b" 0]", b" 0,"])), draw(st.sampled_from([b"[-0", b" -0]", b" -0,"]))
        )
    length = len(raw) if style != "bad-length" else draw(st.integers(0, len(raw) + 100))
    if draw(st.booleans()):
        body = body + draw(st.binary(max_size=64)) if draw(st.booleans()) else body[: draw(st.integers(0, len(body)))]
    return struct.pack("<Q", length) + raw + body


@st.composite
def npy_header_mutations(draw, data: bytes) -> bytes:
    """A .npy with its header dictionary rewritten (dtype, order, shape), and its data kept or cut."""
    (n,) = struct.unpack("<H", data[8:10])
    body = data[10 + n :]
    descr = draw(
        st.sampled_from(
            ["<f4", ">f8", "|b1", "<i8", "|O", "<U3", "|V2", "<f1", "<c16", "<f16", "<M8", "[('a', '<f4')]", "'<f4'"]
        )
        | st.text(max_size=6).map(repr)
    )
    shape = draw(st.lists(st.integers(-1, 2**63), max_size=4).map(tuple) | st.text(max_size=6).map(repr))
    fortran = draw(st.sampled_from(["False", "True", "0", "None", "'x'"]))
    text = (
        f"{{'descr': {descr if descr.startswith(('[', chr(39))) else repr(descr)}, "
        f"'fortran_order': {fortran}, 'shape': {shape}, }}"
    )
    if draw(st.booleans()):
        text = draw(st.text(max_size=40)) if draw(st.booleans()) else text.replace("'shape'", "'shapes'")
    raw = text.encode("utf-8", "replace")[:65000]
    if draw(st.booleans()):
        body = body[: draw(st.integers(0, len(body)))]
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw + body


def check(tmp_path: Path, suffix: str, content: bytes) -> None:
    path = tmp_path / f"fuzz{suffix}"
    path.write_bytes(content)
    read_everything(path)
    assert path.read_bytes() == content  # the input is never touched


@FUZZ
@given(data=st.data(), base=st.sampled_from(base_safetensors()))
def test_fuzz_safetensors_bytes(tmp_path, data, base):
    check(tmp_path, ".safetensors", data.draw(byte_mutations(base)))


@FUZZ
@given(data=st.data(), base=st.sampled_from(base_safetensors()))
def test_fuzz_safetensors_header(tmp_path, data, base):
    check(tmp_path, ".safetensors", data.draw(header_mutations(base)))


@st.composite
def compact_headers(draw) -> bytes:
    """A header laid out as the reference writer lays it out (no spaces) over small float32 tensors, with keys
    repeated where the reference reader refuses them: a tensor's name (beside any value), a key of a tensor's
    object, a key of the metadata, the metadata itself."""
    pairs: list[tuple[str, str]] = []
    offset = 0
    for i in range(draw(st.integers(1, 4))):
        count = draw(st.integers(1, 2))  # (shapes alike: one of floats or booleans among them)
        dim = draw(st.sampled_from([str(count)] * 6 + [f"{count}.0", "true", f"{count},1", "-1"]))  # (one shape)
        fields = ['"dtype":"F32"', f'"shape":[{dim}]', f'"data_offsets":[{offset},{offset + 4 * count}]']
        offset += 4 * count
        if draw(st.integers(0, 3)) == 0:
            fields.insert(draw(st.integers(0, 3)), draw(st.sampled_from(fields)))
        pairs.append((f"t{i}", "{" + ",".join(fields) + "}"))
    if draw(st.booleans()):
        keys = draw(st.lists(st.sampled_from(["k", "m"]), max_size=3))
        pairs.insert(0, ("__metadata__", "{" + ",".join(f'"{k}":"v"' for k in keys) + "}"))
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from([k for k, _ in pairs]))
        value = draw(st.sampled_from(["5", '"x"', "{}", "null", "[]", dict(pairs)[name]]))
        pairs.insert(draw(st.integers(0, len(pairs))), (name, value))
    raw = ("{" + ",".join(f'"{k}":{v}' for k, v in pairs) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


def _outcome(path: Path) -> object:
    try:
        with open_checkpoint(path) as ckpt:
            return ckpt.metadata, [(t.name, t.dtype, t.shape, t.nbytes, t.location) for t in ckpt.tensors]
    except ClipcliError as e:
        return f"{type(e).__name__}: {e} ({e.status})"


def _repeats_a_key(text: str) -> bool:
    repeated = []
    json.loads(text, object_pairs_hook=lambda pairs: repeated.append(len(dict(pairs)) < len(pairs)))
    return any(repeated)


@FUZZ
@given(data=st.data(), base=st.sampled_from(base_safetensors()), compact=st.booleans())
def test_fuzz_safetensors_header_compact_parse_reads_as_the_checked_parse(tmp_path, data, base, compact):
    """A header read by splitting it at its quotes (`_compact`, taken where the reference writer's layout holds
    and no key repeats) gives the tensors, metadata and errors that the parse checking each object as it is made
    gives."""
    content = data.draw(compact_headers() if compact else header_mutations(base))
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(content)
    ours = _outcome(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safetensors_format, "_compact", lambda raw, text, base: None)
        assert _outcome(path) == ours
    if compact:  # every object of these is laid out so: it is taken exactly when it is well formed, no key twice
        (n,) = struct.unpack("<Q", content[:8])
        raw = content[8 : 8 + n]
        taken = safetensors_format._compact(raw, raw.decode(), 8 + n) is not None
        assert taken == (isinstance(ours, tuple) and not _repeats_a_key(raw.decode())), raw


@FUZZ
@given(
    tensors=st.lists(
        st.tuples(
            st.text(max_size=6) | st.sampled_from(["__metadata__", "a", 'q"', "{}:[],", "dtype"]),
            st.sampled_from(["F32", "BF16", "U8", "BOOL", "F8_E4M3", "F4", "F6_E2M3", "C64", "F64"]),
            st.lists(st.integers(1, 3), max_size=3),
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda t: t[0],
    ),
    metadata=st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    padding=st.integers(0, 9),
)
def test_fuzz_safetensors_reference_layout_reads_as_the_checked_parse(tmp_path, tensors, metadata, padding):
    """Headers as the reference writer lays them out, of any names (quotes, braces, colons, control characters,
    non-ASCII), dtypes, shapes and metadata: `_compact` reads them as the checked parse does, and takes every one
    whose strings need no escape."""
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, code, shape in tensors:
        nbytes = -(-math.prod(shape) * safetensors_format.dtype_by_code(code).bits // 8)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode() + b" " * padding
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    ours = _outcome(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(safetensors_format, "_compact", lambda raw, text, base: None)
        assert _outcome(path) == ours
    plain = b"\\" not in raw and isinstance(ours, tuple)
    assert (safetensors_format._compact(raw, raw.decode(), 8 + len(raw)) is not None) == plain, raw


@FUZZ
@given(data=st.data(), base=st.sampled_from(base_safetensors()))
def test_fuzz_safetensors_header_is_taken_exactly_when_the_reference_reader_takes_it(tmp_path, data, base):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(data.draw(header_mutations(base)))
    try:
        with safe_open(path, "np") as f:
            reference = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (no dict)
    except Exception as e:  # the reference reader's own errors (SafetensorError and others)
        reference = f"refused: {e}"
    try:
        with open_checkpoint(path) as ckpt:
            ours = {t.name: t.shape for t in ckpt.tensors}
    except ClipcliError as e:
        ours = f"refused: {e}"
    if isinstance(reference, dict) and isinstance(ours, dict):
        assert ours == reference
    elif not (isinstance(ours, str) and "duplicate key" in ours):  # refused by choice (README, "Choices")
        assert isinstance(reference, str) and isinstance(ours, str), (reference, ours)


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASE_NPY), header=st.booleans())
def test_fuzz_npy_is_read_as_numpy_reads_it_or_refused(tmp_path, data, base, header):
    """What np.load refuses, clipcli refuses; what both read has the same shape and values. clipcli is
    stricter on two points (README, "Hostile input"): bytes after the data, and a raw-bytes dtype."""
    path = tmp_path / "fuzz.npy"
    path.write_bytes(data.draw(npy_header_mutations(base) if header else byte_mutations(base)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NumPy's own overflow warnings on wild shapes
            with open(path, "rb") as f:  # ours to close: np.load leaks its own file when a zip it sniffed fails
                want = np.load(f, allow_pickle=False)
    except Exception:  # NumPy's ValueError, EOFError, OverflowError, ...
        want = None
    try:
        with open_checkpoint(path) as ckpt:
            (t,) = ckpt.tensors
            got = ckpt.read(t) if t.array_dtype is not None else None
            shape = t.shape
    except ClipcliError as e:
        assert want is None or "the file holds" in str(e) or "raw bytes" in str(e), str(e)
        return
    assert want is not None, shape
    assert shape == want.shape
    if got is not None:
        native = np.ascontiguousarray(want, dtype=want.dtype.newbyteorder("="))  # clipcli reads in native order
        assert got.dtype == native.dtype and got.tobytes() == native.tobytes()


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASE_NPZ))
def test_fuzz_npz_read_by_both_gives_numpys_values(tmp_path, data, base):
    """Where clipcli and np.load both read a damaged .npz, every numeric member has NumPy's shape and bytes."""
    path = tmp_path / "fuzz.npz"
    path.write_bytes(data.draw(byte_mutations(base)))
    try:
        with open_checkpoint(path) as ckpt:
            got = {t.name: ckpt.read(t) for t in ckpt.tensors if t.array_dtype is not None}
    except ClipcliError:
        return
    try:
        with warnings.catch_warnings(), open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            warnings.simplefilter("ignore")
            want = {name: z[name] for name in got}
    except Exception:  # NumPy's, zipfile's errors: it refused
        return
    for name, values in got.items():
        native = np.ascontiguousarray(want[name], dtype=want[name].dtype.newbyteorder("="))
        assert values.shape == native.shape and values.tobytes() == native.tobytes(), name


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASE_NPZ))
def test_fuzz_npz_bytes(tmp_path, data, base):
    check(tmp_path, ".npz", data.draw(byte_mutations(base)))


@FUZZ
@given(
    data=st.data(), base=st.sampled_from(BASE_NPY), method=st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
)
def test_fuzz_npz_members(tmp_path, data, base, method):
    member = data.draw(npy_header_mutations(base) | byte_mutations(base))
    name = data.draw(st.sampled_from(["x.npy", "x", "dir/x.npy", "x.npy.npy"]))
    check(tmp_path, ".npz", zip_of({name: member, "ok.npy": BASE_NPY[0]}, method))


@FUZZ
@given(data=st.data(), base=st.sampled_from(BASE_NPY))
def test_fuzz_npy(tmp_path, data, base):
    check(tmp_path, ".npy", data.draw(npy_header_mutations(base) | byte_mutations(base)))


def test_truncation_at_every_byte(tmp_path):
    for suffix, data in [(".safetensors", base_safetensors()[0]), (".npz", BASE_NPZ[0]), (".npy", BASE_NPY[0])]:
        outcomes = {read_everything(_write(tmp_path, suffix, data[:cut])) == "ok" for cut in range(len(data))}
        assert outcomes == {False}, suffix  # no proper prefix of a checkpoint reads as a checkpoint


def _write(tmp_path: Path, suffix: str, content: bytes) -> Path:
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(content)
    return path


def test_a_terabyte_claim_in_a_kilobyte_is_refused_before_allocating(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}}).encode()
    path = tmp_path / "tb.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(1000))
    assert "hold 1000 bytes of data" in read_everything(path) or "data ends" in read_everything(path)
    npy = tmp_path / "tb.npy"
    text = b"{'descr': '<f8', 'fortran_order': False, 'shape': (137438953472,), }"
    npy.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + bytes(1000))
    assert "needs 1099511627776 bytes of data" in read_everything(npy)


def test_a_deflate_bomb_streams_in_bounded_memory(tmp_path):
    # 256 MiB of zeros deflate to about 256 KiB; reading them must not hold them.
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (67108864,), }"
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, z.open("zeros.npy", "w", force_zip64=True) as m:
        m.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header)
        block = bytes(1 << 20)
        for _ in range(256):
            m.write(block)
    assert path.stat().st_size < 2 << 20
    stats, peak = first_tensor_norm_and_peak(path)
    assert stats.norm == 0.0 and stats.size == 1 << 26
    assert peak < 32 << 20, peak
