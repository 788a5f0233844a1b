"""What a distributed checkpoint's `.metadata` pickle may build: DCP's dataclasses and enums as plain records."""

from __future__ import annotations

from typing import Any

from clipcli.checkpoint.formats._pickle import Constructor, Record, a_kind
from clipcli.checkpoint.formats._torch_records import dtype_of, resolve_global
from clipcli.errors import MalformedError


class DcpObject(Record):
    """An instance of one of DCP's dataclasses: its class's short name and the attributes BUILD sets."""

    def __init__(self, cls: str):
        self.cls = cls
        self.attrs: dict[str, Any] = {}

    def describe(self) -> str:
        return self.cls

    def build(self, state: Any) -> None:
        if type(state) is tuple and len(state) == 2 and state[1] is None:  # (dict, slots) as Python pickles it
            state = state[0]
        if not isinstance(state, dict) or not all(type(k) is str for k in state):
            raise MalformedError(f"the pickle sets the attributes of a {self.cls} from {a_kind(state)}")
        self.attrs.update(state)

    def get(self, name: str) -> Any:
        return self.attrs.get(name)


class _Properties(DcpObject):
    """TensorProperties, pickled as the tuple (dtype, layout, requires_grad, memory format, pin_memory)."""

    def build(self, state: Any) -> None:
        if type(state) is tuple and len(state) == 5:
            self.attrs["dtype"] = state[0]
        else:
            super().build(state)


class _Member(Record):
    """A member of one of DCP's enums (a memory format, a write item's type), by its value."""

    def __init__(self, cls: str, value: int):
        self.cls = cls
        self.value = value

    def describe(self) -> str:
        return self.cls


_CHECKPOINT = "torch.distributed.checkpoint"
_SHARDED = "torch.distributed._shard.sharded_tensor.metadata"  # torch's ShardedTensor (Megatron's, FSDP1's)
_MEGATRON = "megatron.core.dist_checkpointing.strategies.torch"

# Every class DCP's metadata names, by the short name clipcli knows it by. The save plans, write items
# and storage prefixes appear only in Megatron's metadata (all_local_plans): they are read, never used.
_CLASSES = {
    f"{_CHECKPOINT}.metadata.Metadata": "Metadata",
    f"{_MEGATRON}.MCoreMetadata": "Metadata",
    f"{_CHECKPOINT}.metadata.TensorStorageMetadata": "TensorStorageMetadata",
    f"{_CHECKPOINT}.metadata.BytesStorageMetadata": "BytesStorageMetadata",
    f"{_CHECKPOINT}.metadata.ChunkStorageMetadata": "ChunkStorageMetadata",
    f"{_CHECKPOINT}.metadata.TensorProperties": "TensorProperties",
    f"{_SHARDED}.TensorProperties": "TensorProperties",
    f"{_CHECKPOINT}.metadata.MetadataIndex": "MetadataIndex",
    f"{_CHECKPOINT}.metadata.StorageMeta": "StorageMeta",
    f"{_CHECKPOINT}.filesystem._StorageInfo": "_StorageInfo",
    f"{_CHECKPOINT}.filesystem._StoragePrefix": "_StoragePrefix",
    f"{_CHECKPOINT}.planner.SavePlan": "SavePlan",
    f"{_MEGATRON}.MCoreSavePlan": "SavePlan",
    f"{_CHECKPOINT}.planner.WriteItem": "WriteItem",
    f"{_CHECKPOINT}.planner.TensorWriteData": "TensorWriteData",
}
# enums, pickled as a call of the class with the member's value
_ENUMS = {
    f"{_CHECKPOINT}.metadata._MEM_FORMAT_ENCODING": range(3),
    f"{_SHARDED}.MEM_FORMAT_ENCODING": range(3),
    f"{_CHECKPOINT}.planner.WriteItemType": range(1, 4),
}
# StorageMeta.checkpoint_id, pickled as a call with the path's parts (pathlib._local: Python 3.13)
_PATHS = {"pathlib.PosixPath", "pathlib._local.PosixPath", "pathlib.WindowsPath", "pathlib._local.WindowsPath"}
_TORCH_FUNCTIONS = {"torch.Size", "torch.serialization._get_layout"}  # and every dtype: see resolve


def _object_maker(name: str, short: str) -> Constructor:
    record = _Properties if short == "TensorProperties" else DcpObject

    def make(*args: Any, **kwargs: Any) -> DcpObject:
        if args or kwargs:  # dataclasses pickle as cls.__new__(cls), then BUILD
            raise MalformedError(f"the pickle creates a {name} with arguments")
        return record(short)

    return Constructor(name, make, newobj=True)


def _enum_maker(name: str, values: range) -> Constructor:
    def make(value: Any) -> _Member:
        if type(value) is not int or value not in values:
            raise MalformedError(f"the pickle asks for a {name} that does not exist")
        return _Member(name, value)

    return Constructor(name, make)


def _path(*parts: Any) -> str:
    if not all(type(p) is str for p in parts):
        raise MalformedError("the pickle builds a path from something other than strings")
    return "/".join(parts)


def _allowlist() -> dict[str, Any]:
    allowed: dict[str, Any] = {name: _object_maker(name, short) for name, short in _CLASSES.items()}
    allowed.update({name: _enum_maker(name, values) for name, values in _ENUMS.items()})
    allowed.update({name: Constructor(name, _path) for name in _PATHS})
    allowed.update({name: resolve_global(*name.rsplit(".", 1)) for name in _TORCH_FUNCTIONS})
    return allowed


_ALLOWED = _allowlist()


TRUSTED = frozenset(_ALLOWED)  # DCP's own classes, which torch's DCP reader allows: no warning in the audit


def resolve(module: str, name: str) -> Any:
    found = _ALLOWED.get(f"{module}.{name}")
    if found is None and module == "torch":
        dtype = resolve_global(module, name)
        return dtype if dtype_of(dtype) is not None else None
    return found
