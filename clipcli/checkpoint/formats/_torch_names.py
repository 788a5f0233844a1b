"""The names of a torch.save file's entries: the unpickled object flattened to dotted names, leaves rendered."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from clipcli.checkpoint.formats._numpy_pickle import NumpyArray, NumpyDtype
from clipcli.checkpoint.formats._pickle import (
    MAX_DEPTH,
    Constructor,
    Placeholder,
    a_kind,
)
from clipcli.checkpoint.formats._torch_records import (
    Device,
    Named,
    Storage,
    Storages,
    StorageType,
    Tensor,
    TorchTensor,
)
from clipcli.checkpoint.tensor import check_elements
from clipcli.errors import (
    ClipcliError,
    MalformedError,
    UnsupportedError,
)

_MAX_INDEX = 1 << 63  # shapes, strides and offsets are int64 in torch
_MAX_KEY_DEPTH = 100  # nesting of a tuple used as a dict key, as rendered in a name
# The budget of names a pickle may flatten to (see flatten): a tensor torch writes takes 60 bytes of pickle
# or more (rebuild call, persistent id, size, stride), a metadata leaf 2 or more, and a memo GET names a
# shared container or tensor again for 2 bytes. A tensor's name costs far more than a leaf's afterwards (its
# records, ~1.5 KB, and a read of its storage by every command that reads values).
_NAME_UNITS = 65536
_NAME_UNITS_PER_BYTE = 16
_TENSOR_UNITS = 32


# -- names ----------------------------------------------------------------------------------------


def flatten(
    root: Any, root_name: str, storages: Storages, big_endian: bool, pickle_size: int, item: bool = False
) -> tuple[dict[str, str], list[TorchTensor]]:
    """Walks the unpickled object depth first: tensors and metadata under dotted names, in order.

    With `item`, the object is named `root_name` as an item of a container would be (its own items
    `root_name.key`, an empty container a metadata entry).

    The walk is charged one unit per container or leaf and one per 16 characters of its name, and for every
    entry it keeps one per 4 characters of its name and value and _TENSOR_UNITS per tensor, against a budget
    proportional to the pickle's size: containers that share one another (one list held twice by a list
    held twice by ...) would otherwise give names without end, and a file may not cost more than its bytes
    justify.
    """
    budget = _NAME_UNITS + _NAME_UNITS_PER_BYTE * pickle_size
    tensors: list[TorchTensor] = []
    metadata: dict[str, str] = {}
    seen: dict[str, Any] = {}  # each name, and the keys that lead to it (a trail: (parent's trail, key))
    # parent's name, key, object, depth, trail
    pending: list[tuple[str | None, Any, Any, int, Any]] = [
        (None, root_name, root, 1, (None, root_name)) if item else (None, None, root, 0, None)
    ]
    while pending:
        parent, key, obj, depth, trail = pending.pop()
        if depth > MAX_DEPTH:
            raise MalformedError(f"the pickle nests containers deeper than {MAX_DEPTH} levels (or holds itself)")
        if depth == 0:
            name = root_name
        else:
            part = key if type(key) is str else _key_text(key)
            name = part if parent is None else f"{parent}.{part}"
        budget -= 1 + len(name) // 16  # building the name; a leaf's is kept, and charged again below
        if budget < 0:
            raise MalformedError(
                "the pickle's containers share one another (or hold themselves) so often that their names would "
                f"not end: more tensors and values than its {pickle_size} bytes justify"
            )
        if isinstance(obj, NumpyArray) and obj.placeholder is not None:
            obj = obj.placeholder  # an object or structured array: its items as any placeholder's
        if isinstance(obj, Placeholder):  # listed as a value, and what it holds named below it
            _claim(seen, name, trail)
            text = metadata[name] = _render(obj, name)
            budget -= (len(name) + len(text)) // 4
            prefix = None if depth == 0 else name
            pending.extend((prefix, k, v, depth + 1, (trail, k)) for k, v in reversed(_placeholder_children(obj)))
            continue
        children = _children(obj)
        if children is not None and (children or depth == 0):
            prefix = None if depth == 0 else name
            pending.extend((prefix, k, v, depth + 1, (trail, k)) for k, v in reversed(children))
            continue
        _claim(seen, name, trail)
        budget -= len(name) // 4
        if isinstance(obj, NumpyArray):
            budget -= _TENSOR_UNITS
            tensors.append(_numpy_tensor(name, obj))
        elif isinstance(obj, (Tensor, Storage)):
            budget -= _TENSOR_UNITS
            if isinstance(obj, Storage):  # a storage saved as such: all of it, as a 1-d tensor
                obj = Tensor(obj, 0, (obj.numel,), (1,))
            tensors.append(_describe(name, obj, big_endian))
        else:
            text = metadata[name] = _render(obj, name)
            budget -= len(text) // 4
    return metadata, tensors


def _claim(seen: dict[str, Any], name: str, trail: Any) -> None:
    """Records that the entry at `trail` takes `name`; refuses a name that another entry took, naming both."""
    other = seen.setdefault(name, trail)
    if other is not trail:
        raise MalformedError(
            f"two entries of the pickle, {_path(other)} and {_path(trail)}, flatten to this one name", tensor=name
        )


_MAX_PATH = 200  # characters of an entry's keys shown in a message


def _path(trail: Any) -> str:
    """The keys that lead to an entry, as Python would index the object (`[1]['a']`; `the object` for the root)."""
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    try:
        text = "".join(f"[{_literal(k, 1)}]" for k in reversed(keys))
    except ClipcliError:
        text = "[...]"
    return (text if len(text) <= _MAX_PATH else text[: _MAX_PATH - 3] + "...") or "the object"


def _children(obj: Any) -> list[tuple[Any, Any]] | None:
    """A container's (key, item) pairs, or None for a leaf; keys are rendered only once named."""
    if isinstance(obj, dict):
        return _keyed(list(obj.items()))
    if type(obj) in (list, tuple):
        return list(enumerate(obj))
    return None


def _placeholder_children(p: Placeholder) -> list[tuple[Any, Any]]:
    """What a placeholder object holds, named as its attributes are: its state's keys (`__dict__` and slots),
    its items' keys and indices, and `__args__.N`, `__kwargs__.K`, `__state__` for arguments and a state
    that `_render` does not show inline."""
    out: list[tuple[Any, Any]] = []
    if p.args and _inline_args(p) is None:
        out += [(f"__args__.{i}", a) for i, a in enumerate(p.args)]
    out += [(f"__kwargs__.{k}", v) for k, v in p.kwargs.items()]
    attributes: dict[str, Any] = {}  # each BUILD updates them, as Python's does
    others = []
    for state in p.states:  # (__dict__, slots) as pickle's BUILD takes them, or a dict, or another state
        pair = type(state) is tuple and len(state) == 2 and all(type(x) in (dict, type(None)) for x in state)
        for part in state if pair else (state,):
            if isinstance(part, dict) and all(type(k) is str for k in part):
                attributes.update(part)
            elif part is not None:
                others.append(part)
    out += list(attributes.items())
    if others:
        out.append(("__state__", others[0] if len(others) == 1 else others))
    out += _keyed(list(p.items.items()))
    out += list(enumerate(p.list_items))
    return out


KEY = "__key__"  # the key of a dict entry that is named by its position (see _keyed)


class Entry(NamedTuple):
    """The value (or, `key`, the key) of the dict entry at `position`, whose key holds a tensor."""

    position: int
    key: bool


def _keyed(items: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """A dict's (key, value) pairs as they are named: an entry whose key holds a tensor (torch's `optimizer.state`
    is keyed by the parameters, in the order they first got state) is named by its position in the dict, and its
    key, a tensor to list like any other, `N.__key__` beside it."""
    if not any(_holds_tensor(k, 0) for k, _ in items):
        return items
    out: list[tuple[Any, Any]] = []
    for i, (k, v) in enumerate(items):
        out += [(Entry(i, False), v), (Entry(i, True), k)] if _holds_tensor(k, 0) else [(k, v)]
    return out


def _holds_tensor(key: Any, depth: int) -> bool:
    if isinstance(key, (Tensor, Storage)):
        return True
    return type(key) is tuple and depth < _MAX_KEY_DEPTH and any(_holds_tensor(k, depth + 1) for k in key)


def _inline_args(p: Placeholder) -> str | None:
    """A placeholder object's arguments as Python literals (`'a', 1`), or None unless they are a few plain values
    (placeholders inside are never rendered inline: objects that share one another would render without end;
    long or many values are named one by one, each charged to `flatten`'s budget)."""
    if not p.args:
        return ""
    left = [_INLINE_ITEMS, _INLINE_CHARS]
    if not all(_plain(a, 0, left) for a in p.args):
        return None
    try:
        return ", ".join(_literal(a, 1) for a in p.args)
    except ClipcliError:
        return None


_PLAIN = (str, int, float, bool, type(None), bytes, complex)
_INLINE_ITEMS = 32  # values an object's arguments may hold and still be shown inline
_INLINE_CHARS = 512  # characters of their strings and bytes


def _plain(value: Any, depth: int, left: list[int]) -> bool:
    left[0] -= 1
    t = type(value)
    if t in (str, bytes):
        left[1] -= len(value)
    elif t is int and value.bit_length() > 64:
        return False
    if left[0] < 0 or left[1] < 0:
        return False
    if t in _PLAIN:
        return True
    return t is tuple and depth < _MAX_KEY_DEPTH and all(_plain(v, depth + 1, left) for v in value)


def _numpy_tensor(name: str, a: NumpyArray) -> TorchTensor:
    if a.dtype is None or a.data is None:
        raise MalformedError("a numpy.ndarray that the pickle never gives its state (BUILD)", tensor=name)
    shape = a.shape
    check_elements(shape, name)
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return TorchTensor(name, a.dtype, a.dtype.name, shape, strides, 0, "", 0, len(a.data), False, None, a.data)


def _key_text(key: Any) -> str:
    return key if type(key) is str else _literal(key, 0)


def _literal(value: Any, depth: int) -> str:
    """A dict key, set member or leaf written as a Python literal would be (never an object's address)."""
    if depth > _MAX_KEY_DEPTH:
        raise MalformedError(f"a dict key or set nested deeper than {_MAX_KEY_DEPTH} levels")
    if type(value) is str:
        return repr(value) if depth else value
    if type(value) is Entry:  # a name's part; in a message's path (depth 1), what it is
        if depth:
            return f"<the tensor key of entry {value.position}>" if value.key else f"<entry {value.position}>"
        return f"{value.position}.{KEY}" if value.key else str(value.position)
    if type(value) is int:
        return str(value) if value.bit_length() < 10_000 else hex(value)  # str() refuses > 4300 digits
    if value is None or type(value) in (bool, float, complex, bytes):
        return repr(value)
    if type(value) is tuple:
        items = [_literal(v, depth + 1) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if type(value) in (set, frozenset):
        items = sorted(_literal(v, depth + 1) for v in value)
        if not items:
            return "set()" if type(value) is set else "frozenset()"
        text = "{" + ", ".join(items) + "}"
        return text if type(value) is set else f"frozenset({text})"
    if isinstance(value, (Named, StorageType)):
        return value.name
    if isinstance(value, Device):
        return value.text
    if isinstance(value, Constructor):
        return value.name
    if isinstance(value, Placeholder):
        if value.args is None:
            return value.name
        args = _inline_args(value)
        return f"<{value.name}>" if not args else f"<{value.name}({args})>"
    if isinstance(value, NumpyDtype):
        return value.text
    if isinstance(value, (Tensor, Storage)):
        raise UnsupportedError("a tensor in a set has no name (a set has no order to number its members by)")
    raise MalformedError(f"{a_kind(value)} where a key or value belongs")


def _render(value: Any, name: str) -> str:
    if isinstance(value, dict):
        return "{}"
    if type(value) is list:
        return "[]"
    try:
        return _literal(value, 0)
    except ClipcliError as e:
        e.tensor = name
        raise


def _dims(value: Any, what: str, name: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or not all(type(d) is int and 0 <= d < _MAX_INDEX for d in value):
        raise MalformedError(f"the {what} is not a tuple of non-negative integers", tensor=name)
    return tuple(value)


def _describe(name: str, t: Tensor, big_endian: bool) -> TorchTensor:
    """The tensor under its name, checked: its view lies inside its storage, and its storage in the file."""
    shape = _dims(t.shape, "shape", name)
    check_elements(shape, name)  # before anything counts or prints them (a meta tensor's too)
    storage = t.storage
    dtype = t.dtype if t.dtype is not None or not isinstance(storage, Storage) else storage.dtype
    dtype_name = dtype.name if dtype is not None else "unknown"
    skip = (
        t.skip
        if t.skip is not None or dtype is None or dtype.array is not None
        else f"dtype {dtype.name} has no NumPy type"
    )
    if storage is None:  # sparse, meta, nested: listed with their shape, no storage
        strides = _dims(t.strides, "strides", name) if t.strides else ()
        return TorchTensor(name, None, dtype_name, shape, strides, 0, "", 0, 0, False, skip)
    assert isinstance(storage, Storage) and dtype is not None
    strides = _dims(t.strides, "strides", name)
    if len(strides) != len(shape):
        raise MalformedError(f"{len(shape)} dimensions but {len(strides)} strides", tensor=name)
    if type(t.offset) is not int or not 0 <= t.offset < _MAX_INDEX:
        raise MalformedError("the storage offset is not a non-negative integer", tensor=name)
    itemsize = dtype.itemsize
    if math.prod(shape):
        last = t.offset + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
        if (last + 1) * itemsize > storage.nbytes:
            raise MalformedError(
                f"the view (offset {t.offset}, shape {shape}, strides {strides}) needs {(last + 1) * itemsize} "
                f"bytes of storage {storage.key}, which holds {storage.nbytes}",
                tensor=name,
            )
    first_byte = storage.base + t.offset * itemsize
    if first_byte % itemsize:
        raise MalformedError(f"storage view {storage.key} does not start on a {dtype.name} element", tensor=name)
    root = storage.root
    return TorchTensor(
        name,
        None if skip else dtype.array,
        dtype_name,
        shape,
        strides,
        first_byte // itemsize,
        root.key,
        root.file_offset,
        root.nbytes,
        big_endian,
        skip,
        itemsize=itemsize,
    )
