"""Writes the distributed-checkpoint test corpus with real torch, and beside each what torch reads from it.

Run with an interpreter that has torch (the tests never need it); it starts two local processes for each
sharded checkpoint (gloo on 127.0.0.1, CPU only; each pair is killed after a minute) and takes ~20 s:

    /work/torchenv/bin/python tests/data/dcp/make_dcp.py

Checkpoints (directories), each with `<name>.json` beside it:

- `single/`: one process, no process group: a small model's state dict in bfloat16, float32 and float16,
  an Adam optimizer's state (0-d float32 `step` tensors, `param_groups` items), an int `step`, a string,
  a 0-d tensor, int64, float8, an empty tensor, a transposed and a channels_last tensor (torch writes
  both chunks as strided views), complex32 (no NumPy type), and a tuple of tensors (kept whole in one
  non-tensor item).
- `sharded/`: two processes: DTensors `Shard(0)` (rows, uneven: 5 rows on 2 ranks), `Shard(0)` of one
  row (the second rank's chunk is empty), `Shard(1)` (columns, bfloat16), `Replicate()` and a plain
  tensor both ranks hold (each written once: deduplicated), and an FSDP2 (`fully_shard`) model with its
  Adam state from `get_state_dict`.
- `megatron/` and `megatron_mcore015/`: what Megatron-Core's `torch_dist` format writes, made here without
  Megatron: torch `ShardedTensor`s (layers stacked on a prepended axis, tensor-parallel rows), sharded
  objects saved as lists in non-tensor items (`rng_state/shard_0_2`), two files per rank, the local save
  plans kept in `.metadata` (`all_local_plans`), `metadata.json` and `common.pt`. The second is written
  through stand-ins for Megatron-Core 0.15's classes (`MCoreMetadata`, `MCoreSavePlan`), named as
  Megatron names them.
- `items/`: one process: non-tensor items of every kind (NumPy scalars, a NumPy array, `bytes`, an
  `io.BytesIO`, an `argparse.Namespace` holding a tensor, an int) beside plain tensors; `items.json` holds
  its tensors as torch reads them and its items, plain ones rendered as clipcli renders them, others by
  class (`make_dcp.py items` writes this one alone).
- `safetensors_format/`: DCP's `SerializationFormat.SAFETENSORS` (clipcli refuses it).

The JSON holds, for every fully qualified name of `.metadata`, what torch reads after consolidating
the checkpoint (`format_utils.dcp_to_torch_save`, then `torch.load`): per tensor its dtype, global shape,
the SHA-256 of its C-order bytes and its 2-norm in float64 (the square root of `math.fsum` of the
squared values), and the chunks `.metadata` lists (offsets, sizes); the non-tensor items flattened to
dotted names and rendered as clipcli renders the leaves of a torch.save file; the skipped tensors.

`malformed/` holds `.metadata` files edited by torch's own pickling (each read with the files of
`sharded/`): overlapping chunks, a hole, a chunk missing from storage_data, a path with `..`, an
absolute path, a dtype the chunks do not hold, a storage transform, an unknown metadata version.
`foreign/` holds `.metadata` files (read the same way) that name globals beyond DCP's own: a call of
`os.system` in `storage_meta.modules` (never to be run) and an `argparse.Namespace` as `planner_data`
(`make_dcp.py foreign` writes these alone).

`.metadata` holds a random save id, so the files differ from run to run; the tensors do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import pickle
import shutil
import socket
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
warnings.filterwarnings("ignore")

MEGATRON_STANDIN = '''
"""Stand-ins for the classes Megatron-Core 0.15 pickles into .metadata (same module, same names)."""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan


@dataclass
class MCoreMetadata(Metadata):
    mcore_data: Dict[str, Dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None
'''


# -- what torch reads ------------------------------------------------------------------------------


def literal(value, depth: int) -> str:
    """A leaf as clipcli renders it (a Python literal; strings bare at the top)."""
    if isinstance(value, str):
        return repr(value) if depth else value
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, complex, bytes)):
        return repr(value)
    if isinstance(value, tuple):
        items = [literal(v, depth + 1) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, torch.dtype):
        return str(value)
    raise TypeError(f"no rendering for {type(value)}")


def norm(t: torch.Tensor) -> float:
    values = t.detach().reshape(-1)
    if values.is_complex():
        values = torch.view_as_real(values.to(torch.complex128)).reshape(-1)
    squares = [v * v for v in values.to(torch.float64).tolist()]  # one IEEE product each, as NumPy squares
    return math.sqrt(math.fsum(squares))


def tensor_entry(name: str, t: torch.Tensor) -> dict:
    data = t.detach().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return {
        "name": name,
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "norm": norm(data),
    }


def flatten_item(name: str, value, out: list) -> None:
    """A non-tensor item's leaves under dotted names, as clipcli flattens the object a torch.save file holds."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            flatten_item(f"{name}.{k if isinstance(k, str) else literal(k, 0)}", v, out)
    elif type(value) in (list, tuple) and value:
        for i, v in enumerate(value):
            flatten_item(f"{name}.{i}", v, out)
    else:
        out.append((name, value))


def expected(directory: Path) -> dict:
    """What torch reads from a checkpoint, by the names of its .metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(directory).read_metadata()
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(directory, Path(tmp) / "whole.pt")
        whole = torch.load(Path(tmp) / "whole.pt", weights_only=False)
    paths = metadata.planner_data or {}
    tensors, skipped, items = [], [], {}
    for fqn, md in metadata.state_dict_metadata.items():
        value = whole
        for key in paths.get(fqn, (fqn,)):
            value = value[key]
        leaves: list = []
        if isinstance(md, BytesStorageMetadata):
            flatten_item(fqn, value, leaves)
        else:
            leaves.append((fqn, value))
        for name, leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                items[name] = {dict: "{}", list: "[]"}.get(type(leaf)) or literal(leaf, 0)
            elif leaf.dtype == torch.complex32:
                skipped.append({"name": name, "dtype": "complex32", "shape": list(leaf.shape)})
            else:
                entry = tensor_entry(name, leaf)
                if name == fqn:
                    entry["chunks"] = [[list(c.offsets), list(c.sizes)] for c in md.chunks]
                tensors.append(entry)
    return {"tensors": tensors, "skipped": skipped, "metadata": items}


def write_expected(directory: Path) -> None:
    text = json.dumps(expected(directory), indent=1, sort_keys=True) + "\n"
    directory.with_name(directory.name + ".json").write_text(text)


# -- one process ------------------------------------------------------------------------------------


def single(out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[1].to(torch.bfloat16)
    head = torch.nn.Linear(3, 2).half()
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-3)
    model[0](torch.randn(5, 4)).square().sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "head": head.state_dict(),
        "optim": opt.state_dict(),
        "step": 7,
        "run": "demo-1",
        "loss_scale": torch.tensor(65536.0),
        "ids": torch.arange(-2, 4),
        "f8": (torch.randn(4) * 3).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(3, 4).t(),
        "channels_last": torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last),
        "c32": torch.randn(2, dtype=torch.complex64).to(torch.complex32),
        "pair": (torch.tensor([1.5, -2.0]), torch.arange(3, dtype=torch.int32)),
    }
    dcp.save(state, checkpoint_id=out)


def items(out: Path) -> None:
    """Non-tensor items of every kind beside plain tensors, one process: NumPy scalars and an array, `bytes`, an
    `io.BytesIO`, an `argparse.Namespace` holding a tensor, an int."""
    import io

    import numpy as np
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(24)
    state = {
        "model": {"w": torch.randn(4, 3), "b": torch.randn(3, dtype=torch.float64)},
        "np_scalar": np.float32(0.5),
        "np_int": np.int64(7),
        "np_array": np.arange(6.0).reshape(2, 3) - 2.5,
        "blob": b"\x00\x01 bytes",
        "stream": io.BytesIO(b"raw stream"),
        "args": argparse.Namespace(lr=0.1, name="run-3", scale=torch.tensor([2.0, -1.5])),
        "step": 11,
    }
    dcp.save(state, checkpoint_id=out)


def items_expected(directory: Path) -> dict:
    """What torch reads from `items/`: its tensors (those inside items by their dotted path) and its items,
    plain ones as clipcli renders them, others by their class (placeholders)."""
    import numpy as np
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(directory, Path(tmp) / "whole.pt")
        whole = torch.load(Path(tmp) / "whole.pt", weights_only=False)  # written just now, by torch: safe to load
    tensors, metadata = [], {}
    for name, value in whole.items():
        if isinstance(value, dict):
            tensors += [tensor_entry(f"{name}.{k}", v) for k, v in value.items()]
        elif isinstance(value, np.ndarray):
            tensors.append(tensor_entry(name, torch.from_numpy(value)))
        elif isinstance(value, argparse.Namespace):
            metadata[name] = "<argparse.Namespace>"
            for k, v in vars(value).items():
                if isinstance(v, torch.Tensor):
                    tensors.append(tensor_entry(f"{name}.{k}", v))
                else:
                    metadata[f"{name}.{k}"] = literal(v, 0)
        elif isinstance(value, np.generic):
            metadata[name] = literal(value.item(), 0)
        elif isinstance(value, (int, bytes)):
            metadata[name] = literal(value, 0)
        else:
            metadata[name] = f"<{type(value).__module__}.{type(value).__qualname__}>"
    return {"tensors": tensors, "metadata": metadata}


def safetensors_format(out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 1}
    dcp.save(state, storage_writer=FileSystemWriter(out, serialization_format=SerializationFormat.SAFETENSORS))


# -- two processes ------------------------------------------------------------------------------------


def sharded_state(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # every rank makes the same global tensors
    rows = torch.randn(5, 3)
    one_row = torch.randn(1, 4)
    cols = torch.randn(3, 7).bfloat16()
    replicated = torch.randn(4)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)  # different data on each rank
    model(torch.randn(4, 5)).square().sum().backward()
    opt.step()
    model_state, optim_state = get_state_dict(model, opt)
    return {
        "rows": distribute_tensor(rows, mesh, [Shard(0)]),
        "one_row": distribute_tensor(one_row, mesh, [Shard(0)]),
        "cols": distribute_tensor(cols, mesh, [Shard(1)]),
        "replicated": distribute_tensor(replicated, mesh, [Replicate()]),
        "plain": torch.arange(3) + 10,
        "epoch": 2,
        "model": model_state,
        "optim": optim_state,
    }


def megatron_state(rank: int, world: int) -> dict:
    """Torch ShardedTensors and byte objects as Megatron-Core hands them to DCP (flat, keyed by sharded key)."""
    import io

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    def sharded(global_tensor: torch.Tensor, chunk_shape: tuple[int, ...], dim: int) -> ShardedTensor:
        shards_metadata = []
        local = []
        for r in range(world):
            offsets = [0] * global_tensor.dim()
            offsets[dim] = r * chunk_shape[dim]
            shards_metadata.append(ShardMetadata(offsets, list(chunk_shape), f"rank:{r}/cpu"))
            if r == rank:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, chunk_shape, strict=True))
                local.append(Shard.from_tensor_and_offsets(global_tensor[index].clone(), offsets, rank))
        properties = TensorProperties(dtype=global_tensor.dtype, memory_format=torch.contiguous_format)
        md = ShardedTensorMetadata(shards_metadata, global_tensor.shape, properties)
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, md, process_group=None)

    torch.manual_seed(0)
    qkv = torch.randn(2, 6, 4).bfloat16()  # two layers stacked on a prepended axis, one per rank
    embedding = torch.randn(8, 4)  # tensor-parallel rows
    exp_avg = torch.randn(8, 4) * 1e-3
    rng = io.BytesIO()
    torch.save(
        [
            {
                "random_rng_state": (3, (7 + rank, 11), None),
                "rng_tracker_states": torch.arange(4 * rank, 4 * rank + 4, dtype=torch.uint8),
            }
        ],
        rng,
    )
    rng.seek(0)
    return {
        "decoder.layers.self_attention.linear_qkv.weight": sharded(qkv, (1, 6, 4), 0),
        "embedding.word_embeddings.weight": sharded(embedding, (4, 4), 0),
        "optimizer.state.exp_avg.embedding.word_embeddings.weight": sharded(exp_avg, (4, 4), 0),
        f"rng_state/shard_{rank}_{world}": rng,
    }


def megatron_planner(mcore015: bool):
    """Megatron's save planner: no flattening, byte items written by every rank, local plans kept in .metadata."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    class Planner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False)

        def create_local_plan(self):
            items = [item for fqn, obj in self.state_dict.items() for item in _create_write_items(fqn, obj)]
            if mcore015:
                from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlan

                self.plan = MCoreSavePlan(items=items, mcore_data={})
            else:
                self.plan = SavePlan(items=items)
            return self.plan

        def create_global_plan(self, all_plans):
            plans, metadata = super().create_global_plan(all_plans)
            plans = [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]
            if mcore015:
                from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata

                fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
                metadata = MCoreMetadata(mcore_data={}, **fields)
            metadata.all_local_plans = plans
            return plans, metadata

        def transform_object(self, write_item, object):
            return object  # byte objects come serialized

    return Planner()


def worker(rank: int, world: int, port: int, kind: str, out: str, standin: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    warnings.filterwarnings("ignore")
    sys.path.insert(0, standin)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        if kind == "sharded":
            dcp.save(sharded_state(rank, world), checkpoint_id=out)
        else:
            writer = FileSystemWriter(out, thread_count=2)
            dcp.save(megatron_state(rank, world), storage_writer=writer, planner=megatron_planner(kind == "mcore015"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(kind: str, out: Path, standin: Path) -> None:
    import torch.multiprocessing as mp

    context = mp.start_processes(
        worker, args=(2, free_port(), kind, str(out), str(standin)), nprocs=2, join=False, start_method="spawn"
    )
    for _ in range(120):  # a minute at most
        if context.join(timeout=0.5):
            return
    for p in context.processes:
        p.kill()
    raise SystemExit(f"the two processes writing {out.name} did not finish")


def megatron_extras(out: Path) -> None:
    """What Megatron-Core writes beside the DCP files: the backend's name and the common state."""
    config = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch"}
    config["common_backend_version"] = 1
    (out / "metadata.json").write_text(json.dumps(config))
    args = argparse.Namespace(lr=3e-4, micro_batch_size=2, tensor_model_parallel_size=2)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10}, out / "common.pt")


# -- malformed metadata ---------------------------------------------------------------------------------


class Payload:
    """Unpickled by Python's pickle, it would run a shell command; clipcli must refuse it unrun."""

    def __reduce__(self):
        return (os.system, ("touch clipcli-was-exploited",))


def malformed(base: Path, out: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def variant(name: str, edit) -> None:
        md = FileSystemReader(base).read_metadata()
        md.storage_meta.load_id = None
        edit(md)
        with open(out / f"{name}.metadata", "wb") as f:
            pickle.dump(md, f)

    def move_chunk(md, fqn: str, i: int, offsets: tuple[int, ...], sizes: tuple[int, ...] | None = None) -> None:
        chunk = md.state_dict_metadata[fqn].chunks[i]
        old = MetadataIndex(fqn, chunk.offsets)
        chunk.offsets = torch.Size(offsets)
        if sizes is not None:
            chunk.sizes = torch.Size(sizes)
        md.storage_data[MetadataIndex(fqn, offsets)] = md.storage_data.pop(old)

    def first_index(md, fqn: str):
        return next(i for i in md.storage_data if i.fqn == fqn)

    def set_path(fqn: str, path: str):
        def edit(md):
            md.storage_data[first_index(md, fqn)].relative_path = path

        return edit

    def transform(md):
        for info in md.storage_data.values():
            info.transform_descriptors = ["stream.zstd/1"]

    out.mkdir(exist_ok=True)
    variant("overlap", lambda md: move_chunk(md, "rows", 1, (2, 0)))  # rows 2..4 over rows 0..3: same volume
    variant("overlap_volume", lambda md: move_chunk(md, "cols", 1, (0, 3), (3, 4)))  # columns 3..7 over 0..4
    variant("hole", lambda md: md.state_dict_metadata["cols"].chunks.pop(1))
    variant("past_bounds", lambda md: move_chunk(md, "rows", 1, (4, 0)))
    variant("missing_storage", lambda md: md.storage_data.pop(first_index(md, "replicated")))
    variant("missing_item", lambda md: md.storage_data.pop(first_index(md, "epoch")))
    variant("dotdot", set_path("replicated", "../sharded/__1_0.distcp"))
    variant("absolute", set_path("replicated", "/etc/passwd"))
    variant("wrong_dtype", lambda md: setattr(md.state_dict_metadata["rows"].properties, "dtype", torch.float64))
    variant("transform", transform)
    variant("version", lambda md: setattr(md, "version", "2.0.0"))


# -- foreign globals in metadata -------------------------------------------------------------------------


def foreign(base: Path, out: Path) -> None:
    """`.metadata` files (read with the files of `sharded/`) whose pickle names globals beyond DCP's own, in
    fields torch leaves free: inert placeholders for clipcli, which audits them and still reads the tensors."""

    from torch.distributed.checkpoint import FileSystemReader

    def variant(name: str, edit) -> None:
        md = FileSystemReader(base).read_metadata()
        md.storage_meta.load_id = None
        edit(md)
        with open(out / f"{name}.metadata", "wb") as f:
            pickle.dump(md, f)

    out.mkdir(exist_ok=True)
    variant("foreign_global", lambda md: setattr(md.storage_meta, "modules", [Payload()]))  # calls os.system
    variant("namespace", lambda md: setattr(md, "planner_data", argparse.Namespace(lr=0.1, tag="run-7")))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        standin = Path(tmp) / "standin"
        module = standin / "megatron/core/dist_checkpointing/strategies"
        module.mkdir(parents=True)
        for package in (standin / "megatron", standin / "megatron/core", standin / "megatron/core/dist_checkpointing"):
            (package / "__init__.py").write_text("")
        (module / "__init__.py").write_text("")
        (module / "torch.py").write_text(textwrap.dedent(MEGATRON_STANDIN))
        sys.path.insert(0, str(standin))
        cwd = os.getcwd()
        os.chdir(HERE)  # .metadata records the path it was given: keep it relative
        try:
            names = ("single", "items", "sharded", "megatron", "megatron_mcore015", "safetensors_format", "malformed")
            names += ("foreign",)
            for name in names:
                shutil.rmtree(HERE / name, ignore_errors=True)
            single(Path("single"))
            items(Path("items"))
            text = json.dumps(items_expected(Path("items")), indent=1, sort_keys=True) + "\n"
            Path("items.json").write_text(text)
            safetensors_format(Path("safetensors_format"))
            spawn("sharded", Path("sharded"), standin)
            for kind, name in (("megatron", "megatron"), ("mcore015", "megatron_mcore015")):
                spawn(kind, Path(name), standin)
                megatron_extras(HERE / name)
            for name in ("single", "sharded", "megatron", "megatron_mcore015"):
                write_expected(HERE / name)
            malformed(HERE / "sharded", HERE / "malformed")
            foreign(HERE / "sharded", HERE / "foreign")
        finally:
            os.chdir(cwd)


if __name__ == "__main__":
    if sys.argv[1:] == ["items"]:  # that checkpoint alone (the others' .metadata change with each run)
        os.chdir(HERE)
        shutil.rmtree("items", ignore_errors=True)
        items(Path("items"))
        Path("items.json").write_text(json.dumps(items_expected(Path("items")), indent=1, sort_keys=True) + "\n")
    elif sys.argv[1:] == ["foreign"]:  # those .metadata files alone, over sharded/ as it is
        os.chdir(HERE)
        foreign(HERE / "sharded", HERE / "foreign")
    else:
        main()
