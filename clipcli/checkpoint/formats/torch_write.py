"""Writing PyTorch files: a state dict in torch's zip format, as `torch.save` of torch 2.13 lays it out.

The archive's records, all stored, in `torch.save`'s order under one folder named after the file's stem:
`data.pkl` (a protocol 2 pickle), `.format_version` (`1`), `.storage_alignment` (`64`), `byteorder`
(`little`), `data/0`, `data/1`, ... (one storage per tensor, in C order), `version` (`3\\n`) and
`.data/serialization_id`. As torch's writer (miniz) does, every local header has no CRC and no sizes
(flag bit 3: a data descriptor follows the data), an extra field `FB` pads it so that each record's data
starts on a multiple of 64 bytes, and the directory ends with zip64 records. A record of 4 GiB or more, or
one that starts past 4 GiB, gets a zip64 extra field in its local header (its sizes, or its offset, as
miniz writes it) and in the directory, and a data descriptor of 8-byte sizes.

The pickle is what torch writes for a tensor: `torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, False, OrderedDict())`, the storage a persistent id `('storage', torch.FloatStorage, '0', 'cpu',
numel)`; dtypes without a typed storage class (float8, uint16/32/64) as torch writes them,
`_rebuild_tensor_v3(..., dtype)` over a `torch.storage.UntypedStorage` of bytes.

Choices where torch leaves room: the serialization id (random in torch) is a digest of the records, so the
same input gives the same bytes; names on one storage (tied weights) that are the same view share one
storage and their values are checked to be equal when written (a clip that changes one but not the other is
refused); other views are written as tensors of their own. What the object holds: from a PyTorch file, the
structure it was saved with (its dicts, lists and tuples, in order), each tensor where it was, and the
non-tensor leaves still in the checkpoint's metadata where they are plain data (numbers, strings, booleans,
None, empty containers, and bytes, sets, complex numbers, dtypes and devices, which torch's weights-only
unpickler allows); from any other input, a TorchScript archive's included (its `state_dict()` names, and its
constants as `CONSTANTS.cN`), a dict of the tensors in order. An item left out of a list or tuple before items
kept is refused (those after it would be renumbered), and so is a TorchScript archive written over itself (its
program would be lost).
"""

from __future__ import annotations

import hashlib
import shlex
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from clipcli.checkpoint.copy import FileRange
from clipcli.checkpoint.crc import crc32
from clipcli.checkpoint.formats._pickle import MAX_DEPTH
from clipcli.checkpoint.formats._torch_archive import ALIGNMENT, Archive, folder_of
from clipcli.checkpoint.formats._torch_pickler import STORAGE, Call, Pickler, TensorRef
from clipcli.checkpoint.source import LOCAL, Store
from clipcli.checkpoint.tensor import Pieces, Span, TensorInfo
from clipcli.errors import UnsupportedError, UsageError

# -- what the object holds ---------------------------------------------------------------------------

_SKIP = object()  # what _layout gives for what the output leaves out


class _Size:
    """A torch.Size as the writer reads it (the names see a tuple): its items, written back as a torch.Size."""

    __slots__ = ("dims",)

    def __init__(self, dims: tuple[int, ...]):
        self.dims = dims


class _Parameter:
    """An nn.Parameter as the writer reads it (the names see its tensor): written back as a Parameter."""

    __slots__ = ("requires_grad", "tensor")

    def __init__(self, tensor: Any, requires_grad: bool):
        self.tensor, self.requires_grad = tensor, requires_grad


def _keeping(module: str, name: str) -> Any:
    """The pickle machine's resolver for `_rebuild`: torch's, but torch.Size and nn.Parameter kept as such."""
    from clipcli.checkpoint.formats._pickle import Constructor
    from clipcli.checkpoint.formats._torch_records import resolve

    found = resolve(module, name)
    qualified = f"{module}.{name}"
    if qualified == "torch.Size":
        return Constructor(qualified, lambda *args: _Size(found.func(*args)))
    if qualified in ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"):
        return Constructor(qualified, lambda *args: _Parameter(found.func(*args), args[1:2] == (True,)))
    return found


def _deep_enough() -> None:
    """Room for the walks over the object written (`_rebuild`, `_collect`, the pickler: a few frames a level)
    through as many levels as the reader takes (MAX_DEPTH): raised, never lowered again, as a thread may be
    deep in one while another ends."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5 * MAX_DEPTH + 1000))


def _layout(tensors: list[TensorInfo], metadata: dict[str, str], store: Store) -> Any:
    """The object to pickle: the input's own structure (the tensors of one torch.save file), or a dict of the
    tensors in order (from any other input, a TorchScript archive's included: its `state_dict()` names).

    Raises:
        UnsupportedError: for a metadata leaf that is not plain data (a placeholder, a dtype, a set, ...).
    """
    _deep_enough()
    source = _torch_source(tensors, store)
    if source is not None and not source[2]:
        path, root, _ = source
        return _rebuild(root, path.stem, tensors, metadata)
    return OrderedDict((t.name, TensorRef(t)) for t in tensors)


def _torch_source(tensors: list[TensorInfo], store: Store) -> tuple[Path, Any, bool] | None:
    """The file the tensors all come from, its object and whether it is TorchScript, when that is one PyTorch
    file (not a distributed checkpoint's), read from `store` (the source's: local or remote); None otherwise."""
    from clipcli.checkpoint.formats.torch import read_root  # here: torch's reader imports this module
    from clipcli.checkpoint.registry import file_format  # here: the registry imports the formats

    files = {t.file for t in tensors}
    if len(files) != 1 or tensors[0].file.endswith(".distcp"):
        return None
    path = Path(tensors[0].file)
    try:
        if file_format(path, store) != "torch":
            return None
    except OSError:
        return None
    return (path, *read_root(path, store, _keeping))


def _rebuild(root: Any, root_name: str, tensors: list[TensorInfo], metadata: dict[str, str]) -> Any:
    """The object `root` (a PyTorch file's, as the pickle machine built it) with its tensors replaced by those
    written and its leaves kept where they are still in `metadata`; names as `_torch_names.flatten` gives."""
    from clipcli.checkpoint.formats._numpy_pickle import NumpyArray
    from clipcli.checkpoint.formats._pickle import PickledCounter, Placeholder
    from clipcli.checkpoint.formats._torch_names import KEY, _children, _holds_tensor, _key_text
    from clipcli.checkpoint.formats._torch_records import Storage, Tensor

    by_name = {t.name: t for t in tensors}
    placed: set[str] = set()

    def walk(obj: Any, name: str | None, depth: int) -> Any:
        label = root_name if name is None else name
        if isinstance(obj, NumpyArray) and obj.placeholder is not None:
            obj = obj.placeholder
        if isinstance(obj, Placeholder):
            if label in metadata:
                raise UnsupportedError(
                    f"metadata of {obj.name} (a placeholder: clipcli never runs it), which a .pt output cannot hold "
                    "(torch.load(weights_only=True) refuses it); give --drop-metadata to write the tensors without it",
                    tensor=label,
                )
            return _SKIP  # its tensors, if any, go to the top (below)
        if isinstance(obj, _Parameter):  # torch._utils._rebuild_parameter(tensor, requires_grad, hooks)
            ref = walk(obj.tensor, name, depth)
            hooks = OrderedDict()  # type: ignore[var-annotated]
            return ref if ref is _SKIP else Call("torch._utils", "_rebuild_parameter", (ref, obj.requires_grad, hooks))
        if isinstance(obj, _Size):
            dims = walk(obj.dims, name, depth)
            return dims if dims is _SKIP else Call("torch", "Size", (dims,))
        if isinstance(obj, (NumpyArray, Tensor, Storage)):
            t = by_name.get(label)
            if t is None:
                return _SKIP  # not selected
            placed.add(label)
            return TensorRef(t)
        if isinstance(obj, dict) and any(_holds_tensor(_as_read(k), 0) for k in obj):
            return keyed(obj, name, depth)
        children = _children(obj)
        if children is not None and (children or depth == 0):
            kept, gap = [], None
            for key, value in children:
                part = key if type(key) is str else _key_text(_as_read(key))
                item = walk(value, part if name is None else f"{name}.{part}", depth + 1)
                if item is _SKIP:
                    gap = gap or (part if name is None else f"{name}.{part}")
                elif gap is not None and not isinstance(obj, dict):
                    raise _renumbered(gap, label, obj)
                else:
                    kept.append((_plain_key(key, label), item))
            if isinstance(obj, PickledCounter):  # collections.Counter(dict): in torch's weights-only allowlist
                return Call("collections", "Counter", (dict(kept),))
            if isinstance(obj, dict):
                return (OrderedDict if type(obj) is not dict else dict)(kept)
            return type(obj)(v for _, v in kept)
        if label not in metadata:
            return _SKIP
        return _plain(obj, label)

    def keyed(obj: dict[Any, Any], name: str | None, depth: int) -> Any:
        """A dict some of whose keys hold tensors, written with them as keys (the reader names such an entry by
        its position and its key `N.__key__`). An entry whose value is left out is left out, its key's tensors
        going to the top by name, and so is one whose key and every tensor of whose value are; a value with
        tensors kept whose key is left out is refused (it would have no key)."""
        kept = []
        for i, (key, value) in enumerate(obj.items()):
            if not _holds_tensor(_as_read(key), 0):
                part = key if type(key) is str else _key_text(_as_read(key))
                item = walk(value, part if name is None else f"{name}.{part}", depth + 1)
                if item is not _SKIP:
                    kept.append((_plain_key(key, root_name if name is None else name), item))
                continue
            at = str(i) if name is None else f"{name}.{i}"
            before = len(placed)
            item = walk(value, at, depth + 1)
            if item is _SKIP:
                continue
            written = walk(key, f"{at}.{KEY}", depth + 1)
            if written is _SKIP and len(placed) == before:
                continue
            if written is _SKIP:
                raise UnsupportedError(
                    f"is the key of the entry {at}, which a .pt output cannot hold without it (torch keys it by that "
                    "tensor); select it too, or write .safetensors (which keeps every name)",
                    tensor=f"{at}.{KEY}",
                )
            kept.append((written, item))
        return (OrderedDict if type(obj) is not dict else dict)(kept)

    out = walk(root, None, 0)
    left = [t for t in tensors if t.name not in placed]
    if out is _SKIP:  # the whole object left out (a placeholder, metadata dropped)
        out = OrderedDict()
    if left:  # inside a placeholder left out, or not where the structure holds them: at the top, by name
        if not isinstance(out, dict):
            return OrderedDict((t.name, TensorRef(t)) for t in tensors)
        for t in left:
            out[t.name] = TensorRef(t)
    return out


def _renumbered(gap: str, label: str, items: Any) -> UnsupportedError:
    """The refusal of a list (or tuple) with an item left out before others kept: torch numbers its items, and
    those after the gap would take other names."""
    return UnsupportedError(
        f"is left out of the {type(items).__name__} {label} ({len(items)} items), which would renumber the items "
        f"after it in a .pt; select all of {label} or only its first items, or write .safetensors (which keeps "
        "every name)",
        tensor=gap,
    )


def _plain(value: Any, name: str) -> Any:
    """A metadata leaf a .pt output holds as it is: a number, string, boolean, None or empty container.

    Raises:
        UnsupportedError: for anything else, naming what it is.
    """
    t = type(value)
    if value is None or t in (bool, float, str) or (t is int and value.bit_length() < 2000):
        return value
    if t in (dict, list, tuple) and not value:
        return t()
    from clipcli.checkpoint.formats._pickle import PickledCounter, a_kind

    if t is PickledCounter:
        return Call("collections", "Counter", ({},))
    if isinstance(value, dict) and not value:
        return OrderedDict()
    from clipcli.checkpoint.formats._torch_records import LAYOUTS, QSCHEMES, Device, Named

    if t is complex:
        return Call("builtins", "complex", (value.real, value.imag))
    if t is bytes:
        return Call("_codecs", "encode", (value.decode("latin-1"), "latin1"))
    if t is set:
        return Call("builtins", "set", ([_plain_key(v, name) for v in sorted(value, key=_order)],))
    if isinstance(value, Device):
        return Call("torch", "device", (value.text,))
    if isinstance(value, Named) and value.dtype is not None and value.name.startswith("torch."):
        return Call("torch", value.name[len("torch.") :])
    if isinstance(value, Named) and value.name in LAYOUTS:  # as torch pickles a layout
        return Call("torch.serialization", "_get_layout", (value.name,))
    if isinstance(value, Named) and value.name in QSCHEMES:
        return Call("torch", value.name[len("torch.") :])

    why = " (torch.load(weights_only=True) refuses builtins.frozenset)" if t is frozenset else ""
    raise UnsupportedError(
        f"{a_kind(value)}{why}, which clipcli does not write to a .pt (it writes what torch's weights-only "
        "unpickler reads back: numbers, strings, booleans, None, bytes, sets, dtypes, devices, layouts, "
        "quantization schemes, torch.Size, Parameters and containers of them); give --drop-metadata to write the "
        "tensors without it",
        tensor=name,
    )


def _plain_key(key: Any, name: str) -> Any:
    """A dict key or set member as a .pt output holds it: a plain leaf, or a tuple or torch.Size of them."""
    if type(key) is tuple:
        return tuple(_plain_key(k, name) for k in key)
    if type(key) is _Size:
        return Call("torch", "Size", (key.dims,))
    return _plain(key, name)


def _order(member: Any) -> tuple[str, str]:
    """Where a set's member is written: by its kind and text as the reader renders it (never an address)."""
    from clipcli.checkpoint.formats._torch_names import _key_text

    return type(member).__name__, _key_text(_as_read(member))


def _as_read(key: Any) -> Any:
    """A dict key as the reader names it: each torch.Size in it a tuple."""
    if type(key) is _Size:
        return key.dims
    if type(key) is _Parameter:
        return key.tensor
    if type(key) in (tuple, frozenset):
        return type(key)(_as_read(k) for k in key)
    return key


# -- the format's entry points ----------------------------------------------------------------------


def _same_view(a: TensorInfo, b: TensorInfo) -> bool:
    """Whether two names on one storage are the same view of it (then they share one storage when written)."""
    if (a.dtype, a.shape, a.file) != (b.dtype, b.shape, b.file):
        return False
    la, lb = a.location, b.location
    if isinstance(la, Span) and isinstance(lb, Span):
        return la.offset == lb.offset
    if isinstance(la, Pieces) and isinstance(lb, Pieces):
        return (la.shape, la.pieces) == (lb.shape, lb.pieces)
    return False


def kept_shared(tensors: list[TensorInfo]) -> tuple[tuple[str, ...], ...]:
    """The groups of names that a .pt of `tensors` writes on one storage: a storage's first name and the later
    names of the same view (as `write` ties them)."""
    first: dict[str, TensorInfo] = {}
    groups: dict[str, list[str]] = {}
    for t in tensors:
        if t.storage is None:
            continue
        earlier = first.setdefault(t.storage, t)
        if earlier is not t and _same_view(earlier, t):
            groups.setdefault(earlier.name, [earlier.name]).append(t.name)
    return tuple(tuple(names) for names in groups.values())


def write(
    f: BinaryIO,
    tensors: list[TensorInfo],
    metadata: dict[str, str],
    chunks: Callable[[TensorInfo], Iterable[np.ndarray]],
    expect: Callable[[TensorInfo, int], None],
    store: Store = LOCAL,
) -> None:
    """Writes the tensors, in order, as a torch.save archive (see the module's docstring); a PyTorch source's
    structure is read from `store`, where its file is.

    Raises:
        UnsupportedError: for a metadata leaf a .pt cannot hold, or tied names that this write makes differ.
    """
    obj = _layout(tensors, metadata, store)
    refs: list[TensorRef] = []
    _collect(obj, refs)
    by_tensor = {id(r.tensor): r for r in refs}
    first: dict[str, TensorRef] = {}  # a storage of the input: its first name written
    tied: dict[str, TensorRef] = {}  # a later name of the same view: the first's
    keys = 0
    for t in tensors:  # keys in the order the data is written (the pickle's order, but for names moved up)
        ref = by_tensor[id(t)]
        earlier = first.get(t.storage) if t.storage is not None else None
        if earlier is not None and _same_view(earlier.tensor, t):
            tied[t.name] = earlier
            ref.key, ref.numel_of_storage = earlier.key, earlier.numel_of_storage
            continue
        ref.key, keys = str(keys), keys + 1
        ref.numel_of_storage = t.size if STORAGE[t.dtype] else t.nbytes
        if t.storage is not None:
            first.setdefault(t.storage, ref)
    pickle = Pickler().dump(obj)
    archive = Archive(f, folder_of(f))
    try:
        archive.record("data.pkl", pickle)
        archive.record(".format_version", b"1")
        archive.record(".storage_alignment", str(ALIGNMENT).encode())
        archive.record("byteorder", b"little")
        written: dict[str, int] = {}  # a storage's key: the CRC-32 of its data
        for t in tensors:
            ref = by_tensor[id(t)]
            if t.name in tied:
                expect(t, _check_tied(t, tied[t.name], written, chunks(t)))
                continue
            m = archive.begin(f"data/{ref.key}", t.nbytes)
            for chunk in chunks(t):
                archive.data(m, chunk if isinstance(chunk, FileRange) else _bytes_of(chunk))
            archive.end(m)
            written[ref.key] = m.crc
            expect(t, m.size)
        archive.record("version", b"3\n")
        digest = hashlib.sha256(pickle + b"".join(struct.pack("<IQ", m.crc, m.size) for m in archive.members)).digest()
        archive.record(".data/serialization_id", b"%040d" % (int.from_bytes(digest, "little") % 10**40))
        archive.close()
    finally:
        archive.release()


def _bytes_of(chunk: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))


def _check_tied(t: TensorInfo, first: TensorRef, written: dict[str, int], chunks: Iterable[np.ndarray]) -> int:
    """Takes the chunks of a name that shares the storage of one written before, checking that they equal what
    was written (by their CRC-32); returns their byte count.

    Raises:
        UnsupportedError: when they differ (a clip that changed one name of a tied pair and not the other).
    """
    n = 0
    crc = 0
    for chunk in chunks:
        if isinstance(chunk, FileRange):
            crc, n = chunk.crc(crc), n + chunk.nbytes
            continue
        data = _bytes_of(chunk)
        crc = crc32(data, crc)
        n += data.nbytes
    if (n, crc) != (first.tensor.nbytes, written[first.key]):
        raise UnsupportedError(
            f"shares its storage with {first.tensor.name!r} (tied weights), but this write changes one and not "
            "the other: select both or neither, or write .safetensors (which holds them apart)",
            t.file,
            t.name,
        )
    return n


def _collect(obj: Any, refs: list[TensorRef]) -> None:
    """The tensors an object holds, in the order its pickle names them."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if type(o) is TensorRef:
            refs.append(o)
        elif isinstance(o, dict):
            stack.extend(reversed([x for kv in o.items() for x in kv]))
        elif type(o) in (list, tuple):
            stack.extend(reversed(o))
        elif type(o) is Call and o.args:
            stack.extend(reversed(o.args))


def check_tensor(t: TensorInfo) -> None:
    """Refuses a tensor whose dtype a .pt does not hold (as clipcli writes it).

    Raises:
        UnsupportedError: naming the dtype.
    """
    if t.dtype not in STORAGE or t.array_dtype is None:
        raise UnsupportedError(
            f"dtype {t.dtype} has no place in a .pt written by clipcli; give --exclude {shlex.quote(t.name)} to "
            "write the other tensors, or write .npz"
        )


def _layout_keys(tensors: list[TensorInfo]) -> frozenset[str]:
    """The metadata keys that say how the input's files were written, not what they hold (safetensors'
    `format`): left out of a .pt, as `diff` leaves them out."""
    from clipcli.checkpoint import registry  # here: the registry imports the formats

    keys: frozenset[str] = frozenset()
    for name in {registry.named_by(Path(t.file).name) for t in tensors}:
        if name is not None:
            keys |= registry.get(name).layout_keys
    return keys


def check_file(
    target: Path, tensors: list[TensorInfo], source_format: str, metadata: dict[str, str], store: Store = LOCAL
) -> None:
    """Refuses, before anything is written, a TorchScript archive written over itself (its program would be lost)
    and metadata a .pt output does not hold (`_layout`): from a torch.save file, a leaf that is not plain data (a
    placeholder); from any other input (a TorchScript archive's included), any but the layout keys (strings of a
    safetensors header, the leaves of PyTorch shards or of a distributed checkpoint): a state dict has no place
    for them.

    Raises:
        UsageError: for a TorchScript archive replaced in place.
        UnsupportedError: saying what, and that --drop-metadata writes the tensors without it.
    """
    source = _torch_source(tensors, store) if tensors else None
    if source is not None and source[2] and _same_file(target, source[0]):
        raise UsageError(
            "is a TorchScript archive: writing it in place would replace its program (code/, constants.pkl) by a "
            "state dict, which torch.jit.load cannot load; write its state dict with -o OUT.pt, or -o OUT.safetensors",
            source[0],
            "--in-place",
        )
    try:
        kept = [key for key in metadata if key not in _layout_keys(tensors)]
        n = len(kept)
        keys = ", ".join(kept[:5]) + (", ..." if n > 5 else "")
        # the structure of a PyTorch source is found through its tensors' file: without one, an empty list
        # or tuple would come back an empty OrderedDict
        if not tensors and (kept or source_format == "torch"):
            if kept:
                what = f"no tensor, only metadata ({n:,} {'entry' if n == 1 else 'entries'}: {keys}), which"
            else:
                what = "no tensor (an empty container), and"
            raise UnsupportedError(
                f"the {source_format} checkpoint holds {what} clipcli writes to a .pt only around the tensors it "
                "holds; copy the file to keep it as it is, or write .safetensors (its header keeps each entry as a "
                "string)"
            )
        if kept and (source is None or source[2]):
            raise UnsupportedError(
                f"the metadata ({n:,} {'entry' if n == 1 else 'entries'}: {keys}) of a {source_format} checkpoint "
                "has no place in a .pt (a state dict of tensors); give --drop-metadata to write the tensors "
                "without it"
            )
        _layout(tensors, metadata, store)
    except UnsupportedError as e:
        e.path = str(target)
        raise


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False
