"""The pickle audit: the globals a pickle names and calls, and whether torch's weights-only unpickler loads it."""

from __future__ import annotations

import pickle  # for its opcode constants only
from dataclasses import dataclass
from typing import Any


def _torch_weights_only_allowlist() -> frozenset[str]:
    """`torch._weights_only_unpickler._get_allowed_globals()` of torch 2.13.0 (the default, without
    `add_safe_globals`), as its keys read; torch 2.6 to 2.13 differ only in dtypes added on the way."""
    names = {
        "collections.OrderedDict",
        "collections.Counter",
        "torch.nn.parameter.Parameter",
        "torch.serialization._get_layout",
        "torch.Size",
        "torch.Tensor",
        "torch.device",
        "_codecs.encode",
        "builtins.bytearray",
        "builtins.set",
        "builtins.complex",
        "torch.storage.TypedStorage",
        "torch.storage.UntypedStorage",
        "torch._tensor._rebuild_from_type_v2",
    }
    dtypes = "bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64 float16 float32"
    dtypes += " float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu"
    dtypes += " int16 int32 int64 int8 qint32 qint8 quint2x4 quint4x2 quint8 uint16 uint32 uint64 uint8"
    names.update(f"torch.{d}" for d in dtypes.split())
    names.update(f"torch.{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8))
    kinds = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
    for module in ("torch", "torch.cuda"):
        names.update(f"{module}.{k}Tensor" for k in kinds)
        names.update(f"{module}.{k}Storage" for k in (*kinds, "ComplexDouble", "ComplexFloat"))
    names.update(f"torch.{q}Storage" for q in ("QInt32", "QInt8", "QUInt2x4", "QUInt4x2", "QUInt8"))
    for module in ("torch.sparse", "torch.cuda.sparse"):
        names.update(f"{module}.{k}Tensor" for k in kinds if k != "Bool")
    names.update(
        f"torch.{q}"
        for q in (
            "per_tensor_affine",
            "per_tensor_symmetric",
            "per_channel_affine",
            "per_channel_symmetric",
            "per_channel_affine_float_qparams",
        )
    )
    rebuilders = "tensor tensor_v2 tensor_v3 parameter parameter_with_state qtensor sparse_tensor nested_tensor"
    rebuilders += " device_tensor_from_cpu_tensor device_tensor_from_numpy meta_tensor_no_storage wrapper_subclass"
    names.update(f"torch._utils._rebuild_{r}" for r in rebuilders.split())
    return frozenset(names)


WEIGHTS_ONLY_GLOBALS = _torch_weights_only_allowlist()

# The opcodes torch's weights-only unpickler knows (torch 2.13's `Unpickler.load`); any other refuses the file.
_OPCODE_NAMES = """GLOBAL NEWOBJ REDUCE BUILD APPEND APPENDS SETITEM SETITEMS MARK TUPLE TUPLE1 TUPLE2 TUPLE3 NONE
NEWFALSE NEWTRUE EMPTY_TUPLE EMPTY_LIST EMPTY_DICT EMPTY_SET BININT BININT1 BININT2 BINFLOAT BINUNICODE SHORT_BINSTRING
BINPERSID BINGET LONG_BINGET BINPUT LONG_BINPUT LONG1 PROTO STOP"""
WEIGHTS_ONLY_OPCODES = frozenset(getattr(pickle, name)[0] for name in _OPCODE_NAMES.split())


@dataclass(frozen=True)
class GlobalUse:
    """One global a pickle names: `use` is "call" when unpickling would call it, else "name"; `count` is how
    many times it would be called ("call") or how many times the pickle names it ("name")."""

    name: str
    use: str
    count: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "use": self.use, "count": self.count}


@dataclass(frozen=True)
class PickleAudit:
    """What the pickles of one file name and would call, and whether `torch.load(weights_only=True)` loads it.

    `unsafe_calls` are the globals that `torch.load(weights_only=False)` would call and that neither torch's
    weights-only allowlist nor the reader's own (a distributed checkpoint's metadata classes) holds; `loader` is
    what would call them, as the warning names it.
    """

    file: str
    globals: tuple[GlobalUse, ...]
    loads_with_weights_only: bool
    unsafe_calls: tuple[str, ...]
    loader: str = "torch.load"

    def to_dict(self) -> dict[str, Any]:
        """The JSON's `pickle` object."""
        return {"loads_with_weights_only": self.loads_with_weights_only, "globals": [g.to_dict() for g in self.globals]}


class Audit:
    """Collects, while the machine runs (over one or several pickles of a file), each global's references
    and calls, and whatever torch's weights-only unpickler would refuse."""

    def __init__(self) -> None:
        self.uses: dict[str, list[int]] = {}  # name: [references, calls]
        self.weights_only = True
        self.inert_calls: set[str] = set()  # the globals called that only placeholders stand for (none of clipcli's)

    def named(self, name: str) -> None:
        """A GLOBAL (STACK_GLOBAL, INST) names it."""
        use = self.uses.get(name)
        if use is None:
            use = self.uses[name] = [0, 0]
            if name not in WEIGHTS_ONLY_GLOBALS:
                self.weights_only = False
        use[0] += 1

    def called(self, name: str, inert: bool = False) -> None:
        """REDUCE, NEWOBJ, INST, OBJ or BUILD would call it (or an object it made); `inert`: a placeholder
        stands for it."""
        if inert:
            self.inert_calls.add(name)
        use = self.uses.get(name)
        if use is None:  # an object's global named in another pickle of the file: still this file's
            use = self.uses[name] = [0, 0]
        use[1] += 1

    def refuse(self) -> None:
        """Something torch's weights-only unpickler refuses (an opcode it does not know)."""
        self.weights_only = False

    def result(self, file: str, trusted: frozenset[str] = frozenset(), loader: str = "torch.load") -> PickleAudit:
        """The audit of `file`; `trusted` are globals the reader knows besides torch's allowlist, `loader` what
        would load the file's pickles (and call what they name)."""
        uses = tuple(
            GlobalUse(name, "call", calls) if calls else GlobalUse(name, "name", refs)
            for name, (refs, calls) in sorted(self.uses.items())
        )
        unsafe = tuple(
            u.name for u in uses if u.use == "call" and u.name not in WEIGHTS_ONLY_GLOBALS and u.name not in trusted
        )
        return PickleAudit(file, uses, self.weights_only, unsafe, loader)
