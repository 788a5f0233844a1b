"""Writes the PyTorch test corpus with real torch, and beside each file what torch itself reads from it.

Run with an interpreter that has torch (the tests never need it):

    /work/torchenv/bin/python tests/data/torch/make_torch_files.py [FILE ...]

Naming files writes only those (`distcp`: the distributed checkpoint; `sharded_bin`: Hugging Face PyTorch
shards, which needs huggingface_hub too; `inert`, `script`: those folders); the JSON beside every file is
rewritten either way. The zip files come out the same byte for byte each time; the legacy ones and the
distributed checkpoint do not (storage keys are memory addresses; the metadata holds a save id).

For every file `X` it writes `X.json`: the tensors as `torch.load(weights_only=True)` returns them,
flattened to dotted names by the rules clipcli documents (dict keys, list/tuple indices, a bare tensor
named after the file's stem), with per tensor its dtype, shape, the SHA-256 of its C-order bytes as
torch gives them, and its 2-norm in float64 (the square root of `math.fsum` of the squared values);
the groups of names that share a storage; the non-tensor leaves (metadata) as clipcli renders them;
and the tensors clipcli must list but skip (sparse, quantized, meta, nested, no NumPy dtype).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import math
import pickle
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
warnings.filterwarnings("ignore")


class TinyModel(torch.nn.Module):
    """A model whose state dict holds every dtype clipcli reads, a 0-d and an empty tensor."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)  # num_batches_tracked: a 0-d int64
        self.emb = torch.nn.Embedding(5, 2).to(torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        for name, dtype in [
            ("f16", torch.float16),
            ("f64", torch.float64),
            ("f8_e4m3fn", torch.float8_e4m3fn),
            ("f8_e5m2", torch.float8_e5m2),
            ("f8_e4m3fnuz", torch.float8_e4m3fnuz),
            ("f8_e5m2fnuz", torch.float8_e5m2fnuz),
        ]:
            self.register_buffer(name, (torch.randn(2, 3, generator=g) * 4).to(dtype))
        self.register_buffer("cplx", torch.randn(3, dtype=torch.complex64, generator=g))
        self.register_buffer("cplx128", torch.randn(2, dtype=torch.complex128, generator=g))
        self.register_buffer("ids", torch.arange(-3, 4, dtype=torch.int64))
        self.register_buffer("i32", torch.arange(5, dtype=torch.int32) * 1000)
        self.register_buffer("i16", torch.tensor([-7, 300], dtype=torch.int16))
        self.register_buffer("i8", torch.tensor([-128, 127, 3], dtype=torch.int8))
        self.register_buffer("u16", torch.tensor([1, 65535], dtype=torch.uint16))
        self.register_buffer("u32", torch.tensor([7, 2**32 - 1], dtype=torch.uint32))
        self.register_buffer("u64", torch.tensor([9, 2**40], dtype=torch.uint64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("pixels", torch.tensor([[0, 255], [17, 3]], dtype=torch.uint8))
        self.register_buffer("scalar", torch.tensor(2.5))
        self.register_buffer("empty", torch.zeros(0, 3))


# dtypes torch.save writes through an UntypedStorage (torch._utils._rebuild_tensor_v3)
UNTYPED = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
UNTYPED += (torch.uint16, torch.uint32, torch.uint64)


def model_state(untyped: bool = True) -> dict:
    torch.manual_seed(0)
    model = TinyModel()
    model.norm(torch.randn(8, 3))  # running stats and a counter that moved
    state = model.state_dict()
    if not untyped:
        for name in [name for name, t in state.items() if t.dtype in UNTYPED]:
            del state[name]
    return state


def legacy_untyped() -> dict:
    """Tensors whose legacy files torch 2.x itself cannot load (its legacy loader wants a typed storage)."""
    torch.manual_seed(6)
    return {
        "f8": torch.randn(5).to(torch.float8_e4m3fn),
        "u16": torch.tensor([3, 60000], dtype=torch.uint16),
        "f32": torch.randn(2),
    }


def float8() -> dict:
    """Every float8 type torch saves, each with a transposed and a strided view (read through strides), and a
    packed type that neither NumPy nor ml_dtypes holds."""
    torch.manual_seed(7)
    out = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        out[str(dtype).removeprefix("torch.")] = (torch.randn(3, 4) * 4).to(dtype)
    out["float8_e8m0fnu"] = torch.rand(3, 4).mul(8).add(0.1).to(torch.float8_e8m0fnu)  # no sign, no zero
    for name, m in list(out.items()):
        out[f"{name}_t"] = m.t()
        out[f"{name}_step"] = m.reshape(-1)[1::3]
    out["packed"] = torch.tensor([0x12, 0x34], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    return out


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight


class TiedLM(torch.nn.Module):
    """A small language model whose output layer is its embedding (tied), with an untied layer between."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def tied_model_with_grads() -> TiedLM:
    torch.manual_seed(5)
    model = TiedLM()
    tokens = torch.randint(0, 8, (6,))
    model.head(torch.tanh(model.mid(model.emb(tokens)))).logsumexp(-1).sum().backward()
    return model


def tied_grads() -> dict:
    """Every parameter name's gradient, tied names included (one tensor: one storage in the file)."""
    return {name: p.grad for name, p in tied_model_with_grads().named_parameters(remove_duplicate=False)}


def tied_clip_reference(max_norm: float = 1.0) -> dict:
    """What torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) gives for tied_grads.pt's gradients:
    the total norm it returns (computed in float32) and the gradients before and after, by name; and the same
    norm summed exactly in float64 over the parameters it iterates (each tied parameter once)."""
    model = tied_model_with_grads()
    before = {name: p.grad.reshape(-1).tolist() for name, p in model.named_parameters(remove_duplicate=False)}
    unique = [p.grad.double().reshape(-1).tolist() for p in model.parameters()]
    exact = math.sqrt(math.fsum(v * v for values in unique for v in values))
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    after = {name: p.grad.reshape(-1).tolist() for name, p in model.named_parameters(remove_duplicate=False)}
    return {"max_norm": max_norm, "total_norm": float(total), "exact_norm": exact, "before": before, "after": after}


def views() -> dict:
    torch.manual_seed(2)
    base = torch.randn(10)
    matrix = torch.randn(3, 4)
    return {
        "base": base,
        "slice": base[2:5],  # storage offset 2
        "strided": base[1::3],  # stride 3
        "matrix": matrix,
        "transposed": matrix.t(),  # non-contiguous
        "column": matrix[:, 1],
        "expanded": torch.randn(1, 3).expand(2, 3),  # stride 0
    }


def parameters() -> dict:
    torch.manual_seed(3)
    tagged = torch.randn(2, 2)
    tagged.note = "a Python attribute"  # saved through torch._tensor._rebuild_from_type_v2
    param_with_state = torch.nn.Parameter(torch.randn(3))
    param_with_state.tag = 7  # saved through torch._utils._rebuild_parameter_with_state
    return {
        "weight": torch.nn.Parameter(torch.randn(2, 3)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "tagged": tagged,
        "param_with_state": param_with_state,
    }


def kept_types() -> dict:
    """Values of the types torch's weights-only unpickler allows, which a .pt written by clipcli gives back as such
    (gh-24: a layout and a quantization scheme were refused, a torch.Size came back a tuple, a Parameter a Tensor)."""
    torch.manual_seed(5)
    return {
        "weight": torch.nn.Parameter(torch.randn(2, 3)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "buffer": torch.randn(3),
        "layout": torch.strided,
        "sparse_layout": torch.sparse_coo,
        "qscheme": torch.per_channel_affine,
        "size": torch.Size([2, 3]),
        "empty_size": torch.Size([]),
        "counts": collections.Counter("abbccc"),
        "members": {3, 1, 2},
        "by_pair": {(1, "a"): 3, (2, "b"): (4.5, None)},
        "pair": (1, "a", 2.5),
    }


def nested() -> dict:
    torch.manual_seed(4)
    return {
        "layers": [{"w": torch.randn(2, 2), "b": torch.randn(2)}, {"w": torch.randn(2, 2), "b": torch.zeros(2)}],
        "pair": (torch.arange(3.0), [torch.ones(1), 5]),
        "config": {
            "lr": 0.1,
            "name": "tiny",
            "flag": True,
            "nothing": None,
            "sizes": (1, 2),
            "empty": {},
            "no_items": [],
            "by_int": {1: torch.full((2,), 3.0), 2: "two"},
            "by_tuple": {(1, "a"): 4},
            "by_none": {None: 1.5},
            # values that protocol 2 writes through globals: builtins.set, _codecs.encode, torch.device, ...
            "device": torch.device("cuda", 0),
            "dtype": torch.float16,
            "ids": {3, 1, 2},
            "raw": b"\x00\xffab",
            "buffer": bytearray(b"xy"),
            "z": 1 - 2j,
        },
    }


def special() -> dict:
    torch.manual_seed(5)
    x = torch.randn(3, dtype=torch.complex64)
    return {
        "dense": torch.randn(2),
        "sparse_coo": torch.randn(3, 3).relu().to_sparse(),
        "sparse_csr": torch.eye(3).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.randn(4), 0.1, 10, torch.qint8),
        "quantized_channel": torch.quantize_per_channel(
            torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8
        ),
        "meta": torch.empty(3, 4, device="meta"),
        "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        "half_complex": torch.randn(2, dtype=torch.complex64).to(torch.complex32),
        "conjugate": x.conj(),
        "negative": torch.randn(2, dtype=torch.complex64).conj().imag,  # its own storage: one dtype each
    }


def lightning(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.2.0",
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [],
        "hparams": {"hidden": 3, "dropout": 0.0, "betas": (0.9, 0.999)},
    }


# -- inert/: files whose pickles name globals beyond torch's allowlist (issue 24) ------------------------

GONE = "clipcli_gone_project.config"  # a project's module that no longer exists where the files are read
SENTINEL = "clipcli-pwned"  # what a hostile file's payload creates in the current directory


def gone_module():
    """A module of project-defined classes, registered only while the files are written."""
    import enum
    import types

    module = types.ModuleType(GONE)

    class TrainConfig:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class Color(enum.Enum):
        RED = 1
        BLUE = 2

    class Slotted:
        __slots__ = ("bias", "scale")

        def __init__(self, scale, bias):
            self.scale, self.bias = scale, bias

    for cls in (TrainConfig, Color, Slotted):
        cls.__module__ = GONE
        cls.__qualname__ = cls.__name__
        setattr(module, cls.__name__, cls)
    sys.modules[GONE] = module
    sys.modules[GONE.split(".")[0]] = types.ModuleType(GONE.split(".")[0])
    return module


def namespace() -> dict:
    import argparse

    torch.manual_seed(6)
    inner = argparse.Namespace(seed=1, mask=torch.tensor([True, False]))
    args = argparse.Namespace(lr=3e-4, layers=2, arch="tiny", betas=(0.9, 0.95), init=torch.randn(2), sub=inner)
    return {"model": {"w": torch.randn(3, 2), "b": torch.randn(2)}, "args": args, "iteration": 10}


def objects() -> dict:
    import datetime
    import pathlib

    gone = gone_module()
    torch.manual_seed(7)
    config = gone.TrainConfig(
        lr=0.1,
        head=torch.randn(2, 2),
        nested=gone.TrainConfig(w=torch.randn(3), depth=2),
        color=gone.Color.BLUE,
        root=pathlib.PurePosixPath("/data/run1"),
        path=pathlib.PosixPath("ckpt/last.pt"),
        when=datetime.datetime(2026, 1, 2, 3, 4, 5),
        day=datetime.date(2026, 1, 2),
        took=datetime.timedelta(seconds=90),
    )
    return {
        "config": config,
        "slots": gone.Slotted(torch.randn(2), 0.5),
        "by_color": {gone.Color.RED: "warm"},
        "weights": {"w": torch.randn(2, 2)},
    }


def numpy_config() -> dict:
    torch.manual_seed(8)
    return {
        "w": torch.randn(2, 3),
        "config": {
            "mean": np.array([0.5, 0.25], np.float32),
            "ids": np.arange(5),
            "grid": np.arange(6.0).reshape(2, 3) / 7,
            "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
            "big": np.arange(3, dtype=">f8") / 3,
            "half": np.array([1.5, -2.25], np.float16),
            "flags": np.array([True, False]),
            "cplx": np.array([1 + 2j], np.complex64),
            "empty": np.zeros((0, 3)),
            "scalar": np.float64(0.125),
            "count": np.int64(7),
            "on": np.bool_(True),
            "f32": np.float32(1.5),
            "words": np.array(["a", "bc"]),
            "objects": np.array([{"k": 1}, None], dtype=object),
        },
    }


def rng_state() -> dict:
    """What Hugging Face Trainer's rng_state.pth holds."""
    import random

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }


class Reduces:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def hostile() -> dict:
    import functools
    import importlib
    import os
    import posix
    import subprocess

    code = f"open({SENTINEL!r}, 'w').close()"
    return {
        "w": torch.ones(2),
        "os_system": Reduces(os.system, f"touch {SENTINEL}"),
        "posix_system": Reduces(posix.system, f"touch {SENTINEL}"),
        "eval": Reduces(eval, code),
        "exec": Reduces(exec, code),
        "popen": Reduces(subprocess.Popen, ["touch", SENTINEL]),
        "import_module": Reduces(importlib.import_module, "antigravity"),
        "partial": Reduces(functools.partial(os.system, f"touch {SENTINEL}")),
    }


def walk_objects(obj, stem: str) -> list[tuple[str, object]]:
    """Tensors and numeric NumPy arrays by clipcli's names: containers as `flatten`, an object's attributes
    (`__dict__`, slots) below its name."""
    out = []

    def name_of(k):
        try:
            return k if isinstance(k, str) else literal(k, 0)
        except TypeError:  # an object as a key (an enum member): no tensor lies below a key
            return "?"

    def walk(name, value):
        join = (lambda part: part) if name is None else (lambda part: f"{name}.{part}")
        if isinstance(value, (torch.Tensor, np.ndarray)):
            if not isinstance(value, np.ndarray) or value.dtype.kind in "biufc":
                out.append((stem if name is None else name, value))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(join(name_of(k)), v)
        elif type(value) in (list, tuple):
            for i, v in enumerate(value):
                walk(join(str(i)), v)
        elif not isinstance(value, type) and hasattr(value, "__dict__") and type(value).__module__ != "pathlib":
            walk(name, vars(value))
        elif hasattr(type(value), "__slots__") and type(value).__module__ == GONE:
            walk(name, {k: getattr(value, k) for k in type(value).__slots__})

    walk(None, obj)
    return out


def expected_inert(obj, stem: str) -> dict:
    tensors = []
    for name, value in walk_objects(obj, stem):
        if isinstance(value, torch.Tensor):
            data = value.detach().contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
            dtype, values = str(value.dtype).removeprefix("torch."), value
            n = norm(values)
        else:
            native = np.ascontiguousarray(value, value.dtype.newbyteorder("="))
            raw, dtype = native.tobytes(), native.dtype.name
            n = norm(torch.from_numpy(native.copy()))
        tensors.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(value.shape),
                "sha256": hashlib.sha256(raw).hexdigest(),
                "norm": n,
            }
        )
    return {"tensors": tensors}


def inert_files() -> None:
    """inert/: each kind in the zip and legacy formats (NumPy also with protocol 4), its tensors by torch and
    NumPy beside it; the hostile files' JSON holds what their payloads would call."""
    folder = HERE / "inert"
    folder.mkdir(exist_ok=True)
    kinds = {"namespace": namespace, "objects": objects, "numpy": numpy_config, "rng_state": rng_state}
    for stem, make in kinds.items():
        forms = {f"{stem}.pt": {}, f"{stem}_legacy.pt": {"_use_new_zipfile_serialization": False}}
        if stem == "numpy":
            forms["numpy_protocol4.pt"] = {"pickle_protocol": 4}
            forms["numpy_protocol5.pt"] = {"pickle_protocol": 5}
        for name, options in forms.items():
            obj = make()
            torch.save(obj, folder / name, **options)
            text = json.dumps(expected_inert(obj, Path(name).stem), indent=1, sort_keys=True) + "\n"
            (folder / (name + ".json")).write_text(text)
    sys.modules.pop(GONE, None)
    sys.modules.pop(GONE.split(".")[0], None)
    for name, options in {"hostile.pt": {}, "hostile_legacy.pt": {"_use_new_zipfile_serialization": False}}.items():
        torch.save(hostile(), folder / name, **options)


# -- script/: TorchScript archives (torch.jit.save; issue 24 item 3) ------------------------------------------


class Block(torch.nn.Module):
    """A module whose attributes are of every kind: parameters, buffers (BatchNorm's running stats, a bfloat16
    and a non-persistent one), a Linear without bias, a plain tensor attribute, a dict, a list, a flag."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(3, 2, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 2, 3).to(torch.bfloat16))
        self.register_buffer("steps", torch.arange(4, dtype=torch.int32))
        self.register_buffer("cache", torch.ones(2), persistent=False)  # TorchScript keeps it in state_dict()
        self.offset = torch.tensor([0.25, -0.5])  # neither parameter nor buffer: not in state_dict()
        self.sizes: dict[str, int] = {"in": 4, "out": 2}
        self.widths: list[int] = [4, 3, 2]
        self.verbose = False

    def forward(self, x):
        y = self.norm(self.proj(x)) * self.scale.float()
        return self.head(y) + self.offset + self.cache.sum() + self.steps.sum()


class Nested(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.ModuleDict({"first": Block(), "second": Block()})
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.gain = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x):
        return self.encoder["second"](x) * self.gain + self.encoder["first"](x)


class Traced(torch.nn.Module):
    """Traced, its tensor attribute and the tensors its forward makes become constants (CONSTANTS.c0, ...)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.bias2 = torch.randn(3)

    def forward(self, x):
        return self.lin(x) * self.bias2 + torch.arange(3.0)


class Shapes(pickle.Unpickler):
    """The shape of a pickle this script just wrote: every global a function giving None, no storage loaded."""

    def find_class(self, module, name):
        return lambda *args: None

    def persistent_load(self, pid):
        return None


class TiedScript(Tied):
    def forward(self, ids):
        return self.head(self.emb(ids))


def script_reference(path: Path) -> dict:
    """What torch.jit.load reads: its state_dict(), the constants the root's code uses as CONSTANTS.cN (the
    archive's whole table: checked), and torch.load(weights_only=True)'s verdict."""
    loaded = torch.jit.load(path)
    _, constants = loaded.code_with_constants
    table = dict(constants.const_mapping)
    with zipfile.ZipFile(path) as z:
        records = [n.split("/", 1)[1] for n in z.namelist()]
        held = Shapes(io.BytesIO(z.read(next(n for n in z.namelist() if n.endswith("/constants.pkl"))))).load()
    assert len(held) == len(table) if "constants.pkl" in records else not table, (path, len(table))
    obj = dict(loaded.state_dict())
    obj.update({f"CONSTANTS.{k}": v for k, v in table.items()})
    result = expected(obj, path.stem)
    try:
        torch.load(path, weights_only=True)
        result["loads_with_weights_only"] = True
    except RuntimeError:
        result["loads_with_weights_only"] = False
    result["torch_load"] = "torch.jit.load"
    return result


def script_files() -> None:
    """script/: TorchScript archives under the names they go by (.pt, .jit, .ptl), with what torch.jit.load
    reads from each; and a mobile flatbuffer (.ff), which clipcli refuses."""
    folder = HERE / "script"
    folder.mkdir(exist_ok=True)
    torch.manual_seed(11)
    sequential = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    torch.jit.save(torch.jit.script(sequential), folder / "sequential.pt")
    nested = Nested()
    for block in nested.encoder.values():  # running statistics that moved
        block.norm(torch.randn(6, 3))
    torch.jit.save(torch.jit.script(nested), folder / "nested.pt")
    traced = torch.jit.trace(Traced(), torch.randn(2, 3))
    torch.jit.save(traced, folder / "traced.jit")
    tied = torch.jit.script(TiedScript())
    tied._save_for_lite_interpreter(str(folder / "tied.ptl"))  # a zip: bytecode.pkl beside the same records
    tied._save_for_lite_interpreter(str(folder / "mobile.ff"), _use_flatbuffer=True)
    for path in sorted(folder.iterdir()):
        if path.suffix in (".pt", ".jit", ".ptl"):
            text = json.dumps(script_reference(path), indent=1, sort_keys=True) + "\n"
            path.with_name(path.name + ".json").write_text(text)


# -- what torch reads, flattened by clipcli's rules -------------------------------------------------


def literal(value, depth: int) -> str:
    if isinstance(value, str):
        return repr(value) if depth else value
    if isinstance(value, bool) or value is None or isinstance(value, (float, complex, bytes)):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, tuple):
        items = [literal(v, depth + 1) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, (torch.dtype, torch.layout, torch.qscheme)):
        return str(value)
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, bytearray):  # clipcli keeps it as bytes
        return repr(bytes(value))
    if isinstance(value, (set, frozenset)):
        items = sorted(literal(v, depth + 1) for v in value)
        if not items:
            return "set()" if isinstance(value, set) else "frozenset()"
        text = "{" + ", ".join(items) + "}"
        return text if isinstance(value, set) else f"frozenset({text})"
    raise TypeError(f"no rendering for {type(value)}")


def flatten(obj, stem: str) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []

    def walk(name, value, top):
        if isinstance(value, dict) and (value or top):
            for k, v in value.items():
                walk(join(name, k if isinstance(k, str) else literal(k, 0)), v, False)
        elif type(value) in (list, tuple, torch.Size) and (value or top):
            for i, v in enumerate(value):
                walk(join(name, str(i)), v, False)
        else:
            out.append((stem if name is None else name, value))

    def join(prefix, part):
        return part if prefix is None else f"{prefix}.{part}"

    walk(None, obj, True)
    return out


SKIP_KINDS = [
    ("sparse", lambda t: t.layout != torch.strided),
    ("meta", lambda t: t.device.type == "meta"),
    ("nested", lambda t: t.is_nested),
    ("quantized", lambda t: t.is_quantized),
    ("conjugate", lambda t: t.is_conj()),
    ("negative", lambda t: t.is_neg()),
    ("no NumPy type", lambda t: t.dtype in (torch.complex32, torch.float4_e2m1fn_x2)),
]


def norm(t: torch.Tensor) -> float:
    values = t.detach().reshape(-1)
    if values.is_complex():
        values = torch.view_as_real(values.to(torch.complex128)).reshape(-1)
    squares = [v * v for v in values.to(torch.float64).tolist()]  # one IEEE product each, as NumPy squares
    return math.sqrt(math.fsum(squares))


def expected(obj, stem: str) -> dict:
    tensors, skipped, metadata, storages = [], [], {}, collections.defaultdict(list)
    for name, value in flatten(obj, stem):
        if isinstance(value, torch.Tensor):
            reason = next((k for k, test in SKIP_KINDS if test(value)), None)
            if reason is not None:
                skipped.append(
                    {"name": name, "reason": reason, "shape": None if value.is_nested else list(value.shape)}
                )
                continue
            data = value.detach().contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
            tensors.append(
                {
                    "name": name,
                    "dtype": str(value.dtype).removeprefix("torch."),
                    "shape": list(value.shape),
                    "sha256": hashlib.sha256(raw).hexdigest(),
                    "norm": norm(value),
                }
            )
            storages[value.untyped_storage().data_ptr()].append(name)
        else:
            metadata[name] = "{}" if isinstance(value, dict) else "[]" if isinstance(value, list) else literal(value, 0)
    return {
        "tensors": tensors,
        "skipped": skipped,
        "metadata": metadata,
        "shared": sorted(names for names in storages.values() if len(names) > 1),
    }


def big_endian_copy(src: Path, dst: Path) -> None:
    """The same archive written by torch's own writer, its storages byteswapped and marked big-endian."""
    reader = torch._C.PyTorchFileReader(str(src))
    dtypes = {}

    class Ids(pickle.Unpickler):
        def find_class(self, module, name):
            return f"{module}.{name}" if name.endswith("Storage") else (lambda *a, **k: None)

        def persistent_load(self, pid):
            dtypes[pid[2]] = getattr(torch, pid[1].split(".")[-1]).dtype
            return None

    Ids(io.BytesIO(reader.get_record("data.pkl"))).load()
    writer = torch._C.PyTorchFileWriter(str(dst))
    for record in reader.get_all_records():
        data = reader.get_record(record)
        if record == "byteorder":
            data = b"big"
        elif record.startswith("data/"):
            size = torch.empty((), dtype=dtypes[record[5:]]).element_size()
            data = np.frombuffer(data, f"<u{size}").byteswap().tobytes() if size > 1 else data
        writer.write_record(record, data, len(data))
    writer.write_end_of_file()


def distributed_checkpoint() -> None:
    """A torch.distributed.checkpoint directory, and per tensor the byte range its .metadata gives it."""
    import os

    import torch.distributed.checkpoint as dcp

    torch.manual_seed(7)
    state = {"w": torch.randn(3, 2), "opt": {"step": 3, "m": torch.zeros(2, dtype=torch.bfloat16)}}
    cwd = os.getcwd()
    os.chdir(HERE)  # the metadata records the path it was given
    try:
        dcp.save(state, checkpoint_id="distcp")
    finally:
        os.chdir(cwd)
    metadata = dcp.FileSystemReader(HERE / "distcp").read_metadata()
    flat = {"w": state["w"], "opt.step": state["opt"]["step"], "opt.m": state["opt"]["m"]}
    regions = []
    for index, info in metadata.storage_data.items():
        region = {"fqn": index.fqn, "file": info.relative_path, "offset": info.offset, "length": info.length}
        value = flat[index.fqn]
        if isinstance(value, torch.Tensor):
            region["sha256"] = hashlib.sha256(value.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        else:
            region["value"] = literal(value, 0)
        regions.append(region)
    regions.sort(key=lambda r: r["offset"])
    text = json.dumps({"regions": regions}, indent=1, sort_keys=True) + "\n"
    (HERE / "distcp.json").write_text(text)


def sharded_bin() -> None:
    """Hugging Face's PyTorch shards (`pytorch_model-0000K-of-0000N.bin` and `pytorch_model.bin.index.json`),
    written by huggingface_hub's writer (what transformers' `save_pretrained(safe_serialization=False)` used),
    and in `sharded_bin.json` what torch reads from the shards together. Storage keys repeat from shard to
    shard; a tied pair shares a shard."""
    import shutil

    from huggingface_hub import save_torch_state_dict

    state = {k: v for k, v in model_state().items() if not v.is_complex()}  # all of it writable as safetensors
    torch.manual_seed(5)
    state.update({f"tied.{k}": v for k, v in Tied().state_dict().items()})
    out = HERE / "sharded_bin"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    save_torch_state_dict(state, out, safe_serialization=False, max_shard_size=400)
    merged = {}
    for shard in sorted(out.glob("*.bin")):
        merged.update(torch.load(shard, weights_only=True))
    result = expected(merged, "sharded_bin")
    (HERE / "sharded_bin.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


def main() -> None:
    model, opt = trained()
    files = {
        "model_state.pt": (model_state(), {}),
        "model_state_legacy.pt": (model_state(untyped=False), {"_use_new_zipfile_serialization": False}),
        "untyped_legacy.pt": (legacy_untyped(), {"_use_new_zipfile_serialization": False}),
        "grads.pt": ([p.grad for p in model.parameters()], {}),
        "adam.pt": (opt.state_dict(), {}),
        "adam_legacy.pt": (opt.state_dict(), {"_use_new_zipfile_serialization": False}),
        "tied.pt": (Tied().state_dict(), {}),
        "tied_grads.pt": (tied_grads(), {}),
        "views.pt": (views(), {}),
        "parameter.pth": (parameters(), {}),
        "single.pt": (torch.linspace(-1, 1, 7), {}),
        "nested.pt": (nested(), {}),
        "kept_types.pt": (kept_types(), {}),
        "metadata_only.pt": ({"lr": 0.1, "step": 5}, {}),
        "nested_legacy.pt": (nested(), {"_use_new_zipfile_serialization": False}),
        "special.pt": (special(), {}),
        "pytorch_model.bin": (model.state_dict(), {}),
        "lightning.ckpt": (lightning(model, opt), {}),
        "protocol5.pt": (views(), {"pickle_protocol": 5}),
        "float8.pt": (float8(), {}),
        "no_byteorder.pt": (model.state_dict(), {"_disable_byteorder_record": True}),
    }
    only = sys.argv[1:]  # names to write, e.g. to keep the legacy files (their storage keys are addresses)
    for name, (obj, options) in files.items():
        if not only or name in only:
            torch.save(obj, HERE / name, **options)
    if not only or "no_crc32.pt" in only:  # torch's option to skip the CRC-32s: it records each as 0
        from torch.utils.serialization import config

        config.save.compute_crc32 = False
        try:
            torch.save(model.state_dict(), HERE / "no_crc32.pt")
        finally:
            config.save.compute_crc32 = True
    big = {"weight": torch.randn(3, 2), "half": torch.randn(4).half(), "bf16": torch.randn(3).bfloat16()}
    big.update({"ids": torch.arange(4), "cplx": torch.randn(2, dtype=torch.complex64), "f64": torch.randn(2).double()})
    torch.save(big, HERE / "little.pt")
    big_endian_copy(HERE / "little.pt", HERE / "big_endian.pt")
    (HERE / "little.pt").unlink()
    if not only or "tied_grads.pt" in only:
        text = json.dumps(tied_clip_reference(), indent=1, sort_keys=True) + "\n"
        (HERE / "tied_grads.clip.json").write_text(text)
    if not only or "distcp" in only:  # its .metadata differs each time (a save id)
        distributed_checkpoint()
    if not only or "sharded_bin" in only:
        sharded_bin()
    if not only or "inert" in only:
        inert_files()
    if not only or "script" in only:
        script_files()
    for path in sorted(HERE.iterdir()):
        if path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
            # torch's weights-only unpickler knows no FRAME opcode (protocol 4+); these files are our own
            weights_only = "protocol" not in path.name
            if path.name == "untyped_legacy.pt":  # torch cannot load it back: what it saved is what it would read
                loaded, weights_only = legacy_untyped(), None
            else:
                loaded = torch.load(path, weights_only=weights_only)
            result = expected(loaded, path.stem)
            result["torch_load"] = {None: "fails", True: "weights_only", False: "unrestricted"}[weights_only]
            text = json.dumps(result, indent=1, sort_keys=True) + "\n"
            path.with_name(path.name + ".json").write_text(text)
    total = sum(p.stat().st_size for p in HERE.iterdir() if p.is_file())
    print(f"corpus: {total} bytes with the JSON, torch {torch.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
