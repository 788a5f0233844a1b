"""PyTorch files read without torch: the corpus torch wrote, hostile pickles, malformed files, fuzzing.

The corpus in tests/data/torch was written by real torch (make_torch_files.py), with what torch reads
from each file beside it as JSON, so these tests need no torch. The cross-checks against torch.load at
the end run only where torch is installed.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import time
import tracemalloc
import warnings
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clipcli.checkpoint import open_checkpoint
from clipcli.checkpoint.formats import _torch_names, _torch_records
from clipcli.checkpoint.formats import torch as _torch
from clipcli.checkpoint.formats._pickle import (
    PLAIN_GLOBALS,
    Constructor,
    PickledDict,
    Record,
    resolve_plain,
    unpickle,
    unpickle_at,
)
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats.torch import is_contiguous, read_torch, shared_storages, view_byte_range
from clipcli.errors import ClipcliError, FileTypeError, MalformedError, UnsafePickleError, UnsupportedError
from tests.helpers import (
    DATA,
    PID,
    ROOT,
    Call,
    G,
    PickleCall,
    PickleDict,
    PickleGlobal,
    byte_mutations,
    ops,
    pickletools_calls,
    read_values,
    redirect_member,
    torch_view,
    torch_zip,
    zip_file,
)

CORPUS = DATA / "torch"
CORPUS_FILES = sorted(p for p in CORPUS.iterdir() if p.suffix in (".pt", ".pth", ".bin", ".ckpt"))
EXAMPLES = int(os.environ.get("CLIPCLI_FUZZ_EXAMPLES", "120"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=5000,  # milliseconds: a crafted file must not make clipcli hang
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    derandomize=EXAMPLES <= 1000,
)


# -- reading values the way the lead's reader will: from the file, by offset and strides ------------


def norm(values: np.ndarray) -> float:
    """sqrt(fsum of squares) in float64, as make_torch_files.py computes it from torch's values."""
    if values.dtype.kind == "c":
        values = values.astype(np.complex128).view(np.float64)
    wide = values.astype(np.float64).reshape(-1)
    return math.sqrt(math.fsum((wide * wide).tolist()))


def expected(path: Path) -> dict[str, Any]:
    return json.loads(path.with_name(path.name + ".json").read_text())


# -- the corpus ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name)
def test_corpus_names_dtypes_shapes_and_metadata(path: Path) -> None:
    want = expected(path)
    metadata, tensors = read_torch(path)
    assert metadata == want["metadata"]
    readable = [t for t in tensors if t.skip_reason is None]
    assert [t.name for t in readable] == [t["name"] for t in want["tensors"]]
    for t, w in zip(readable, want["tensors"], strict=True):
        assert (t.dtype_name, list(t.shape)) == (w["dtype"], w["shape"]), t.name
        assert t.dtype is not None and t.dtype.name == t.dtype_name and t.dtype.isnative
    skipped = [t for t in tensors if t.skip_reason is not None]
    assert [t.name for t in skipped] == [s["name"] for s in want["skipped"]]
    for t, w in zip(skipped, want["skipped"], strict=True):
        assert w["reason"] in t.skip_reason and t.dtype is None
        if w["shape"] is not None:
            assert list(t.shape) == w["shape"]
    assert sorted(shared_storages(tensors).values()) == want["shared"]


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name)
def test_corpus_values_match_what_torch_reads(path: Path) -> None:
    want = {t["name"]: t for t in expected(path)["tensors"]}
    _, tensors = read_torch(path)
    size = path.stat().st_size
    for t in tensors:
        if t.skip_reason is not None:
            continue
        start, end = view_byte_range(t)
        assert t.file_offset <= start <= end <= t.file_offset + t.storage_nbytes <= size
        values = read_values(path, t)
        assert hashlib.sha256(values.tobytes()).hexdigest() == want[t.name]["sha256"], t.name
        assert norm(values) == want[t.name]["norm"], t.name


def test_corpus_covers_what_the_format_offers() -> None:
    """The corpus holds what the brief asks for; a regenerated corpus that lost a case fails here."""
    dtypes = {t["dtype"] for p in CORPUS_FILES for t in expected(p)["tensors"]}
    assert dtypes >= {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    }
    shapes = [t["shape"] for p in CORPUS_FILES for t in expected(p)["tensors"]]
    assert [] in shapes and any(0 in s for s in shapes)
    reasons = {s["reason"] for p in CORPUS_FILES for s in expected(p)["skipped"]}
    assert reasons >= {"sparse", "quantized", "meta", "nested"}
    assert len(CORPUS_FILES) >= 15
    assert sum(p.stat().st_size for p in CORPUS.iterdir()) < 1 << 20


def test_views_keep_their_layout() -> None:
    _, tensors = read_torch(CORPUS / "views.pt")
    by_name = {t.name: t for t in tensors}
    assert by_name["slice"].storage_offset == 2 and is_contiguous(by_name["slice"])
    assert by_name["strided"].strides == (3,) and not is_contiguous(by_name["strided"])
    assert by_name["transposed"].strides == (1, 4) and not is_contiguous(by_name["transposed"])
    assert by_name["expanded"].strides == (0, 1) and not is_contiguous(by_name["expanded"])
    assert is_contiguous(by_name["matrix"]) and by_name["matrix"].storage_key == by_name["transposed"].storage_key
    t = by_name["column"]
    start, end = view_byte_range(t)
    assert (start - t.file_offset, end - start) == (4, (2 * 4 + 1) * 4)


def test_tied_weights_share_one_storage() -> None:
    _, tensors = read_torch(CORPUS / "tied.pt")
    assert [t.name for t in tensors] == ["emb.weight", "head.weight"]
    assert len({(t.storage_key, t.file_offset, t.storage_nbytes) for t in tensors}) == 1
    assert shared_storages(tensors) == {tensors[0].storage_key: ["emb.weight", "head.weight"]}


def test_bare_tensor_is_named_after_the_file(tmp_path: Path) -> None:
    target = tmp_path / "gradient.bin"
    target.write_bytes((CORPUS / "single.pt").read_bytes())
    _, tensors = read_torch(target)
    assert [t.name for t in tensors] == ["gradient"]


def test_optimizer_state_flattens_to_dotted_names() -> None:
    metadata, tensors = read_torch(CORPUS / "adam.pt")
    assert [t.name for t in tensors][:3] == ["state.0.step", "state.0.exp_avg", "state.0.exp_avg_sq"]
    assert metadata["param_groups.0.lr"] == "0.001"
    assert metadata["param_groups.0.betas.1"] == "0.999"
    assert metadata["param_groups.0.params.3"] == "3"
    assert metadata["param_groups.0.foreach"] == "None" and metadata["param_groups.0.amsgrad"] == "False"


def test_non_string_keys_and_empty_containers() -> None:
    metadata, tensors = read_torch(CORPUS / "nested.pt")
    assert "config.by_int.1" in [t.name for t in tensors]
    assert metadata["config.by_tuple.(1, 'a')"] == "4"
    assert metadata["config.by_none.None"] == "1.5"
    assert (metadata["config.empty"], metadata["config.no_items"]) == ("{}", "[]")


@pytest.mark.parametrize("name", ["model_state.pt", "model_state_legacy.pt"])
def test_embedded_file_is_read_in_place(tmp_path: Path, name: str) -> None:
    """A torch.save file at bytes [start, end) of a larger one (as in a .distcp file) reads the same."""
    inner = (CORPUS / name).read_bytes()
    target = tmp_path / "shard.distcp"
    target.write_bytes(b"x" * 1000 + inner + b"y" * 77)
    _, alone = read_torch(CORPUS / name)
    _, embedded = read_torch(target, 1000, 1000 + len(inner))
    assert [t.name for t in embedded] == [t.name for t in alone]
    for a, e in zip(alone, embedded, strict=True):
        assert e.file_offset == a.file_offset + 1000
        assert np.array_equal(read_values(target, e), read_values(CORPUS / name, a), equal_nan=True)
    with pytest.raises(MalformedError, match="not inside the file"):
        read_torch(target, 1000, 10**9)


def test_distributed_checkpoint_items_are_torch_save_files() -> None:
    """A .distcp file holds one torch.save file per item, at the offsets its .metadata records."""
    for region in json.loads((CORPUS / "distcp.json").read_text())["regions"]:
        path = CORPUS / "distcp" / region["file"]
        metadata, tensors = read_torch(path, region["offset"], region["offset"] + region["length"])
        if "value" in region:
            assert (metadata, tensors) == ({"__0_0": region["value"]}, [])
        else:
            (t,) = tensors
            assert hashlib.sha256(read_values(path, t).tobytes()).hexdigest() == region["sha256"]


def test_big_endian_storages_are_marked() -> None:
    _, tensors = read_torch(CORPUS / "big_endian.pt")
    assert tensors and all(t.big_endian for t in tensors)
    _, tensors = read_torch(CORPUS / "no_byteorder.pt")
    assert not any(t.big_endian for t in tensors)


# -- writing pickles and containers by hand -----------------------------------------------------------


def pkl(x: Any) -> bytes:
    return b"\x80\x02" + ops(x) + b"."


ORDERED = Call(G("collections", "OrderedDict"))


def storage(key: str = "0", numel: int = 6, cls: str = "FloatStorage", legacy: bool = False) -> PID:
    pid = ("storage", G("torch", cls), key, "cpu", numel)
    return PID((*pid, None) if legacy else pid)


def tensor(st: Any = None, offset: int = 0, shape: Any = (2, 3), stride: Any = (3, 1)) -> Call:
    st = storage() if st is None else st
    return Call(G("torch._utils", "_rebuild_tensor_v2"), st, offset, shape, stride, False, ORDERED)


def legacy_file(path: Path, obj_pkl: bytes, storages: dict[str, tuple[int, bytes]] | None = None) -> Path:
    """A legacy torch.save file: magic, protocol, sys_info, the object, the keys, then count + bytes each."""
    storages = storages if storages is not None else {"0": (6, bytes(24))}
    sys_info = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}
    parts = [pickle.dumps(x, protocol=2) for x in (_torch.MAGIC_NUMBER, 1001, sys_info)]
    parts += [obj_pkl, pickle.dumps(list(storages), protocol=2)]
    parts += [struct.pack("<q", count) + data for count, data in storages.values()]
    path.write_bytes(b"".join(parts))
    return path


def container(kind: str, tmp_path: Path, obj_pkl: bytes) -> Path:
    """A zip or legacy torch.save file around a pickle that uses no storage."""
    if kind == "zip":
        return zip_file(tmp_path / "evil.pt", obj_pkl, {})
    return legacy_file(tmp_path / "evil.pt", obj_pkl, {})


CONTAINERS = ["zip", "legacy"]


def test_hand_written_torch_pickle_reads(tmp_path: Path) -> None:
    data = np.arange(6, dtype=np.float32)
    obj = {"w": tensor(), "t": tensor(shape=(3, 2), stride=(1, 3)), "step": 3}
    _, tensors = read_torch(zip_file(tmp_path / "a.pt", pkl(obj), {"0": data.tobytes()}))
    assert [t.name for t in tensors] == ["w", "t"]
    assert np.array_equal(read_values(tmp_path / "a.pt", tensors[1]), data.reshape(2, 3).T)
    legacy = {"w": tensor(storage(legacy=True))}
    _, tensors = read_torch(legacy_file(tmp_path / "b.pt", pkl(legacy), {"0": (6, data.tobytes())}))
    assert np.array_equal(read_values(tmp_path / "b.pt", tensors[0]), data.reshape(2, 3))


# -- hostile pickles ----------------------------------------------------------------------------------


class Reduces:
    """An object whose pickle calls `func(*args)` when loaded by Python's pickle."""

    def __init__(self, func: Any, *args: Any):
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def payloads(sentinel: Path) -> dict[str, Any]:
    """Objects whose unpickling by Python's pickle creates `sentinel` or sets CLIPCLI_PWNED."""
    code = f"open({str(sentinel)!r}, 'w').close(); import os; os.environ['CLIPCLI_PWNED'] = '1'"
    return {
        "os.system": Reduces(os.system, f"touch {sentinel}"),
        "builtins.eval": Reduces(eval, f"exec({code!r})"),
        "builtins.exec": Reduces(exec, code),
        "subprocess.Popen": Reduces(subprocess.Popen, ["touch", str(sentinel)]),
        "builtins.getattr": Reduces(getattr, Reduces(__import__, "os"), "system"),
        "nested in a state dict": {"weight": 1.0, "evil": [Reduces(os.system, f"touch {sentinel}")]},
    }


@pytest.mark.parametrize("kind", CONTAINERS)
@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
@pytest.mark.parametrize("what", list(payloads(Path("x"))))
def test_reduce_payloads_are_read_inert_and_audited(tmp_path: Path, kind: str, protocol: int, what: str) -> None:
    sentinel = tmp_path / "pwned"
    payload = pickle.dumps(payloads(sentinel)[what], protocol=protocol)
    path = container(kind, tmp_path, payload)
    audit = Audit()
    modules = set(sys.modules)
    metadata, tensors = read_torch(path, audit=audit)
    imported = set(sys.modules) - modules
    result = audit.result(str(path))
    calls = {g.name for g in result.globals if g.use == "call"}
    assert calls == pickletools_calls(payload)
    assert set(result.unsafe_calls) == calls and not result.loads_with_weights_only
    if "." in what:  # protocols 0-2 spell subprocess.Popen "commands.Popen"... no: Python 3 writes subprocess
        assert any(name.endswith(what.split(".")[-1]) for name in calls), calls
    assert any(v.startswith("<") for v in metadata.values()) and tensors == []
    assert not sentinel.exists() and "CLIPCLI_PWNED" not in os.environ
    assert all(name.startswith("encodings.") for name in imported), imported  # codecs of protocol 0's text only


def test_the_payloads_are_live(tmp_path: Path) -> None:
    """The same bytes that clipcli reads inertly do create the sentinel when Python's pickle loads them."""
    sentinel = tmp_path / "pwned"
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(pickle.dumps(payloads(sentinel)["builtins.exec"], protocol=2))
    for kind in CONTAINERS:
        metadata, _ = read_torch(container(kind, tmp_path, payload.read_bytes()))
        assert metadata["evil"].startswith("<builtins.exec(")
    assert not sentinel.exists()
    script = "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read())"
    subprocess.run([sys.executable, "-c", script, str(payload)], check=True, env={"PATH": os.environ["PATH"]})
    assert sentinel.exists()


def stack_global_from_memo(module: str, name: str) -> bytes:
    """A global named by STACK_GLOBAL from strings that only the memo holds by then."""
    return b"".join(
        [
            b"\x80\x04",
            b"\x8c" + bytes([len(module)]) + module.encode() + b"\x94",  # SHORT_BINUNICODE, MEMOIZE (0)
            b"\x8c" + bytes([len(name)]) + name.encode() + b"\x94",  # SHORT_BINUNICODE, MEMOIZE (1)
            b"00",  # POP both
            b"h\x00h\x01\x93",  # BINGET 0, BINGET 1, STACK_GLOBAL
            b"\x8c\x04true\x85R.",  # ("true",), REDUCE, STOP
        ]
    )


# read with placeholders: (payload, the globals called, the metadata rendered for the placeholder)
INERT_PAYLOADS = {
    "STACK_GLOBAL from memo": (stack_global_from_memo("os", "system"), {"os.system"}),
    "INST": (b"(S'touch x'\nios\nsystem\n.", {"os.system"}),
    "OBJ of a refused global": (b"\x80\x02(cos\nsystem\nS'x'\no.", {"os.system"}),
    "NEWOBJ of a refused class": (b"\x80\x02csubprocess\nPopen\n)\x81.", {"subprocess.Popen"}),
    "torch.load": (pkl(Call(G("torch", "load"), "x.pt")), {"torch.load"}),
    "torch.hub.load": (pkl(Call(G("torch.hub", "load"), "evil/repo", "model")), {"torch.hub.load"}),
    "torch._C": (pkl(Call(G("torch._C", "_set_grad_enabled"), False)), {"torch._C._set_grad_enabled"}),
    "torch.serialization.load": (pkl(G("torch.serialization", "load")), set()),
    "torch.nn module": (pkl(Call(G("torch.nn.modules.linear", "Linear"), 2, 2)), {"torch.nn.modules.linear.Linear"}),
    "getattr": (pkl(Call(Call(G("builtins", "getattr"), G("os", "path"), "join"), "a")), {"builtins.getattr"}),
    "__builtin__ spelling": (pkl(Call(G("__builtin__", "eval"), "1")), {"builtins.eval"}),
    "builtins.frozenset (torch refuses it too)": (
        pickle.dumps({"f": frozenset({1})}, protocol=2),
        {"builtins.frozenset"},
    ),
    "builtins.bytes (torch refuses it too)": (pickle.dumps({"b": b""}, protocol=2), {"builtins.bytes"}),
}


@pytest.mark.parametrize("kind", CONTAINERS)
@pytest.mark.parametrize("what", list(INERT_PAYLOADS))
def test_foreign_globals_become_placeholders_and_their_calls_are_audited(tmp_path: Path, kind: str, what: str) -> None:
    payload, called = INERT_PAYLOADS[what]
    audit = Audit()
    metadata, tensors = read_torch(container(kind, tmp_path, payload), audit=audit)
    result = audit.result("evil.pt")
    assert {g.name for g in result.globals if g.use == "call"} == called == pickletools_calls(payload)
    assert set(result.unsafe_calls) == called and not result.loads_with_weights_only
    assert tensors == [] and metadata


RAW_PAYLOADS = {
    "OBJ": (b"\x80\x02(ccollections\nOrderedDict\no.", "OBJ"),
    "NEWOBJ": (b"\x80\x02ccollections\nOrderedDict\n)\x81.", "NEWOBJ"),
    "NEWOBJ_EX": (b"\x80\x04ccollections\nOrderedDict\n)}\x92.", "NEWOBJ_EX"),
    "EXT1": (b"\x80\x02\x82\x01)R.", "EXT1"),
    "EXT2": (b"\x80\x02\x83\x01\x00)R.", "EXT2"),
    "EXT4": (b"\x80\x02\x84\x01\x00\x00\x00)R.", "EXT4"),
    "REDUCE on a string": (pkl(Call("os.system", "x")), "calls a str"),
    "REDUCE on a dtype": (pkl(Call(G("torch", "float32"), 1)), "calls a global torch.float32"),
    "REDUCE on a storage type": (pkl(Call(G("torch", "FloatStorage"), 4)), "calls a global torch.FloatStorage"),
    "BUILD on a list": (b"\x80\x02]}X\x0c\x00\x00\x00__setstate__Nsb.", "BUILD"),
    "BUILD on a dtype": (pkl(G("torch", "float32"))[:-1] + ops({"x": 1}) + b"b.", "BUILD"),
}


@pytest.mark.parametrize("kind", CONTAINERS)
@pytest.mark.parametrize("what", list(RAW_PAYLOADS))
def test_raw_opcode_payloads_are_refused(tmp_path: Path, kind: str, what: str) -> None:
    payload, words = RAW_PAYLOADS[what]
    with pytest.raises(UnsafePickleError) as e:
        read_torch(container(kind, tmp_path, payload))
    assert words in str(e.value)
    assert str(e.value).startswith(str(tmp_path / "evil.pt") + ": ")


MALFORMED_CALLS = {
    "storage argument that is a function": (
        Call(
            G("torch._utils", "_rebuild_tensor_v2"), G("torch._utils", "_rebuild_tensor_v2"), 0, (1,), (1,), False, {}
        ),
        "where a storage belongs",
    ),
    "storage argument that is a string": (
        Call(G("torch._utils", "_rebuild_tensor_v2"), "0", 0, (1,), (1,), False, {}),
        "where a storage belongs",
    ),
    "too few arguments": (Call(G("torch._utils", "_rebuild_tensor_v2"), storage()), "arguments it does not take"),
    "REDUCE arguments not a tuple": (b"\x80\x02ctorch\nSize\n]R.", "not a tuple"),
    "parameter of a string": (Call(G("torch._utils", "_rebuild_parameter"), "x", False, {}), "where a tensor belongs"),
    "rebuild_from_type with a foreign function": (
        Call(G("torch._tensor", "_rebuild_from_type_v2"), G("torch", "float32"), G("torch", "Tensor"), (), {}),
        "to call",
    ),
    "rebuild_from_type with a foreign type": (
        Call(
            G("torch._tensor", "_rebuild_from_type_v2"),
            G("torch._utils", "_rebuild_tensor_v2"),
            G("torch", "float32"),
            (),
            {},
        ),
        "tensor type",
    ),
    "v3 with a dtype that is not one": (
        Call(G("torch._utils", "_rebuild_tensor_v3"), storage(), 0, (1,), (1,), False, {}, "float32"),
        "dtype",
    ),
    "persistent id with four fields": (PID(("storage", G("torch", "FloatStorage"), "0", "cpu")), "persistent id"),
    "persistent id of a module": (PID(("module", "x", None, None)), "persistent id"),
    "persistent id that is a string": (PID("0"), "persistent id"),
    "persistent id with a foreign storage type": (PID(("storage", G("torch", "float32"), "0", "cpu", 6)), "type"),
    "persistent id with a negative size": (PID(("storage", G("torch", "FloatStorage"), "0", "cpu", -1)), "size"),
    "quantized without a scheme": (
        Call(G("torch._utils", "_rebuild_qtensor"), storage(), 0, (1,), (1,), ("x",), False, {}),
        "quantization scheme",
    ),
    "sparse of an unknown layout": (Call(G("torch._utils", "_rebuild_sparse_tensor"), "coo", ()), "layout"),
    "torch.Size of strings": (Call(G("torch", "Size"), ("a",)), "torch.Size"),
}


@pytest.mark.parametrize("what", list(MALFORMED_CALLS))
def test_malformed_torch_calls(tmp_path: Path, what: str) -> None:
    obj, words = MALFORMED_CALLS[what]
    payload = obj if isinstance(obj, bytes) else pkl({"x": obj})
    with pytest.raises(MalformedError, match=words):
        read_torch(zip_file(tmp_path / "bad.pt", payload))


VIEW_ERRORS = {
    "view past the storage": (tensor(offset=1), "needs 28 bytes of storage 0, which holds 24"),
    "negative stride": (tensor(stride=(-3, 1)), "strides"),
    "negative dimension": (tensor(shape=(-2, 3)), "shape"),
    "strides of another rank": (tensor(stride=(1,)), "2 dimensions but 1 strides"),
    "negative offset": (tensor(offset=-1), "storage offset"),
    "huge shape": (tensor(shape=(2**70, 1), stride=(1, 1)), "shape"),
    "overflowing view": (tensor(shape=(2**62, 4), stride=(2**62, 1)), "more than 2**63 elements"),
    "view past the storage by a huge stride": (tensor(shape=(2, 2), stride=(2**62, 1)), "needs"),
    "bool in shape": (tensor(shape=(True, 3)), "shape"),
    "shape that is a string": (tensor(shape="23"), "shape"),
}


@pytest.mark.parametrize("what", list(VIEW_ERRORS))
def test_view_errors_name_the_tensor(tmp_path: Path, what: str) -> None:
    obj, words = VIEW_ERRORS[what]
    with pytest.raises(MalformedError) as e:
        read_torch(zip_file(tmp_path / "bad.pt", pkl({"layers": [{"weight": obj}]})))
    assert e.value.tensor == "layers.0.weight"
    assert words in e.value.message
    assert str(e.value).startswith(f"{tmp_path / 'bad.pt'}: tensor layers.0.weight: ")


def test_empty_tensor_needs_no_storage(tmp_path: Path) -> None:
    obj = {"e": tensor(offset=100, shape=(0, 3), stride=(3, 1))}
    _, tensors = read_torch(zip_file(tmp_path / "ok.pt", pkl(obj)))
    assert tensors[0].shape == (0, 3) and view_byte_range(tensors[0])[0] == view_byte_range(tensors[0])[1]


STORAGE_ERRORS = {
    "member larger than declared": ({"0": bytes(28)}, "holds 28 bytes but the pickle declares 6 float32"),
    "member smaller than declared": ({"0": bytes(20)}, "holds 20 bytes"),
    "no member": ({}, "not in the archive"),
}


@pytest.mark.parametrize("what", list(STORAGE_ERRORS))
def test_storage_members_are_checked(tmp_path: Path, what: str) -> None:
    members, words = STORAGE_ERRORS[what]
    with pytest.raises(MalformedError, match=words):
        read_torch(zip_file(tmp_path / "bad.pt", pkl({"w": tensor()}), members))


def test_storage_declared_twice_differently(tmp_path: Path) -> None:
    obj = {"a": tensor(), "b": tensor(storage(numel=8), shape=(2,), stride=(1,))}
    with pytest.raises(MalformedError, match="declared twice"):
        read_torch(zip_file(tmp_path / "bad.pt", pkl(obj)))


@pytest.mark.parametrize(
    ("obj", "name", "paths"),
    [
        ({"a.b": tensor(), "a": {"b": 1}}, "a.b", "['a.b'] and ['a']['b']"),
        # gh-24: {1: t, "1": u} (as torch.save writes it) said only "two entries flatten to this name"
        ({1: tensor(), "1": tensor()}, "1", "[1] and ['1']"),
        ({"x": [tensor()], "x.0": 5}, "x.0", "['x'][0] and ['x.0']"),
    ],
)
def test_duplicate_names_after_flattening_name_both_entries(tmp_path: Path, obj, name, paths) -> None:
    with pytest.raises(MalformedError) as e:
        read_torch(zip_file(tmp_path / "bad.pt", pkl(obj)))
    assert e.value.tensor == name
    assert e.value.message == f"two entries of the pickle, {paths}, flatten to this one name"


def test_compressed_storage_is_unsupported(tmp_path: Path) -> None:
    source = zipfile.ZipFile(CORPUS / "single.pt")
    target = tmp_path / "deflated.pt"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as z:
        for info in source.infolist():
            z.writestr(info.filename, source.read(info))
    with pytest.raises(UnsupportedError, match="compressed"):
        read_torch(target)


def test_legacy_storage_counts_are_checked(tmp_path: Path) -> None:
    obj = pkl({"w": tensor(storage(legacy=True))})
    with pytest.raises(MalformedError, match="holds 5 elements but the pickle declares 6"):
        read_torch(legacy_file(tmp_path / "a.pt", obj, {"0": (5, bytes(20))}))
    with pytest.raises(MalformedError, match="past the end"):
        read_torch(legacy_file(tmp_path / "b.pt", obj, {"0": (6, bytes(20))}))
    with pytest.raises(MalformedError, match="never uses"):
        read_torch(legacy_file(tmp_path / "c.pt", obj, {"0": (6, bytes(24)), "9": (1, bytes(4))}))
    with pytest.raises(MalformedError, match="no data"):
        read_torch(legacy_file(tmp_path / "d.pt", obj, {}))


def test_legacy_storage_views(tmp_path: Path) -> None:
    """Storage views of torch < 0.4: (view key, offset, size) into a root storage."""
    data = np.arange(10, dtype=np.float32)
    view = PID(("storage", G("torch", "FloatStorage"), "0", "cpu", 10, ("1", 4, 5)))
    obj = pkl({"v": tensor(view, offset=1, shape=(2, 2), stride=(2, 1))})
    _, tensors = read_torch(legacy_file(tmp_path / "a.pt", obj, {"0": (10, data.tobytes())}))
    assert tensors[0].storage_offset == 5 and tensors[0].storage_key == "0"
    assert np.array_equal(read_values(tmp_path / "a.pt", tensors[0]), data[5:9].reshape(2, 2))
    outside = pkl({"v": tensor(view, offset=2, shape=(2, 2), stride=(2, 1))})
    with pytest.raises(MalformedError, match="needs"):
        read_torch(legacy_file(tmp_path / "b.pt", outside, {"0": (10, data.tobytes())}))


def test_other_files_are_not_torch_files(tmp_path: Path) -> None:
    cases = {
        "plain.pkl": (pickle.dumps({"a": 1}), FileTypeError, "a Python pickle, not a torch.save file"),
        "empty.pt": (b"", FileTypeError, "an empty file"),
        "text.pt": (b"hello world\n", FileTypeError, "not a PyTorch file"),
        "weights.npz": (_npz_bytes(), FileTypeError, "not a torch.save file"),
    }
    for name, (data, error, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(error, match=words):
            read_torch(tmp_path / name)


def _npz_bytes() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=np.arange(3))
    return buf.getvalue()


def test_old_tar_format_is_refused(tmp_path: Path) -> None:
    tar = tmp_path / "old.pt"
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        for member in ("sys_info", "pickle", "storages", "tensors"):
            info = tarfile.TarInfo(member)
            info.size = 4
            t.addfile(info, io.BytesIO(b"\x80\x02N."))
    with pytest.raises(UnsupportedError, match="tar format"):
        read_torch(tar)


def test_torchscript_records_without_data_pkl_are_no_torch_file(tmp_path: Path) -> None:
    # TorchScript archives read (tests/checkpoint/test_torchscript.py); without data.pkl there is nothing to read
    script = tmp_path / "script.pt"
    with zipfile.ZipFile(script, "w") as z:
        z.writestr("script/constants.pkl", pickle.dumps(()))
        z.writestr("script/code/__torch__.py", "")
    with pytest.raises(FileTypeError, match=r"without data\.pkl"):
        read_torch(script)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ClipcliError, match="No such file"):
        read_torch(tmp_path / "nope.pt")


# -- the pickle machine ---------------------------------------------------------------------------------

plain_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.complex_numbers(allow_nan=False),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=4) | st.integers(), children, max_size=4)
        | st.frozensets(st.integers() | st.text(max_size=3), max_size=3)
        | st.sets(st.integers(), max_size=3)
        | st.builds(OrderedDict, st.dictionaries(st.text(max_size=4), children, max_size=3))
    ),
    max_leaves=12,
)


@FUZZ
@given(value=plain_values, protocol=st.integers(0, 5))
def test_plain_data_round_trips_every_protocol(value: Any, protocol: int) -> None:
    assert unpickle(pickle.dumps(value, protocol=protocol), resolve_plain) == value


def test_shared_and_self_referencing_objects_keep_their_identity() -> None:
    shared: list[Any] = [1]
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    for protocol in range(6):
        a, b = unpickle(pickle.dumps([shared, shared], protocol=protocol), resolve_plain)
        assert a is b
        c = unpickle(pickle.dumps(cyclic, protocol=protocol), resolve_plain)
        assert c[0] is c
        d = unpickle(pickle.dumps(OrderedDict(a=1), protocol=protocol), resolve_plain)
        assert isinstance(d, PickledDict) and d == {"a": 1}


def test_ordered_dict_attributes_are_kept_aside() -> None:
    d = OrderedDict(w=1)
    d._metadata = {"": {"version": 1}}  # what nn.Module.state_dict() attaches
    out = unpickle(pickle.dumps(d, protocol=2), resolve_plain)
    assert out == {"w": 1} and out.attributes == {"_metadata": {"": {"version": 1}}}


def test_constructors_and_records_are_the_only_callables() -> None:
    class Point(Record):
        def __init__(self, x: int = 0):
            self.x = x

        def build(self, state: Any) -> None:
            self.x = state["x"]

    allowed = {("geometry", "Point"): Constructor("geometry.Point", Point, newobj=True), **PLAIN_GLOBALS}

    def resolve(module: str, name: str) -> Any:
        return allowed.get((module, name))

    point = unpickle(b"\x80\x02cgeometry\nPoint\n)\x81}X\x01\x00\x00\x00xK\x07sb.", resolve)
    assert isinstance(point, Point) and point.x == 7
    # the same class by REDUCE is a call too; a marker that is not a Constructor is never called
    assert isinstance(unpickle(b"\x80\x02cgeometry\nPoint\nK\x02\x85R.", resolve), Point)
    allowed[("geometry", "origin")] = Point()
    with pytest.raises(UnsafePickleError, match="calls a Point"):
        unpickle(b"\x80\x02cgeometry\norigin\n)R.", resolve)


MALFORMED_STREAMS = {
    "empty": (b"", "without a STOP"),
    "no STOP": (b"\x80\x02N", "without a STOP"),
    "unknown opcode": (b"\x80\x02\xff.", "unknown pickle opcode 0xff"),
    "protocol 6": (b"\x80\x06N.", "protocol 6"),
    "stack underflow": (b"\x80\x02.", "underflow"),
    "APPEND underflow": (b"\x80\x02Na.", "underflow"),
    "memo miss": (b"\x80\x02h\x05.", "memo entry 5"),
    "no MARK": (b"\x80\x02t.", "without a MARK"),
    "odd SETITEMS": (b"\x80\x02}(K\x01u.", "key but no value"),
    "unhashable key": (b"\x80\x02}]K\x01s.", "cannot be a dict key"),
    "unhashable set member": (b"\x80\x04\x8f(]\x90.", "set member"),
    "APPEND to a dict": (b"\x80\x02}K\x01a.", "APPEND to a dict"),
    "SETITEM on a list": (b"\x80\x02]K\x01K\x02s.", "SETITEM on a list"),
    "BINBYTES8 of 2**60": (b"\x80\x04\x8e" + struct.pack("<Q", 2**60) + b"abc.", "claims 1152921504606846976"),
    "BINUNICODE past the end": (b"\x80\x02X\xff\xff\xff\x7fabc.", "claims"),
    "negative LONG4": (b"\x80\x02\x8b\xff\xff\xff\xff.", "negative length"),
    "FRAME past the end": (b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b"N.", "frame"),
    "text int too long": (b"I" + b"9" * 5000 + b"\n.", "INT"),
    "bad UTF-8": (b"\x80\x02X\x01\x00\x00\x00\xff.", "BINUNICODE"),
    "unquoted STRING": (b"Sabc\n.", "not quoted"),
    "out-of-band buffer": (b"\x80\x05\x97.", "out-of-band"),
    "persistent id without a loader": (b"\x80\x02N\x51.", "persistent object"),
    "STACK_GLOBAL of ints": (b"\x80\x04K\x01K\x02\x93.", "STACK_GLOBAL with an int"),
    "trailing bytes": (b"\x80\x02N.junk", "follow the pickle's STOP"),
}


@pytest.mark.parametrize("what", list(MALFORMED_STREAMS))
def test_malformed_streams(what: str) -> None:
    data, words = MALFORMED_STREAMS[what]
    with pytest.raises(MalformedError, match=words):
        unpickle(data, resolve_plain)


PY2_AND_TEXT_STREAMS = {
    b"S'abc'\n.": "abc",
    b'S"a\\nb"\n.': "a\nb",
    b"U\x03abc.": "abc",
    b"T\x03\x00\x00\x00abc.": "abc",
    b"Vh\\u00e9\n.": "hé",
    b"I01\n.": True,
    b"I00\n.": False,
    b"I-7\n.": -7,
    b"L12345678901234567890L\n.": 12345678901234567890,
    b"F1.5\n.": 1.5,
    b"(I1\nI2\nl.": [1, 2],
    b"(I1\nS'x'\nt.": (1, "x"),
    b"(dp0\nS'a'\np1\nI1\nsg1\n.": "a",
    b"\x80\x02c__builtin__\nset\n]K\x01a\x85R.": {1},
    b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00\xc3\xbfX\x06\x00\x00\x00latin1\x86R.": b"\xff",
    b"\x80\x02ccollections\nOrderedDict\n]X\x01\x00\x00\x00aK\x01\x86a\x85R.": {"a": 1},
}


@pytest.mark.parametrize("data", list(PY2_AND_TEXT_STREAMS), ids=repr)
def test_text_opcodes_and_python2_pickles(data: bytes) -> None:
    """The text opcodes of protocol 0, and strings as Python 2 wrote them (read as UTF-8, as torch.load does)."""
    assert unpickle(data, resolve_plain) == PY2_AND_TEXT_STREAMS[data]


def test_unpickle_at_reports_where_the_pickle_ends() -> None:
    data = pickle.dumps(1, protocol=2) + pickle.dumps("two", protocol=4)
    one, end = unpickle_at(data, 0, resolve_plain)
    two, end2 = unpickle_at(data, end, resolve_plain)
    assert (one, two, end2) == (1, "two", len(data))


def nested_lists(depth: int) -> bytes:
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def nested_tuples(depth: int) -> bytes:
    return b"\x80\x02" + b"(" * depth + b"t" * depth + b"."


def nested_dicts(depth: int) -> bytes:
    return b"\x80\x02" + b"}X\x01\x00\x00\x00k" * depth + b"N" + b"s" * depth + b"."


@pytest.mark.parametrize("kind", CONTAINERS)
@pytest.mark.parametrize("make", [nested_lists, nested_tuples, nested_dicts])
def test_deep_nesting_is_refused_quickly(tmp_path: Path, kind: str, make: Any) -> None:
    started = time.perf_counter()
    with pytest.raises(MalformedError, match="deeper than 1000 levels"):
        read_torch(container(kind, tmp_path, make(10_000)))
    assert time.perf_counter() - started < 2


def test_nesting_within_the_limit_is_read(tmp_path: Path) -> None:
    metadata, _ = read_torch(zip_file(tmp_path / "deep.pt", nested_dicts(900), {}))
    assert metadata == {".".join(["k"] * 900): "None"}


def test_self_referencing_list_is_refused(tmp_path: Path) -> None:
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    # issue 22 item 5: the name budget, proportional to the pickle's 12 bytes, ends the cycle first
    with pytest.raises(MalformedError, match="hold themselves"):
        read_torch(zip_file(tmp_path / "cycle.pt", pickle.dumps(cyclic, protocol=2), {}))


@pytest.mark.parametrize("kind", CONTAINERS)
def test_path_multiplying_memo_is_refused_quickly(tmp_path: Path, kind: str) -> None:
    """A list holding the same list twice, 60 levels deep: 2**60 names from a few hundred bytes."""
    x: Any = [1.5]
    for _ in range(60):
        x = [x, x]
    payload = pickle.dumps(x, protocol=2)
    assert len(payload) < 1000
    started = time.perf_counter()
    with pytest.raises(MalformedError, match="share one another"):
        read_torch(container(kind, tmp_path, payload))
    assert time.perf_counter() - started < 2


def memo_reuse(build: bytes, use: bytes, times: int) -> bytes:
    """A pickle that builds one object, memoizes it, then hands it to `use` over and over (in a list)."""
    return b"\x80\x02" + build + b"r\x00\x00\x00\x000" + b"]" + b"(" + use * times + b"e."


AMPLIFIERS = {
    # builtins.set over one memoized list of 2,000 integers, 5,000 times: 1e7 insertions from 140 kB
    "set over a memoized list": (
        memo_reuse(ops(list(range(2000))), b"c__builtin__\nset\nj\x00\x00\x00\x00\x85R", 5000),
        "more data than it holds",
    ),
    # _codecs.encode of one memoized 100 kB string, 5,000 times: 500 MB of bytes from 130 kB
    "encode of a memoized string": (
        memo_reuse(ops("x" * 100_000), b"c_codecs\nencode\nj\x00\x00\x00\x00X\x06\x00\x00\x00latin1\x86R", 5000),
        "more data than it holds",
    ),
    # integers that all hash alike, as dict keys: quadratic insertion
    # written opcode by opcode: Python itself takes seconds to build such a dict
    "colliding integer keys": (
        b"\x80\x02}(" + b"".join(ops(k * (2**61 - 1)) + b"N" for k in range(20_000)) + b"u.",
        "collide",
    ),
    "colliding keys of a set": (
        b"\x80\x04\x8f(" + b"".join(ops(k * (2**61 - 1)) for k in range(20_000)) + b"\x90.",
        "collide",
    ),
    "memo index that collides": (b"\x80\x02Np" + str(2**61 - 1).encode() + b"\n.", "memo index"),
}


@pytest.mark.parametrize("what", list(AMPLIFIERS))
def test_small_pickles_cannot_make_much_work(what: str) -> None:
    data, words = AMPLIFIERS[what]
    started = time.perf_counter()
    with pytest.raises(MalformedError, match=words):
        unpickle(data, resolve_plain)
    assert time.perf_counter() - started < 2


def test_names_and_values_from_memoized_objects_are_bounded(tmp_path: Path) -> None:
    """One memoized 100 kB string used as every key of a 1,000-deep chain, or as 10,000 leaves."""
    key = ops("k" * 100_000) + b"r\x00\x00\x00\x00"
    chain = b"\x80\x02" + b"}" + key + b"}j\x00\x00\x00\x00" * 999 + b"N" + b"s" * 1000 + b"."
    with pytest.raises(MalformedError, match="would not end"):
        read_torch(zip_file(tmp_path / "chain.pt", chain, {}))
    leaves = b"\x80\x02" + ops(b"b" * 100_000) + b"r\x00\x00\x00\x000]" + b"(" + b"j\x00\x00\x00\x00" * 10_000 + b"e."
    started = time.perf_counter()
    with pytest.raises(MalformedError, match="would not end"):
        read_torch(zip_file(tmp_path / "leaves.pt", leaves, {}))
    assert time.perf_counter() - started < 2


# -- fuzzing --------------------------------------------------------------------------------------------

OPCODES = [bytes([c]) for c in range(256) if chr(c) in "IJKMLSTUBCNVXFG]ael)t}dsu0(21ghjpqrcRbiosQP." or c >= 0x80]


def read_or_refuse(path: Path) -> str:
    """'ok' when the file parses (and every tensor lies in the file), else clipcli's one-line error."""
    try:
        _, tensors = read_torch(path)
    except ClipcliError as e:
        assert "\n" not in str(e)
        return str(e)
    size = path.stat().st_size
    for t in tensors:
        if t.storage_key:
            assert 0 <= t.file_offset <= t.file_offset + t.storage_nbytes <= size
        if t.dtype is not None and t.storage_key:
            start, end = view_byte_range(t)
            assert t.file_offset <= start <= end <= t.file_offset + t.storage_nbytes
    return "ok"


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(OPCODES), st.binary(max_size=10)), max_size=40), st.booleans())
def test_random_opcode_streams(program: list[tuple[bytes, bytes]], legacy: bool) -> None:
    data = b"".join(op + arg for op, arg in program) + b"."
    storages = _torch_records.Storages(legacy=legacy)
    try:
        unpickle(data, _torch_records.resolve, storages.persistent_load)
    except ClipcliError as e:
        assert "\n" not in str(e)


GLOBAL_NAMES = [name.rsplit(".", 1) for name in _torch_records._ALLOWED] + [["os", "system"], ["torch", "load"]]


def torch_like_trees() -> st.SearchStrategy[Any]:
    """Values, allowlisted globals, calls of them on random arguments and persistent ids, nested."""
    leaves = st.sampled_from(["storage", "0", "1", "cpu", "conj", 0, 1, 2, 6, -1, 2**64, 1.5, None, True, False])
    globals_ = st.sampled_from(GLOBAL_NAMES).map(lambda mn: G(*mn))
    storages = st.builds(
        lambda cls, key, numel, legacy: PID(
            ("storage", G("torch", cls), key, "cpu", numel) + ((None,) if legacy else ())
        ),
        st.sampled_from(["FloatStorage", "LongStorage", "BFloat16Storage", "QInt8Storage", "cuda.HalfStorage"]),
        st.sampled_from(["0", "1"]),
        st.integers(0, 8),
        st.booleans(),
    )

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        args = st.lists(children, max_size=8)
        return (
            st.builds(lambda f, a: Call(f, *a), globals_, args)
            | st.tuples(children, children)
            | st.lists(children, max_size=3)
            | st.dictionaries(st.sampled_from(["a", "b", "c"]), children, max_size=3)
            | st.builds(lambda a: Call(G("torch._utils", "_rebuild_tensor_v2"), *a), st.lists(children, max_size=8))
        )

    return st.recursive(leaves | globals_ | storages, extend, max_leaves=20)


@FUZZ
@given(torch_like_trees(), st.booleans())
def test_allowlisted_calls_on_random_arguments(tree: Any, legacy: bool) -> None:
    """Whatever the allowlisted constructors are handed, the result is a listing or one clipcli error."""
    storages = _torch_records.Storages(legacy=legacy)
    program = pkl(tree)
    try:
        root = unpickle(program, _torch_records.resolve, storages.persistent_load)
        for s in storages.by_key.values():
            s.file_offset = 0
        _torch_names.flatten(root, "root", storages, False, len(program))
    except ClipcliError as e:
        assert "\n" not in str(e)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    try:
        unpickle(data, _torch_records.resolve, _torch_records.Storages(legacy=False).persistent_load)
    except ClipcliError as e:
        assert "\n" not in str(e)


@FUZZ
@given(st.data())
def test_corpus_files_mutated(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    source = data.draw(st.sampled_from(CORPUS_FILES))
    mutated = data.draw(byte_mutations(source.read_bytes()))
    path = tmp_path_factory.mktemp("fuzz") / source.name
    path.write_bytes(mutated)
    read_or_refuse(path)


@pytest.mark.parametrize("source", CORPUS_FILES, ids=lambda p: p.name)
def test_corpus_files_truncated_everywhere(tmp_path: Path, source: Path) -> None:
    data = source.read_bytes()
    path = tmp_path / source.name
    for cut in sorted({*range(0, len(data), max(1, len(data) // 60)), len(data) - 1}):
        path.write_bytes(data[:cut])
        assert read_or_refuse(path) != "ok" or cut >= len(data) - 20  # a zip is unreadable without its end


def test_the_parsers_import_no_torch() -> None:
    """_pickle and _torch use the standard library, NumPy, ml_dtypes and clipcli; nothing in clipcli imports torch."""
    package = ROOT / "clipcli"
    for source in package.rglob("*.py"):
        tree = ast.parse(source.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not any(name.split(".")[0] == "torch" for name in names), source
        if source.parent.name == "formats" and source.name in (
            "_pickle.py",
            "_pickle_audit.py",
            "_numpy_pickle.py",
            "torch.py",
            "_torch_zip.py",
            "_torch_records.py",
            "_torch_names.py",
            "_torchscript.py",
        ):
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ("numpy", "ml_dtypes", "clipcli"), name
                assert top != "clipcli" or name in (
                    "clipcli.checkpoint.tensor",  # TensorInfo, for open_file
                    "clipcli.checkpoint.plugin",  # the FORMAT record
                    "clipcli.checkpoint.registry",  # what a file that is no torch.save file is, for a message
                    "clipcli.checkpoint.zipmember",
                    "clipcli.checkpoint.source",  # the store it reads through
                    "clipcli.checkpoint.formats.torch_write",  # the FORMAT's writer of .pt files
                    "clipcli.errors",
                    "clipcli.checkpoint.formats._pickle",
                    "clipcli.checkpoint.formats._pickle_audit",
                    "clipcli.checkpoint.formats._numpy_pickle",
                    "clipcli.checkpoint.formats._torch_records",
                    "clipcli.checkpoint.formats._torch_names",
                    "clipcli.checkpoint.formats._torchscript",
                    "clipcli.checkpoint.formats._torch_zip",
                    "clipcli.checkpoint.formats._common",
                    "clipcli.report",  # printable, to escape what a file names in a skip reason
                )


# -- against torch itself, where it is installed -----------------------------------------------------------


@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name)
def test_agrees_with_torch_load(path: Path) -> None:
    torch = pytest.importorskip("torch")
    how = expected(path)["torch_load"]
    if how == "fails":
        pytest.skip("torch cannot load this legacy file back")
    with warnings.catch_warnings():  # torch warns that sparse CSR support is in beta
        warnings.simplefilter("ignore")
        loaded = torch.load(path, weights_only=how == "weights_only")
    _, tensors = read_torch(path)
    flat = _flatten_torch(loaded, path.stem, torch)
    for t in tensors:
        value = flat.pop(t.name)
        assert isinstance(value, torch.Tensor)
        if t.skip_reason is not None:
            continue
        want = value.detach().contiguous()
        got = read_values(path, t)
        assert got.shape == tuple(want.shape) and got.dtype.name == str(want.dtype).removeprefix("torch.")
        raw = want.reshape(-1).view(torch.uint8).numpy().tobytes() if want.numel() else b""
        assert got.tobytes() == raw, t.name
    assert not any(isinstance(v, torch.Tensor) for v in flat.values())


@FUZZ
@given(st.data())
def test_mutated_files_both_read_give_torchs_values(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject):
    """Where a damaged file is still read by clipcli and by `torch.load(weights_only=True)`, they agree on
    every tensor's bytes. (Each may refuse where the other reads: clipcli checks CRC-32s torch does not;
    torch reads records clipcli never needs, such as `.storage_alignment`.)"""
    torch = pytest.importorskip("torch")
    files = [p for p in CORPUS_FILES if expected(p)["torch_load"] == "weights_only"]
    source = data.draw(st.sampled_from(files))
    path = tmp_path_factory.mktemp("fuzz") / source.name
    path.write_bytes(data.draw(byte_mutations(source.read_bytes())))
    try:
        with open_checkpoint(path) as ckpt:
            got = {t.name: ckpt.read(t).tobytes() for t in ckpt.tensors if t.skip is None}
    except ClipcliError:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = _flatten_torch(torch.load(path, weights_only=True), path.stem, torch)
    except Exception:  # torch's many errors for a damaged file
        return
    for name, raw in got.items():
        want = loaded[name].detach().contiguous()
        assert raw == (want.reshape(-1).view(torch.uint8).numpy().tobytes() if want.numel() else b""), name


def _flatten_torch(obj: Any, stem: str, torch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pending = [(None, obj)]
    while pending:
        name, value = pending.pop()
        if isinstance(value, dict) and (value or name is None):
            pending += [(k if name is None else f"{name}.{k}", v) for k, v in value.items()]
        elif type(value) in (list, tuple, torch.Size) and (value or name is None):
            pending += [(str(i) if name is None else f"{name}.{i}", v) for i, v in enumerate(value)]
        else:
            out[stem if name is None else name] = value
    return out


def test_hand_written_pickles_load_in_torch(tmp_path: Path) -> None:
    """The pickles these tests write by hand are the ones torch writes: torch itself reads them."""
    torch = pytest.importorskip("torch")
    data = np.arange(6, dtype=np.float32)
    path = zip_file(
        tmp_path / "a.pt", pkl({"w": tensor(), "t": tensor(offset=1, shape=(2,), stride=(2,))}), {"0": data.tobytes()}
    )
    loaded = torch.load(path, weights_only=True)
    assert loaded["t"].tolist() == [1.0, 3.0]


def test_dtype_tables_agree_with_torch() -> None:
    torch = pytest.importorskip("torch")
    for dtype, cls in torch.storage._dtype_to_storage_type_map().items():
        assert _torch_records._STORAGE_CLASSES[cls] == str(dtype).removeprefix("torch.")
    for name, d in _torch_records._DTYPES.items():
        assert getattr(torch, name).itemsize == d.itemsize, name
        if d.array is not None and d.array.type.__module__ == "numpy":  # torch has no NumPy bfloat16 or float8
            assert torch.empty(0, dtype=getattr(torch, name)).numpy().dtype == d.array


def test_ml_dtypes_names_are_numpy_names() -> None:
    assert np.dtype(ml_dtypes.bfloat16).name == "bfloat16"
    assert {d.name for d in _torch_records._DTYPES.values() if d.array is not None} >= {"float8_e4m3fn", "bool"}


# -- memory -------------------------------------------------------------------------------------------------


def peak_bytes(path: Path) -> int:
    tracemalloc.start()
    try:
        read_or_refuse(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", CONTAINERS)
def test_length_fields_allocate_nothing(tmp_path: Path, kind: str) -> None:
    """A BINBYTES8 claiming 2**60 bytes, or a storage claiming 2**62 elements, is refused, not allocated."""
    claim = b"\x80\x04\x8e" + struct.pack("<Q", 2**60) + b"x" * 100 + b"."
    assert peak_bytes(container(kind, tmp_path, claim)) < 1 << 20
    obj = pkl({"w": tensor(storage(numel=2**62, legacy=kind == "legacy"), shape=(2,), stride=(1,))})
    path = (
        zip_file(tmp_path / "a.pt", obj) if kind == "zip" else legacy_file(tmp_path / "a.pt", obj, {"0": (2**62, b"")})
    )
    with pytest.raises(MalformedError):
        read_torch(path)
    assert peak_bytes(path) < 1 << 20


@pytest.mark.parametrize("kind", CONTAINERS)
def test_tensor_data_is_never_read(tmp_path: Path, kind: str) -> None:
    """Listing a file with 32 MiB of tensor data allocates a small fraction of it."""
    n = 8 << 20
    obj = pkl({"big": tensor(storage(numel=n, legacy=kind == "legacy"), shape=(n,), stride=(1,))})
    if kind == "zip":
        path = zip_file(tmp_path / "big.pt", obj, {"0": bytes(4 * n)})
    else:
        path = legacy_file(tmp_path / "big.pt", obj, {"0": (n, bytes(4 * n))})
    assert read_or_refuse(path) == "ok"
    assert peak_bytes(path) < 3 << 20


def test_a_directory_entry_pointing_at_another_record_is_refused(tmp_path: Path) -> None:
    # Found by the differential fuzz test against torch: data/3's entry pointing at data.pkl's header made
    # clipcli read the pickle's bytes as the tensor's values (and torch returned uninitialised memory)
    source = CORPUS / "no_byteorder.pt"
    path = tmp_path / source.name
    path.write_bytes(redirect_member(source.read_bytes(), "no_byteorder/data/3", "no_byteorder/data.pkl"))
    with pytest.raises(MalformedError, match="storage 3: bad local zip header"):
        read_torch(path)
    path.write_bytes(redirect_member(source.read_bytes(), "no_byteorder/data/3", "no_byteorder/data/2"))
    with pytest.raises(MalformedError, match="storage 3: bad local zip header"):
        read_torch(path)


# -- tensors as dict keys ----------------------------------------------------------------------------------------

# review 30 reported a file with an nn.Parameter as a dict key refused (exit 3) though torch loads it (torch's
# `optimizer.state` is keyed by the parameters): an entry whose key holds a tensor is named by its position, as
# `optimizer.state_dict()` numbers the parameters, and its key, a tensor like any other, `N.__key__` beside it.


def _read(ckpt: Any, name: str) -> np.ndarray:
    return ckpt.read(next(t for t in ckpt.tensors if t.name == name))


def _keyed(key: Any, container: str) -> Any:
    """A state dict with `key` (a tensor or Parameter of storage "0") in a dict key, a set or a tuple key."""
    w = torch_view("float32", 4, (4,), (1,))
    if container == "set":
        return {"s": PickleCall(PickleGlobal("builtins", "set"), ([key],)), "w": w}
    return PickleDict([("a", 5), (key if container == "dict" else (key, 1), 1), ("w", w)])


@pytest.mark.parametrize("container", ["dict", "tuple"])
def test_an_entry_keyed_by_a_tensor_or_parameter_is_named_by_its_position(tmp_path: Path, container: str) -> None:
    tensor = torch_view("float32", 4, (2,), (1,), offset=2)
    ordered = PickleCall(PickleGlobal("collections", "OrderedDict"), ())
    parameter = PickleCall(PickleGlobal("torch._utils", "_rebuild_parameter"), (tensor, True, ordered))
    key_name = "1.__key__" if container == "dict" else "1.__key__.0"
    for name, key in (("tensor", tensor), ("parameter", parameter)):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(torch_zip(_keyed(key, container), {"0": struct.pack("<4f", 1, 2, 3, 4)}))
        with open_checkpoint(path) as ckpt:
            assert [t.name for t in ckpt.tensors] == [key_name, "w"]
            np.testing.assert_array_equal(_read(ckpt, key_name), np.float32([3, 4]))
            np.testing.assert_array_equal(_read(ckpt, "w"), np.float32([1, 2, 3, 4]))
            expected = {"a": "5", "1": "1"} | ({"1.__key__.1": "1"} if container == "tuple" else {})
            assert ckpt.metadata == expected


def test_a_name_a_tensor_keyed_entry_shares_says_which_entries_clash(tmp_path: Path) -> None:
    """Review 31: the message showed the entry at position 0 as `[0]`, which reads as an int key."""
    path = tmp_path / "clash.pt"
    tensor = torch_view("float32", 4, (2,), (1,))
    path.write_bytes(torch_zip(PickleDict([(tensor, "a"), (0, "b")]), {"0": struct.pack("<4f", 1, 2, 3, 4)}))
    with pytest.raises(MalformedError, match=r"two entries of the pickle, \[<entry 0>\] and \[0\], flatten to"):
        read_torch(path)


def test_a_tensor_in_a_set_is_refused_for_want_of_an_order(tmp_path: Path) -> None:
    path = tmp_path / "set.pt"
    tensor = torch_view("float32", 4, (2,), (1,))
    path.write_bytes(torch_zip(_keyed(tensor, "set"), {"0": struct.pack("<4f", 1, 2, 3, 4)}))
    with pytest.raises(UnsupportedError, match="a tensor in a set has no name"):
        read_torch(path)


def test_files_torch_writes_with_a_parameter_or_a_tensor_as_a_key(tmp_path: Path) -> None:
    """torch.load loads both, and an optimizer's own `state` (a defaultdict keyed by the parameters): clipcli reads
    them, the values under the key's position and the key as `N.__key__`."""
    torch = pytest.importorskip("torch")
    for key in (torch.arange(2.0), torch.nn.Parameter(torch.arange(2.0))):
        path = tmp_path / f"{type(key).__name__}.pt"
        torch.save({"w": torch.ones(3), key: torch.full((2,), 7.0)}, path)
        assert len(torch.load(path, weights_only=True)) == 2
        with open_checkpoint(path) as ckpt:
            assert [t.name for t in ckpt.tensors] == ["w", "1", "1.__key__"]
            np.testing.assert_array_equal(_read(ckpt, "1"), np.float32([7, 7]))
            np.testing.assert_array_equal(_read(ckpt, "1.__key__"), np.float32([0, 1]))
    params = [torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    path = tmp_path / "optimizer_state.pt"
    torch.save(opt.state, path)
    numbered = opt.state_dict()["state"]  # torch's own numbering of the same state
    with open_checkpoint(path) as ckpt:
        names = {t.name for t in ckpt.tensors}
        for i, p in enumerate(params):
            for k, v in numbered[i].items():
                np.testing.assert_array_equal(_read(ckpt, f"{i}.{k}"), v.numpy())
            np.testing.assert_array_equal(_read(ckpt, f"{i}.__key__"), p.detach().numpy())
        assert names == {f"{i}.{k}" for i in numbered for k in numbered[i]} | {"0.__key__", "1.__key__"}
