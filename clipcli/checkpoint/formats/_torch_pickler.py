"""The pickle of a `.pt` written by clipcli: protocol 2 opcodes for the few kinds of object a state dict holds."""

from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Any

from clipcli.checkpoint.tensor import TensorInfo

# dtype name -> the typed storage class torch pickles it with (None: an UntypedStorage, `_rebuild_tensor_v3`)
STORAGE = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
    "float8_e4m3fn": None,
    "float8_e5m2": None,
    "float8_e4m3fnuz": None,
    "float8_e5m2fnuz": None,
    "float8_e8m0fnu": None,
    "uint16": None,
    "uint32": None,
    "uint64": None,
}


# -- the pickle ------------------------------------------------------------------------------------


class TensorRef:
    """A tensor of the output where the object holds it, with the storage key it is written under."""

    __slots__ = ("key", "numel_of_storage", "tensor")

    def __init__(self, tensor: TensorInfo):
        self.tensor = tensor
        self.key = ""
        self.numel_of_storage = 0


class Call:
    """A value pickled as a call of a global on plain arguments (a set, a complex, bytes, a torch.device), or,
    with `args` None, the global itself (a dtype): what torch's weights-only unpickler allows."""

    __slots__ = ("args", "module", "name")

    def __init__(self, module: str, name: str, args: tuple[Any, ...] | None = None):
        self.module, self.name, self.args = module, name, args


class Pickler:
    """Protocol 2 pickle opcodes for the few kinds of object a state dict holds; globals and the strings of
    persistent ids are memoized, as Python's pickler does."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self._memo: dict[Any, int] = {}

    def dump(self, obj: Any) -> bytes:
        self._save(obj)
        self.out += b"."
        return bytes(self.out)

    def _put(self, key: Any) -> None:
        n = self._memo[key] = len(self._memo)
        self.out += b"q" + bytes([n]) if n < 256 else b"r" + struct.pack("<I", n)

    def _memoized(self, key: Any) -> bool:
        n = self._memo.get(key)
        if n is None:
            return False
        self.out += b"h" + bytes([n]) if n < 256 else b"j" + struct.pack("<I", n)
        return True

    def _global(self, module: str, name: str) -> None:
        if not self._memoized(("global", module, name)):
            self.out += f"c{module}\n{name}\n".encode()
            self._put(("global", module, name))

    def _string(self, text: str, memo: bool = False) -> None:
        if memo and self._memoized(("str", text)):
            return
        data = text.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(data)) + data
        if memo:
            self._put(("str", text))

    def _save(self, obj: Any) -> None:
        t = type(obj)
        if obj is None:
            self.out += b"N"
        elif t is bool:
            self.out += b"\x88" if obj else b"\x89"
        elif t is int:
            self._int(obj)
        elif t is float:
            self.out += b"G" + struct.pack(">d", obj)
        elif t is str:
            self._string(obj)
        elif t is tuple:
            self._tuple(obj)
        elif t is list:
            self.out += b"]"
            for i in range(0, len(obj), 1000):
                self.out += b"("
                for item in obj[i : i + 1000]:
                    self._save(item)
                self.out += b"e"
        elif t in (dict, OrderedDict):
            if t is OrderedDict:
                self._global("collections", "OrderedDict")
                self.out += b")R"
            else:
                self.out += b"}"
            items = list(obj.items())
            for i in range(0, len(items), 1000):
                self.out += b"("
                for k, v in items[i : i + 1000]:
                    self._save(k)
                    self._save(v)
                self.out += b"u"
        elif t is TensorRef:
            self._tensor(obj)
        elif t is Call:
            self._global(obj.module, obj.name)
            if obj.args is not None:
                self._tuple(obj.args)
                self.out += b"R"
        else:  # _layout lets nothing else through
            raise AssertionError(f"no pickle for a {t.__name__}")

    def _int(self, n: int) -> None:
        if 0 <= n < 256:
            self.out += b"K" + bytes([n])
        elif 0 <= n < 65536:
            self.out += b"M" + struct.pack("<H", n)
        elif -(1 << 31) <= n < 1 << 31:
            self.out += b"J" + struct.pack("<i", n)
        else:
            data = n.to_bytes(n.bit_length() // 8 + 1, "little", signed=True)
            if n < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
                data = data[:-1]  # as pickle's encode_long
            self.out += b"\x8a" + bytes([len(data)]) + data  # _layout refuses ints of more than 255 bytes

    def _tuple(self, items: tuple[Any, ...]) -> None:
        if not items:
            self.out += b")"
            return
        if len(items) > 3:
            self.out += b"("
        for item in items:
            self._save(item)
        self.out += b"t" if len(items) > 3 else b"\x85\x86\x87"[len(items) - 1 : len(items)]

    def _tensor(self, ref: TensorRef) -> None:
        t = ref.tensor
        storage = STORAGE[t.dtype]
        self._global("torch._utils", "_rebuild_tensor_v2" if storage else "_rebuild_tensor_v3")
        self.out += b"("
        self.out += b"("  # the persistent id
        self._string("storage", memo=True)
        if storage:
            self._global("torch", storage)
        else:
            self._global("torch.storage", "UntypedStorage")
        self._string(ref.key)
        self._string("cpu", memo=True)
        self._int(ref.numel_of_storage)
        self.out += b"tQ"
        self._int(0)
        self._tuple(tuple(t.shape))
        strides, step = [], 1
        for n in reversed(t.shape):
            strides.append(step)
            step *= n
        self._tuple(tuple(reversed(strides)))
        self.out += b"\x89"
        self._global("collections", "OrderedDict")
        self.out += b")R"
        if not storage:
            self._global("torch", t.dtype)
        self.out += b"tR"
