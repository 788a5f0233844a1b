"""Distributed checkpoints read without torch: the corpus torch wrote, malformed and hostile metadata, fuzzing.

The corpus in tests/data/dcp was written by real torch (make_dcp.py: one process, two processes with
DTensors and FSDP2, Megatron's torch_dist layout), with what torch reads from each checkpoint beside it
as JSON, so these tests need no torch. Checkpoints written here by hand (hand-written pickles and
torch.save zips) cover what torch never writes; the cross-checks against torch at the end run only where
torch is installed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickletools
import re
import shutil
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clipcli.checkpoint.formats._dcp_layout import layout_error as _layout_error
from clipcli.checkpoint.formats._dcp_records import TRUSTED
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats.dcp import DcpTensor, is_dcp, read_dcp
from clipcli.checkpoint.formats.torch import is_contiguous, read_torch
from clipcli.errors import (
    ClipcliError,
    MalformedError,
    MissingFileError,
    UnsupportedError,
)
from tests.helpers import DATA, PID, Call, G, byte_mutations, ops, read_values, zip_file

CORPUS = DATA / "dcp"
CHECKPOINTS = ["single", "sharded", "megatron", "megatron_mcore015"]
EXAMPLES = int(os.environ.get("CLIPCLI_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=5000,  # milliseconds: crafted metadata must not make clipcli hang
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    derandomize=EXAMPLES <= 1000,
)


def expected(name: str) -> dict[str, Any]:
    return json.loads((CORPUS / f"{name}.json").read_text())


def consolidate(t: DcpTensor) -> np.ndarray:
    """The whole tensor, each chunk read from its file (by its view's strides) and placed at its offsets."""
    assert t.dtype is not None and t.skip_reason is None
    whole = np.zeros(t.shape, t.dtype)
    for c in t.chunks:
        assert c.tensor.dtype == t.dtype and c.tensor.shape == c.sizes
        whole[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = read_values(c.file, c.tensor)
    return whole


def norm(values: np.ndarray) -> float:
    """sqrt(fsum of squares) in float64, as make_dcp.py computes it from the tensor torch consolidates."""
    wide = values.astype(np.float64).reshape(-1)
    return math.sqrt(math.fsum((wide * wide).tolist()))


def copy_of(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(CORPUS / name, target)
    return target


# -- the corpus ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_corpus_names_dtypes_shapes_and_items(name: str) -> None:
    want = expected(name)
    metadata, tensors = read_dcp(CORPUS / name)
    assert metadata == want["metadata"]
    readable = [t for t in tensors if t.skip_reason is None]
    assert [t.name for t in readable] == [w["name"] for w in want["tensors"]]
    for t, w in zip(readable, want["tensors"], strict=True):
        assert (t.dtype_name, list(t.shape)) == (w["dtype"], w["shape"]), t.name
        assert t.dtype is not None and t.dtype.name == t.dtype_name and t.dtype.isnative
        if "chunks" in w:  # a tensor of state_dict_metadata (not one kept inside a non-tensor item)
            assert [[list(c.offsets), list(c.sizes)] for c in t.chunks] == w["chunks"], t.name
    skipped = [t for t in tensors if t.skip_reason is not None]
    assert [(t.name, t.dtype_name, list(t.shape)) for t in skipped] == [
        (w["name"], w["dtype"], w["shape"]) for w in want["skipped"]
    ]
    assert all(t.dtype is None and "no NumPy type" in (t.skip_reason or "") for t in skipped)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_corpus_values_match_what_torch_consolidates(name: str) -> None:
    want = {w["name"]: w for w in expected(name)["tensors"]}
    _, tensors = read_dcp(CORPUS / name)
    for t in tensors:
        if t.skip_reason is not None:
            continue
        values = consolidate(t)
        assert hashlib.sha256(values.tobytes()).hexdigest() == want[t.name]["sha256"], t.name
        assert norm(values) == want[t.name]["norm"], t.name


def test_sharded_chunks_come_from_both_ranks() -> None:
    _, tensors = read_dcp(CORPUS / "sharded")
    by_name = {t.name: t for t in tensors}
    rows, cols = by_name["rows"], by_name["cols"]
    # Shard(0): row blocks, 3 + 2 rows of 5; Shard(1): column blocks, 4 + 3 columns of 7
    assert [(c.offsets, c.sizes, c.file.name) for c in rows.chunks] == [
        ((0, 0), (3, 3), "__0_0.distcp"),
        ((3, 0), (2, 3), "__1_0.distcp"),
    ]
    assert [(c.offsets, c.sizes, c.file.name) for c in cols.chunks] == [
        ((0, 0), (3, 4), "__0_0.distcp"),
        ((0, 4), (3, 3), "__1_0.distcp"),
    ]
    assert cols.dtype_name == "bfloat16"
    # one row on two ranks: the second rank's chunk is empty, at the end of the rows
    assert [(c.offsets, c.sizes) for c in by_name["one_row"].chunks] == [((0, 0), (1, 4)), ((1, 0), (0, 4))]
    # replicated and plain tensors are written once (deduplicated), by one rank
    assert len(by_name["replicated"].chunks) == len(by_name["plain"].chunks) == 1
    # FSDP2 shards parameters and optimizer states by rows; Adam's 0-d step is one 0-d chunk
    assert [c.offsets for c in by_name["optim.state.0.weight.exp_avg"].chunks] == [(0, 0), (2, 0)]
    step = by_name["optim.state.0.weight.step"]
    assert (step.shape, [(c.offsets, c.sizes) for c in step.chunks]) == ((), [((), ())])
    assert len({c.file.name for t in tensors for c in t.chunks}) == 2


def test_single_process_checkpoint_details() -> None:
    metadata, tensors = read_dcp(CORPUS / "single")
    by_name = {t.name: t for t in tensors}
    # torch writes a transposed or channels_last tensor's chunk as the strided view it is
    assert not is_contiguous(by_name["transposed"].chunks[0].tensor)
    assert by_name["channels_last"].chunks[0].tensor.strides == (12, 1, 6, 3)
    assert np.array_equal(consolidate(by_name["transposed"]), read_values_c_order(by_name["transposed"]))
    # a tuple of tensors is one non-tensor item to DCP: its tensors are tensors here, one chunk each
    pair = by_name["pair.0"]
    assert [(c.offsets, c.sizes) for c in pair.chunks] == [((0,), (2,))]
    assert consolidate(pair).tolist() == [1.5, -2.0]
    assert (metadata["step"], metadata["run"], metadata["optim.param_groups.0.betas.1"]) == ("7", "demo-1", "0.999")
    assert by_name["optim.state.0.step"].shape == () and by_name["c32"].skip_reason is not None


def read_values_c_order(t: DcpTensor) -> np.ndarray:
    """A single-chunk tensor read the long way: every element at the byte its strides give."""
    (c,) = t.chunks
    assert t.dtype is not None
    raw = c.file.read_bytes()
    out = np.zeros(t.shape, t.dtype)
    for index in np.ndindex(*t.shape):
        at = c.tensor.file_offset + t.dtype.itemsize * (
            c.tensor.storage_offset + sum(i * s for i, s in zip(index, c.tensor.strides, strict=True))
        )
        out[index] = np.frombuffer(raw, t.dtype, 1, at)[0]
    return out


@pytest.mark.parametrize("name", ["megatron", "megatron_mcore015"])
def test_megatron_torch_dist_reads_the_dcp_part(name: str) -> None:
    directory = CORPUS / name
    assert json.loads((directory / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert is_dcp(directory)
    metadata, tensors = read_dcp(directory)
    qkv = next(t for t in tensors if t.name == "decoder.layers.self_attention.linear_qkv.weight")
    assert [(c.offsets, c.sizes) for c in qkv.chunks] == [((0, 0, 0), (1, 6, 4)), ((1, 0, 0), (1, 6, 4))]
    assert {c.file.name for t in tensors for c in t.chunks} >= {"__0_0.distcp", "__1_0.distcp"}
    assert metadata["rng_state/shard_1_2.0.random_rng_state.1.0"] == "8"
    assert "rng_state/shard_0_2.0.rng_tracker_states" in {t.name for t in tensors}
    # common.pt is left out of the checkpoint; read on its own, Megatron's args namespace is an inert placeholder
    common, _ = read_torch(directory / "common.pt")
    assert common["args"] == "<argparse.Namespace>" and common["iteration"] == "10"
    assert not any(name.startswith(("iteration", "args", "checkpoint_version")) for name in metadata)


def test_is_dcp(tmp_path: Path) -> None:
    assert all(is_dcp(CORPUS / name) for name in [*CHECKPOINTS, "safetensors_format"])
    assert not is_dcp(CORPUS) and not is_dcp(CORPUS / "single" / ".metadata") and not is_dcp(tmp_path / "none")
    (tmp_path / ".metadata").write_text('{"not": "a pickle"}')
    assert not is_dcp(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + b"something else entirely" * 10)
    assert not is_dcp(tmp_path)
    (tmp_path / ".metadata").write_bytes((CORPUS / "sharded" / ".metadata").read_bytes()[:64])
    assert is_dcp(tmp_path)  # only the first bytes are looked at: read_dcp says what is wrong


# -- malformed checkpoints --------------------------------------------------------------------------------

MALFORMED = [
    (
        "overlap",
        MalformedError,
        r"tensor rows: the chunks at offsets \(0, 0\) and \(2, 0\) overlap, and so leave a hole",
    ),
    ("overlap_volume", MalformedError, r"tensor cols: the chunks hold 24 elements, more than the tensor's 21: "),
    ("hole", MalformedError, r"tensor cols: the chunks hold 12 of the tensor's 21 elements: they leave a hole"),
    ("past_bounds", MalformedError, r"tensor rows: the chunk at offsets \(4, 0\) with shape \(2, 3\) runs past"),
    ("missing_storage", MalformedError, r"tensor replicated: the chunk at offsets \(0,\) is not in storage_data"),
    ("missing_item", MalformedError, r"tensor epoch: the item is not in storage_data"),
    ("dotdot", MalformedError, r"tensor replicated: the file '\.\./sharded/__1_0\.distcp' is not a plain path"),
    ("absolute", MalformedError, r"tensor replicated: the file '/etc/passwd' is not a plain path"),
    ("wrong_dtype", MalformedError, r"tensor rows: the chunk at offsets \(0, 0\) holds a float32 tensor of shape"),
    ("transform", UnsupportedError, r"tensor rows: .* stored through the transform stream\.zstd/1 \(compression"),
    ("version", UnsupportedError, r"metadata version '2\.0\.0' \(clipcli reads 1\.x\)"),
]


@pytest.mark.parametrize(("variant", "error", "message"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_metadata_is_refused(tmp_path: Path, variant: str, error: type, message: str) -> None:
    """.metadata files torch pickled from edited metadata, read beside the files of `sharded`."""
    directory = copy_of("sharded", tmp_path)
    shutil.copy(CORPUS / "malformed" / f"{variant}.metadata", directory / ".metadata")
    with pytest.raises(ClipcliError) as info:
        read_dcp(directory)
    assert type(info.value) is error, info.value
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(directory))
    assert re.search(message, text), text


# A .metadata naming a global beyond DCP's own was refused whole (exit 3: "the pickle asks for GLOBAL
# posix.system"), where SPEC says it is "itself a pickle: same rules, same audit".
@pytest.mark.parametrize(
    ("variant", "called", "value"),
    [("foreign_global", "posix.system", "touch clipcli-was-exploited"), ("namespace", "argparse.Namespace", "run-7")],
)
def test_a_foreign_global_in_the_metadata_is_audited_and_never_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str, called: str, value: str
) -> None:
    """torch pickled each (make_dcp.py foreign): a call of os.system in storage_meta, a Namespace as planner_data."""
    data = (CORPUS / "foreign" / f"{variant}.metadata").read_bytes()
    strings = [arg for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE"]
    names = [op.name for op, _, _ in pickletools.genops(data)]
    assert {*called.split("."), value} <= set(strings)  # it is live
    assert {"STACK_GLOBAL", "REDUCE" if variant == "foreign_global" else "NEWOBJ"} <= set(names)
    directory = copy_of("sharded", tmp_path)
    (directory / ".metadata").write_bytes(data)
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
    monkeypatch.chdir(tmp_path)
    audit = Audit()
    metadata, tensors = read_dcp(directory, audit=audit)
    plain_metadata, plain = read_dcp(CORPUS / "sharded")
    assert metadata == plain_metadata
    assert [(t.name, t.shape, [c.offsets for c in t.chunks]) for t in tensors] == [
        (t.name, t.shape, [c.offsets for c in t.chunks]) for t in plain
    ]
    result = audit.result(str(directory / ".metadata"), TRUSTED)
    assert result.unsafe_calls == (called,) and not result.loads_with_weights_only
    assert [g.count for g in result.globals if g.name == called and g.use == "call"] == [1]
    assert calls == [] and not (tmp_path / "clipcli-was-exploited").exists()


@pytest.mark.parametrize(
    ("pickled", "message"),
    [
        # the GLOBAL opcode of protocols 0-2, at the top: no Metadata at all
        (b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00true\x85R.", r"holds a os\.system object, not a distributed"),
        (b"\x80\x02cargparse\nNamespace\n)R.", r"holds a argparse\.Namespace object, not a distributed checkpoint's"),
    ],
)
def test_a_foreign_object_where_the_metadata_should_be_says_so(tmp_path: Path, pickled: bytes, message: str) -> None:
    directory = copy_of("sharded", tmp_path)
    (directory / ".metadata").write_bytes(pickled)
    with pytest.raises(MalformedError, match=r"^.*\.metadata: the pickle " + message):
        read_dcp(directory)


def test_missing_or_truncated_files(tmp_path: Path) -> None:
    directory = copy_of("sharded", tmp_path)
    (directory / "__1_0.distcp").unlink()
    with pytest.raises(MissingFileError, match=r"__1_0\.distcp, which \.metadata lists, does not exist"):
        read_dcp(directory)
    directory = copy_of("megatron", tmp_path / "b")
    data = (directory / "__1_1.distcp").read_bytes()
    (directory / "__1_1.distcp").write_bytes(data[:-100])
    with pytest.raises(MalformedError, match=rf"lies at bytes \d+\.\.{len(data)} of the file, which holds"):
        read_dcp(directory)
    (directory / ".metadata").unlink()
    with pytest.raises(MissingFileError, match=r"no \.metadata file: not a distributed checkpoint"):
        read_dcp(directory)
    with pytest.raises(MissingFileError):
        read_dcp(tmp_path / "nowhere")


def test_files_must_stay_inside_the_directory(tmp_path: Path) -> None:
    directory = copy_of("sharded", tmp_path)
    outside = tmp_path / "outside.distcp"
    (directory / "__1_0.distcp").rename(outside)
    (directory / "__1_0.distcp").symlink_to(outside)
    with pytest.raises(MalformedError, match=r"__1_0\.distcp leads outside the checkpoint's directory"):
        read_dcp(directory)
    (directory / "__1_0.distcp").unlink()
    (directory / "__1_0.distcp").mkdir()
    with pytest.raises(MalformedError, match=r"__1_0\.distcp, which \.metadata lists, is not a regular file"):
        read_dcp(directory)


def test_a_chunk_that_is_not_a_torch_save_file(tmp_path: Path) -> None:
    directory = copy_of("sharded", tmp_path)
    _, tensors = read_dcp(directory)
    chunk = next(t for t in tensors if t.name == "rows").chunks[1]
    data = bytearray((directory / "__1_0.distcp").read_bytes())
    start = chunk.tensor.file_offset - 700  # inside the chunk's zip, before its data
    data[start : start + 100] = bytes(100)
    (directory / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(MalformedError, match=r"__1_0\.distcp: tensor rows: the chunk at offsets \(3, 0\) \(bytes"):
        read_dcp(directory)


def test_safetensors_serialization_is_refused() -> None:
    with pytest.raises(UnsupportedError, match=r"tensor w: .* DCP's safetensors format"):
        read_dcp(CORPUS / "safetensors_format")


# -- checkpoints written by hand ------------------------------------------------------------------------

META = "torch.distributed.checkpoint.metadata"
STORAGE_CLASSES = {"float32": "FloatStorage", "int64": "LongStorage", "float16": "HalfStorage"}


class Obj:
    """A DCP dataclass as pickle writes one: NEWOBJ of its class with no arguments, then BUILD `state`."""

    def __init__(self, cls: str, state: Any, module: str = META, args: tuple[Any, ...] = ()):
        self.cls, self.state, self.module, self.args = cls, state, module, args


def dops(x: Any) -> bytes:
    """Protocol-2 opcodes for plain data, G, Call, PID and Obj, nested in any way."""
    if isinstance(x, Obj):
        return dops(G(x.module, x.cls)) + dops(tuple(x.args)) + b"\x81" + dops(x.state) + b"b"
    if isinstance(x, Call):
        return dops(x.func) + dops(tuple(x.args)) + b"R"
    if isinstance(x, PID):
        return dops(x.value) + b"Q"
    if isinstance(x, tuple):
        return b"(" + b"".join(dops(v) for v in x) + b"t"
    if isinstance(x, list):
        return b"]" + (b"(" + b"".join(dops(v) for v in x) + b"e" if x else b"")
    if isinstance(x, dict):
        return b"}" + (b"(" + b"".join(dops(k) + dops(v) for k, v in x.items()) + b"u" if x else b"")
    return ops(x)


def size(dims: tuple[int, ...]) -> Call:
    return Call(G("torch", "Size"), tuple(dims))


def tensor_md(dtype: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Obj:
    layout = Call(G("torch.serialization", "_get_layout"), "torch.strided")
    properties = Obj(
        "TensorProperties", (G("torch", dtype), layout, False, Call(G(META, "_MEM_FORMAT_ENCODING"), 0), False)
    )
    chunk_list = [Obj("ChunkStorageMetadata", {"offsets": size(o), "sizes": size(s)}) for o, s in chunks]
    return Obj("TensorStorageMetadata", {"properties": properties, "size": size(shape), "chunks": chunk_list})


def index(fqn: str, offsets: tuple[int, ...] | None) -> Obj:
    return Obj("MetadataIndex", {"fqn": fqn, "index": 0} if offsets is None else {"fqn": fqn, "offset": size(offsets)})


def info(path: str, offset: int, length: int, **more: Any) -> Obj:
    state = {"relative_path": path, "offset": offset, "length": length, **more}
    return Obj("_StorageInfo", state, "torch.distributed.checkpoint.filesystem")


def metadata_pickle(sd: dict[str, Any], storage: dict[Any, Any] | None, **more: Any) -> bytes:
    state = {"state_dict_metadata": sd, "planner_data": None, "storage_data": storage, "version": "1.0.0", **more}
    return b"\x80\x02" + dops(Obj("Metadata", state)) + b"."


def torch_save_bytes(tmp_path: Path, obj: Any, storages: dict[str, bytes]) -> bytes:
    path = zip_file(tmp_path / "item.pt", b"\x80\x02" + dops(obj) + b".", storages)
    return path.read_bytes()


def chunk_bytes(tmp_path: Path, values: np.ndarray, strides: tuple[int, ...] | None = None) -> bytes:
    """A torch.save file of one tensor (C order, or a view of the same bytes with other strides)."""
    values = np.ascontiguousarray(values)
    pid = PID(("storage", G("torch", STORAGE_CLASSES[values.dtype.name]), "0", "cpu", values.size))
    c_strides = tuple(s // values.itemsize for s in values.strides)
    rebuild = Call(G("torch._utils", "_rebuild_tensor_v2"), pid, 0, values.shape, strides or c_strides, False, {})
    return torch_save_bytes(tmp_path, rebuild, {"0": values.tobytes()})


def hand_checkpoint(
    tmp_path: Path,
    tensors: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], np.ndarray]]]],
    items: dict[str, Any] | None = None,
    **edits: Any,
) -> Path:
    """A one-file checkpoint: each tensor (global shape, chunks at offsets) and item saved as torch does."""
    directory = tmp_path / "hand"
    directory.mkdir(exist_ok=True)
    blob = bytearray()
    sd: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for name, value in (items or {}).items():
        data = torch_save_bytes(tmp_path, value, {})
        storage[index(name, None)] = info("__0_0.distcp", len(blob), len(data))
        sd[name] = Obj("BytesStorageMetadata", {})
        blob += data
    for name, (shape, chunks) in tensors.items():
        dtype = chunks[0][1].dtype.name
        sd[name] = tensor_md(dtype, shape, [(o, a.shape) for o, a in chunks])
        for offsets, values in chunks:
            data = chunk_bytes(tmp_path, values)
            storage[index(name, offsets)] = info("__0_0.distcp", len(blob), len(data))
            blob += data
    (directory / "__0_0.distcp").write_bytes(bytes(blob))
    edit = edits.get("edit")
    (directory / ".metadata").write_bytes(edit(sd, storage) if edit else metadata_pickle(sd, storage))
    return directory


def test_hand_written_checkpoint_reads(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    directory = hand_checkpoint(
        tmp_path,
        {"a": ((3, 4), [((0, 0), a[:, :1]), ((0, 1), a[:2, 1:]), ((2, 1), a[2:, 1:])])},  # not a grid
        {"lr": 0.5, "groups": [{"betas": (0.9, 0.99), "params": []}], "nothing": ()},
    )
    metadata, tensors = read_dcp(directory)
    assert metadata == {
        "lr": "0.5",
        "groups.0.betas.0": "0.9",
        "groups.0.betas.1": "0.99",
        "groups.0.params": "[]",
        "nothing": "()",
    }
    (t,) = tensors
    assert np.array_equal(consolidate(t), a)


def test_hand_written_name_clash(tmp_path: Path) -> None:
    directory = hand_checkpoint(tmp_path, {"a.b": ((2,), [((0,), np.ones(2, np.float32))])}, {"a": {"b": 1}})
    with pytest.raises(MalformedError, match=r"tensor a\.b: two entries of the checkpoint have this name"):
        read_dcp(directory)


def test_a_chunk_must_be_one_tensor_of_its_shape_and_dtype(tmp_path: Path) -> None:
    def edit_chunk(replacement: bytes) -> Path:
        directory = hand_checkpoint(tmp_path, {})
        sd = {"w": tensor_md("float32", (2,), [((0,), (2,))])}
        (directory / "__0_0.distcp").write_bytes(replacement)
        storage = {index("w", (0,)): info("__0_0.distcp", 0, len(replacement))}
        (directory / ".metadata").write_bytes(metadata_pickle(sd, storage))
        return directory

    values = np.ones(2, np.float32)
    with pytest.raises(MalformedError, match=r"tensor w: .* of something other than one tensor"):
        read_dcp(edit_chunk(torch_save_bytes(tmp_path, {"x": 1}, {})))
    with pytest.raises(MalformedError, match=r"holds a int64 tensor of shape \(2,\), where float32 of shape"):
        read_dcp(edit_chunk(chunk_bytes(tmp_path, values.astype(np.int64))))
    with pytest.raises(MalformedError, match=r"holds a float32 tensor of shape \(3,\), where float32 of shape \(2,\)"):
        read_dcp(edit_chunk(chunk_bytes(tmp_path, np.ones(3, np.float32))))
    _, (t,) = read_dcp(edit_chunk(chunk_bytes(tmp_path, values)))
    assert t.chunks[0].tensor.file_offset > 0 and consolidate(t).tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda sd, sto: b"\x80\x02" + dops([1, 2]) + b".", "the pickle holds a list, not a distributed checkpoint's"),
        (lambda sd, sto: metadata_pickle([], sto), "state_dict_metadata is a list, not a dict"),
        (lambda sd, sto: metadata_pickle({1: sd["w"]}, sto), "state_dict_metadata has a int as a name"),
        (lambda sd, sto: metadata_pickle({"w": 3}, sto), "tensor w: the item is a int, not tensor or bytes metadata"),
        (lambda sd, sto: metadata_pickle(sd, [1]), "storage_data is a list, not a dict"),
        (lambda sd, sto: metadata_pickle(sd, {"w": 1}), "storage_data is keyed by a str, not a MetadataIndex"),
        (lambda sd, sto: metadata_pickle(sd, {index("w", (0,)): 3}), "tensor w: storage_data holds a int"),
        (lambda sd, sto: metadata_pickle(sd, None), r"tensor w: the chunk at offsets \(0,\) is not in storage_data"),
        (
            lambda sd, sto: metadata_pickle(sd, {index("w", (0,)): info("__0_0.distcp", -1, 5)}),
            "offset or length is not a non-negative integer",
        ),
        (
            lambda sd, sto: metadata_pickle(sd, {index("w", (0,)): info("a\\..\\b", 0, 5)}),
            r"the file 'a\\\\..\\\\b' is not a plain path",
        ),
        (
            lambda sd, sto: metadata_pickle(
                sd, {**sto, Obj("MetadataIndex", {"fqn": "w", "offset": size((0,))}): info("x", 0, 1)}
            ),
            r"storage_data places the chunk at offsets \(0,\) twice",
        ),
        (
            lambda sd, sto: metadata_pickle({"w": tensor_md("float32", (2,), [((0,), (1,))])}, sto),
            r"the chunks hold 1 of the tensor's 2 elements",
        ),
        (
            lambda sd, sto: metadata_pickle({"w": tensor_md("float32", (2, 1), [((0,), (2,))])}, sto),
            r"does not have the tensor's 2 dimensions",
        ),
        (
            lambda sd, sto: metadata_pickle({"w": tensor_md("float32", (-2,), [((0,), (2,))])}, sto),
            "the global shape is not a tuple of non-negative integers",
        ),
        (lambda sd, sto: metadata_pickle(sd, sto, version=2), "the metadata's version is a int"),
        (
            lambda sd, sto: b"\x80\x02" + dops(Obj("Metadata", {}, args=(1,))) + b".",
            r"the pickle creates a torch\.distributed\.checkpoint\.metadata\.Metadata with arguments",
        ),
        (
            lambda sd, sto: b"\x80\x02" + dops(Obj("Metadata", [1])) + b".",
            "the pickle sets the attributes of a Metadata from a list",
        ),
        (
            lambda sd, sto: b"\x80\x02" + dops(Call(G(META, "_MEM_FORMAT_ENCODING"), 7)) + b".",
            r"a torch\.distributed\.checkpoint\.metadata\._MEM_FORMAT_ENCODING that does not exist",
        ),
        # a placeholder (a global beyond DCP's own) where a record belongs: the message names what stands there
        (
            lambda sd, sto: metadata_pickle({"w": Call(G("argparse", "Namespace"), ())}, sto),
            r"tensor w: the item is a argparse\.Namespace object, not tensor or bytes metadata",
        ),
        (
            lambda sd, sto: metadata_pickle(sd, {index("w", (0,)): Call(G("os", "system"), "x")}),
            r"tensor w: storage_data holds a os\.system object, not a _StorageInfo",
        ),
        (
            lambda sd, sto: metadata_pickle(Call(G("argparse", "Namespace"), ()), sto),
            r"state_dict_metadata is a argparse\.Namespace object, not a dict",
        ),
    ],
)
def test_hand_written_malformed_metadata(tmp_path: Path, edit: Any, message: str) -> None:
    directory = hand_checkpoint(tmp_path, {"w": ((2,), [((0,), np.ones(2, np.float32))])}, edit=edit)
    with pytest.raises(MalformedError, match=message) as info_:
        read_dcp(directory)
    assert "\n" not in str(info_.value)


@pytest.mark.parametrize(
    "name",
    [
        "builtins.eval",
        "torch.distributed.checkpoint.metadata.os",
        "collections.OrderedDict",
        "torch.load",
        "torch.Tensor",
    ],
)
def test_only_dcp_globals_are_records(tmp_path: Path, name: str) -> None:
    """Any other global is an inert placeholder: called at the top, it is no Metadata, and the message says so."""
    module, attr = name.rsplit(".", 1)
    directory = hand_checkpoint(tmp_path, {}, edit=lambda sd, sto: b"\x80\x02" + dops(Call(G(module, attr), ())) + b".")
    with pytest.raises(MalformedError, match=rf"the pickle holds a {name} object, not a distributed checkpoint's"):
        read_dcp(directory)


# -- layouts: the corner count against a brute-force count ------------------------------------------------


def brute_force_tiles(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    counts = np.zeros(shape, np.int64)
    for offsets, sizes in boxes:
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            return False
        counts[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
    return bool((counts == 1).all())


def guillotine(draw: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], depth: int) -> list[Any]:
    """A random exact tiling of a box: cut it along a dimension, then tile each side."""
    cuttable = [d for d, s in enumerate(sizes) if s > 1]
    if depth == 0 or not cuttable or draw(st.integers(0, 3)) == 0:
        return [(offsets, sizes)]
    d = draw(st.sampled_from(cuttable))
    at = draw(st.integers(1, sizes[d] - 1))
    first = guillotine(draw, offsets, (*sizes[:d], at, *sizes[d + 1 :]), depth - 1)
    rest = (*offsets[:d], offsets[d] + at, *offsets[d + 1 :])
    return first + guillotine(draw, rest, (*sizes[:d], sizes[d] - at, *sizes[d + 1 :]), depth - 1)


@st.composite
def layouts(draw: Any) -> tuple[tuple[int, ...], list[Any]]:
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    boxes = guillotine(draw, (0,) * len(shape), shape, 4)
    for _ in range(draw(st.integers(0, 2))):  # then maybe move, grow, drop or repeat a chunk
        i = draw(st.integers(0, len(boxes) - 1))
        offsets, sizes = boxes[i]
        how = draw(st.sampled_from(["move", "grow", "drop", "repeat", "empty"]))
        if how == "drop":
            del boxes[i]
        elif how == "repeat":
            boxes.append(boxes[i])
        elif how == "empty" and shape:
            boxes.append((tuple(draw(st.integers(0, n)) for n in shape), (0,) * len(shape)))
        elif shape and how in ("move", "grow"):
            d = draw(st.integers(0, len(shape) - 1))
            delta = draw(st.integers(-2, 2))
            if how == "move":
                offsets = (*offsets[:d], max(0, offsets[d] + delta), *offsets[d + 1 :])
            else:
                sizes = (*sizes[:d], max(0, sizes[d] + delta), *sizes[d + 1 :])
            boxes[i] = (offsets, sizes)
        if not boxes:
            break
    return shape, boxes


@FUZZ
@given(layouts())
def test_layout_check_agrees_with_counting_every_element(layout: tuple[tuple[int, ...], list[Any]]) -> None:
    shape, boxes = layout
    nonempty = [(o, s) for o, s in boxes if math.prod(s)]
    in_bounds = all(o + s <= n for b in boxes for o, s, n in zip(*b, shape, strict=True))
    assert (_layout_error(shape, boxes) is None) == (in_bounds and brute_force_tiles(shape, nonempty))


def test_layout_examples() -> None:
    bricks = [((0, 0), (1, 2)), ((0, 2), (1, 2)), ((1, 0), (1, 1)), ((1, 1), (1, 2)), ((1, 3), (1, 1))]
    assert _layout_error((2, 4), bricks) is None  # a brick wall: no grid, still a tiling
    assert _layout_error((), [((), ())]) is None
    assert _layout_error((), [((), ()), ((), ())]) == (
        "the chunks hold 2 elements, more than the tensor's 1: the tensor's one element is saved more than once"
    )
    assert _layout_error((0, 3), []) is None and _layout_error((0, 3), [((0, 0), (0, 3))]) is None
    assert _layout_error((4,), []) == "the chunks hold 0 of the tensor's 4 elements: they leave a hole"
    # the same volume, but two chunks on the same half: a hole and an overlap
    assert _layout_error((4,), [((0,), (2,)), ((0,), (2,))]) == (
        "the chunks at offsets (0,) and (0,) overlap, and so leave a hole"
    )
    grid = [((i, j), (1, 1)) for i in range(100) for j in range(100)]
    assert _layout_error((100, 100), grid) is None
    grid[-1] = ((99, 98), (1, 1))
    assert _layout_error((100, 100), grid) == "the chunks at offsets (99, 98) and (99, 98) overlap, and so leave a hole"


def test_layouts_splitting_too_many_dimensions_are_refused() -> None:
    shape = (2,) * 17
    boxes = [(tuple((i >> d) & 1 for d in range(17)), (1,) * 17) for i in range(2**17)]
    with pytest.raises(UnsupportedError, match="split 17 dimensions"):
        _layout_error(shape, boxes)


# -- fuzzing ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("dcp-fuzz")
    return {name: Path(shutil.copytree(CORPUS / name, base / name)) for name in ("sharded", "megatron_mcore015")}


def read_or_refuse(directory: Path) -> str:
    """'ok' or the message of clipcli's error, nothing else; memory bounded by the metadata's size."""
    tracemalloc.start()
    try:
        read_dcp(directory)
        outcome = "ok"
    except ClipcliError as e:
        outcome = str(e)
        assert "\n" not in outcome and outcome.startswith(str(directory)), outcome
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= 64 * (directory / ".metadata").stat().st_size + (4 << 20), peak
    return outcome


@FUZZ
@given(name=st.sampled_from(["sharded", "megatron_mcore015"]), cut=st.integers(0, 1 << 20))
def test_truncated_metadata_is_refused(fuzz_dirs: dict[str, Path], name: str, cut: int) -> None:
    data = (CORPUS / name / ".metadata").read_bytes()
    (fuzz_dirs[name] / ".metadata").write_bytes(data[: cut % len(data)])
    assert read_or_refuse(fuzz_dirs[name]) != "ok"


@FUZZ
@given(name=st.sampled_from(["sharded", "megatron_mcore015"]), data=st.data())
def test_mutated_metadata_reads_or_is_refused(fuzz_dirs: dict[str, Path], name: str, data: st.DataObject) -> None:
    original = (CORPUS / name / ".metadata").read_bytes()
    mutated = data.draw(byte_mutations(original))
    (fuzz_dirs[name] / ".metadata").write_bytes(mutated)
    read_or_refuse(fuzz_dirs[name])


def test_flipping_every_byte_of_small_metadata(tmp_path: Path) -> None:
    """Every byte of a small .metadata flipped in turn: a correct parse or one clipcli error each time."""
    directory = copy_of("safetensors_format", tmp_path)
    original = (CORPUS / "safetensors_format" / ".metadata").read_bytes()
    for pos in range(len(original)):
        mutated = bytearray(original)
        mutated[pos] ^= 0x5A
        (directory / ".metadata").write_bytes(bytes(mutated))
        read_or_refuse(directory)


# -- torch ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_agrees_with_torch(name: str, tmp_path: Path) -> None:
    """What torch reads: its metadata, and every tensor as torch consolidates the checkpoint."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    if name == "megatron_mcore015":  # its metadata names Megatron-Core 0.15's classes
        pytest.importorskip("megatron.core.dist_checkpointing.strategies.torch")
    directory = CORPUS / name
    with warnings.catch_warnings():  # torch warns that complex32 support is experimental
        warnings.simplefilter("ignore")
        md = FileSystemReader(directory).read_metadata()
        dcp_to_torch_save(directory, tmp_path / "whole.pt")
        whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    _, tensors = read_dcp(directory)
    ours = {t.name: t for t in tensors}
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        t = ours.pop(fqn)
        assert t.shape == tuple(entry.size) and t.dtype_name == str(entry.properties.dtype).removeprefix("torch.")
        assert [(c.offsets, c.sizes) for c in t.chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
        for c in t.chunks:
            where = md.storage_data[MetadataIndex(fqn, c.offsets)]
            assert c.file == directory / where.relative_path
            assert where.offset < c.tensor.file_offset <= where.offset + where.length
        value = whole
        for key in (md.planner_data or {}).get(fqn, (fqn,)):
            value = value[key]
        if t.skip_reason is None:
            want = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert consolidate(t).tobytes() == want, fqn
    assert all(t.chunks[0].offsets == (0,) * len(t.shape) for t in ours.values())  # kept inside non-tensor items
