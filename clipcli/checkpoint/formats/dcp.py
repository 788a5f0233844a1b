"""PyTorch distributed checkpoints (torch.distributed.checkpoint, Megatron's torch_dist) read without torch.

A distributed checkpoint ("DCP") is a directory. Its `.metadata` is a pickle of DCP's `Metadata`:
`state_dict_metadata` gives every fully qualified name either a tensor (global shape, dtype, and the
chunks it was saved in, each at its offsets in the global tensor) or a non-tensor item; `storage_data`
says where each chunk and item lies: bytes [offset, offset + length) of a `.distcp` file, each a
complete torch.save file. The pickle runs on clipcli's restricted machine (`_pickle`) with an allowlist
of exactly the classes and functions that DCP's metadata names, each resolved to a plain record here;
the torch.save files are read by `_torch`. Nothing of torch is imported or run, and no tensor data is
read: `read_dcp` returns where every chunk's bytes are, checked.

Choices where torch leaves room:

- Non-tensor items (a `step` counter, `optim.param_groups.0.lr`) become metadata rendered as `_torch`
  renders the leaves of a torch.save file (`3`, `0.001`, `None`); an item that is a container flattens
  under its name as `_torch` flattens one (the tuple `optim.param_groups.0.betas` gives
  `optim.param_groups.0.betas.0` and `.1`; an empty one is `[]`, `{}` or `()`). Their pickles obey the
  rules of any torch.save file: a global off `_torch`'s allowlist (an `argparse.Namespace`, `bytes`, an
  `io.BytesIO`) is an inert placeholder, a NumPy scalar a value, a NumPy array a tensor (its values held
  from the pickle), so no item makes the checkpoint unreadable. Every pickle of a `.distcp` file (items
  and chunks) is audited, one audit per file beside the audit of `.metadata`: torch's DCP reader loads
  items with `torch.load(weights_only=False)`, which would call what they name.
- A tensor that DCP stored inside a non-tensor item (it keeps a tuple of tensors whole) is a tensor
  of its own with one chunk: the whole tensor, at offsets 0.
- A chunk is a torch.save file of one tensor with the chunk's shape and the tensor's dtype. Torch
  writes a chunk that is a dense view as it is (a transposed or channels_last tensor), so a chunk's
  `TorchTensor` may have strides other than C order: read it by its strides (`_torch.is_contiguous`,
  `_torch.view_byte_range`), as a torch.save file's view is read.
- A tensor whose dtype has no NumPy type (complex32, quantized) is listed with a skip reason; its
  chunks are checked like any other's but must not be read.
- Storage transforms (`transform_descriptors`: compression, encryption) and DCP's safetensors
  serialization format (`SerializationFormat.SAFETENSORS`) are refused (UnsupportedError); torch 2.13
  writes neither by default. So is a metadata `version` other than 1.x.
- Entries of `storage_data` that no name of `state_dict_metadata` uses are ignored, as torch ignores them.
- Megatron's `torch_dist` directories also hold `metadata.json` and `common.pt`; only the DCP part is
  read. `common.pt` (iteration, Megatron's `args` namespace, RNG states: no tensors that a norm needs)
  is left out: it is no part of the DCP's `.metadata`, and can be read on its own as a `.pt`. The
  records that Megatron adds to `.metadata` (its `MCoreMetadata`, the save plans it keeps in
  `all_local_plans`) are read and ignored.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from clipcli.checkpoint.formats._dcp_layout import layout_error
from clipcli.checkpoint.formats._dcp_records import TRUSTED, DcpObject, resolve
from clipcli.checkpoint.formats._pickle import kind, unpickle
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats.torch import (
    MAX_PICKLE,
    TorchTensor,
    dtype_of,
    is_contiguous,
    read_torch,
    view_byte_range,
)
from clipcli.checkpoint.plugin import Finding, Format, Opened, defect
from clipcli.checkpoint.source import LOCAL, Store, size_of
from clipcli.checkpoint.tensor import Held, Piece, Pieces, TensorInfo, check_elements
from clipcli.errors import ClipcliError, FileTypeError, InputError, MalformedError, MissingFileError, UnsupportedError

__all__ = ["METADATA", "DcpChunk", "DcpTensor", "is_dcp", "read_dcp"]

METADATA = ".metadata"
_MAX_INDEX = 1 << 63  # sizes and offsets are int64 in torch
_RENAMES = 250_000  # names that a byte range named by several entries may make again, at least (each costs ~10 µs)
# what names the metadata class in the first bytes of a .metadata pickle (Megatron's subclass included)
_SIGNATURES = (b"torch.distributed.checkpoint", b"megatron.core.dist_checkpointing")


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: where it lies in the global tensor and in the checkpoint's files."""

    offsets: tuple[int, ...]  # where the chunk starts in the global tensor
    sizes: tuple[int, ...]  # its shape
    file: Path  # the .distcp file holding it
    tensor: TorchTensor  # the chunk as _torch.read_torch reads it at [offset, offset + length) of `file`


@dataclass(frozen=True)
class DcpTensor:
    """One tensor of a distributed checkpoint: its global shape and type, and the chunks that tile it.

    The chunks lie inside the tensor, never overlap and leave no hole. A tensor with a `skip_reason`
    is listed but must not be read.
    """

    name: str  # the fully qualified name as in .metadata ("model.layers.0.weight", "optim.state.w.exp_avg")
    dtype: np.dtype | None  # native NumPy / ml_dtypes dtype; None when skipped
    dtype_name: str  # 'float32', 'bfloat16', ... (or torch's name for types without one)
    shape: tuple[int, ...]  # the global shape
    chunks: tuple[DcpChunk, ...]  # in the order of .metadata
    skip_reason: str | None


def open_directory(
    directory: Path, store: Store = LOCAL, audit: Audit | None = None, file_audits: dict[str, Audit] | None = None
) -> tuple[dict[str, str], list[TensorInfo]]:
    """The metadata and tensors of a distributed checkpoint, each tensor read in its own C order from its
    chunks (`Pieces`), never consolidated; `audit` counts what `.metadata`'s pickle names and calls,
    `file_audits` what the torch.save files in each `.distcp` file name and call (as `read_dcp`)."""
    metadata, tensors = read_dcp(directory, store, audit, file_audits)
    out = []
    for t in tensors:
        first = str(t.chunks[0].file) if t.chunks else str(directory)
        nbytes = math.prod(t.shape) * t.dtype.itemsize if t.dtype is not None else 0
        if t.dtype is None:
            out.append(TensorInfo(t.name, t.dtype_name, t.shape, nbytes, first, None, skip=t.skip_reason))
            continue
        held = t.chunks[0].tensor.held if len(t.chunks) == 1 else None
        if held is not None:  # a NumPy array pickled in an item: its values came with the pickle
            out.append(TensorInfo(t.name, t.dtype_name, t.shape, nbytes, first, t.dtype, location=Held(held)))
            continue
        pieces = tuple(_piece(c) for c in t.chunks if math.prod(c.sizes))
        location = Pieces(t.shape, t.dtype.itemsize, pieces)
        big = any(c.tensor.big_endian for c in t.chunks) and t.dtype.itemsize > 1
        info = TensorInfo(t.name, t.dtype_name, t.shape, nbytes, first, t.dtype, location=location)
        out.append(dataclasses.replace(info, stored_dtype=t.dtype.newbyteorder(">") if big else None))
    return metadata, out


def _piece(c: DcpChunk) -> Piece:
    start, end = view_byte_range(c.tensor)
    strides = None if is_contiguous(c.tensor) else (c.tensor.strides, end - start)
    return Piece(c.offsets, c.sizes, str(c.file), start, strides)


def is_dcp(directory: Path, store: Store = LOCAL) -> bool:
    """Whether `directory` holds a `.metadata` file that looks like a distributed checkpoint's.

    Only the file's first bytes are read: a pickle (protocol 2 to 5) that names DCP's or Megatron's
    metadata class. A directory that cannot be read is not one.
    """
    path = Path(directory) / METADATA
    try:
        if store.kind(path) != "file":
            return False
        with store.open(path) as f:
            head = f.read(1024)
    except OSError:
        return False
    return len(head) > 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and any(s in head for s in _SIGNATURES)


def read_dcp(
    directory: Path, store: Store = LOCAL, audit: Audit | None = None, file_audits: dict[str, Audit] | None = None
) -> tuple[dict[str, str], list[DcpTensor]]:
    """The non-tensor items (as metadata) and the tensors of a distributed checkpoint, checked.

    Reads `.metadata` and, for every chunk and item, the torch.save file's directory and pickle; never
    the tensors' data. Every chunk lies inside its tensor, the chunks of a tensor tile it exactly,
    every byte range lies inside its file, every file inside the directory.

    Args:
        directory: the checkpoint's directory (the one holding `.metadata`).
        store: where its files are (by default the file system).
        audit: counts what the pickle of `.metadata` names and calls.
        file_audits: filled with an `Audit` per `.distcp` file (by its path) of what the pickles of the
            torch.save files it holds (chunks and items) name and call.

    Returns:
        The non-tensor items by name, rendered as text, and the tensors in the order of `.metadata`.

    Raises:
        MissingFileError: when `.metadata` or a file it lists does not exist.
        MalformedError: when the checkpoint breaks the format (UnsafePickleError when a pickle asks
            for code).
        UnsupportedError: for storage transforms, DCP's safetensors format, dtypes or versions clipcli
            does not read.
    """
    directory = Path(directory)
    where = directory / METADATA
    root = _read_metadata(where, store, audit or Audit())
    try:
        _check_version(root)
        items = _state_dict_items(root)
        files = _Files(directory, _locations(root), where, store)
    except ClipcliError as e:
        e.path = e.path or str(where)
        raise
    if file_audits is not None:
        files.audits = file_audits
    metadata: dict[str, str] = {}
    tensors: list[DcpTensor] = []
    names: set[str] = set()

    def claim(name: str) -> None:
        if name in names:
            raise MalformedError("two entries of the checkpoint have this name", where, name)
        names.add(name)

    for fqn, entry in items:
        if entry.cls == "BytesStorageMetadata":
            item_metadata, inner = files.item(fqn)
            for name, text in item_metadata.items():
                claim(name)
                metadata[name] = text
            for t in inner:
                claim(t.name)
                tensors.append(t)
        else:
            claim(fqn)
            tensors.append(_tensor(fqn, entry, files))
    return metadata, tensors


# -- .metadata ---------------------------------------------------------------------------------------


def _read_metadata(where: Path, store: Store, audit: Audit) -> DcpObject:
    """The unpickled `.metadata`: DCP's Metadata (or Megatron's subclass)."""
    try:
        with store.open(where) as f:
            size = size_of(f)
            if size > MAX_PICKLE:
                raise MalformedError(f"{size} bytes of metadata, more than clipcli reads ({MAX_PICKLE})", where)
            data = f.read(size + 1)
    except FileNotFoundError as e:
        raise MissingFileError(f"no {METADATA} file: not a distributed checkpoint", where.parent) from e
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", where) from e
    try:
        root = unpickle(data, resolve, audit=audit)
    except ClipcliError as e:
        e.path = str(where)
        raise
    if not (isinstance(root, DcpObject) and root.cls == "Metadata"):
        raise MalformedError(f"the pickle holds a {kind(root)}, not a distributed checkpoint's Metadata", where)
    return root


def _state_dict_items(root: DcpObject) -> list[tuple[str, DcpObject]]:
    """(name, TensorStorageMetadata or BytesStorageMetadata) for each item of `state_dict_metadata`."""
    items = root.get("state_dict_metadata")
    if not isinstance(items, dict):
        raise MalformedError(f"state_dict_metadata is a {kind(items)}, not a dict")
    out = []
    for fqn, entry in items.items():
        if type(fqn) is not str:
            raise MalformedError(f"state_dict_metadata has a {kind(fqn)} as a name")
        if not (isinstance(entry, DcpObject) and entry.cls in ("TensorStorageMetadata", "BytesStorageMetadata")):
            raise MalformedError(f"the item is a {kind(entry)}, not tensor or bytes metadata", tensor=fqn)
        out.append((fqn, entry))
    return out


@dataclass(frozen=True)
class _Location:
    """Where one chunk or item lies: bytes [offset, offset + length) of a file of the checkpoint."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


# where each chunk (name, offsets) and item (name, None) lies
_Locations = dict[tuple[str, tuple[int, ...] | None], _Location]


def _locations(root: DcpObject) -> _Locations:
    """`storage_data` by (name, chunk offsets); the offsets are None for a non-tensor item."""
    data = root.get("storage_data")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MalformedError(f"storage_data is a {kind(data)}, not a dict")
    out: _Locations = {}
    for index, info in data.items():
        if not (isinstance(index, DcpObject) and index.cls == "MetadataIndex"):
            raise MalformedError(f"storage_data is keyed by a {kind(index)}, not a MetadataIndex")
        fqn, offset = index.get("fqn"), index.get("offset")
        if type(fqn) is not str:
            raise MalformedError(f"a MetadataIndex names a {kind(fqn)}")
        offsets = None if offset is None else _dims(offset, "offset of a MetadataIndex", fqn)
        if not (isinstance(info, DcpObject) and info.cls == "_StorageInfo"):
            raise MalformedError(f"storage_data holds a {kind(info)}, not a _StorageInfo", tensor=fqn)
        location = _location(info, fqn)
        if (fqn, offsets) in out:
            raise MalformedError(f"storage_data places the {_what(offsets)} twice", tensor=fqn)
        out[(fqn, offsets)] = location
    return out


def _location(info: DcpObject, fqn: str) -> _Location:
    path, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    transforms = info.get("transform_descriptors")
    if type(path) is not str:
        raise MalformedError(f"a _StorageInfo's relative_path is a {kind(path)}", tensor=fqn)
    if not (type(offset) is int and type(length) is int and 0 <= offset < _MAX_INDEX and 0 <= length < _MAX_INDEX):
        raise MalformedError("a _StorageInfo's offset or length is not a non-negative integer", tensor=fqn)
    if transforms is None:
        transforms = ()
    if type(transforms) not in (list, tuple) or not all(type(t) is str for t in transforms):
        raise MalformedError(f"a _StorageInfo's transform_descriptors is a {kind(transforms)}", tensor=fqn)
    return _Location(path, offset, length, tuple(transforms))


def _check_version(root: DcpObject) -> None:
    version = root.get("version")
    if version is None:  # torch < 2.4 wrote none
        return
    if type(version) is not str:
        raise MalformedError(f"the metadata's version is a {kind(version)}")
    if version.split(".")[0] != "1":
        raise UnsupportedError(f"distributed checkpoint metadata version {version[:20]!r} (clipcli reads 1.x)")


def _dims(value: Any, what: str, fqn: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or not all(type(d) is int and 0 <= d < _MAX_INDEX for d in value):
        raise MalformedError(f"the {what} is not a tuple of non-negative integers", tensor=fqn)
    return tuple(value)


def _what(offsets: tuple[int, ...] | None) -> str:
    return "item" if offsets is None else f"chunk at offsets {offsets}"


# -- the files and what they hold ---------------------------------------------------------------------


class _Files:
    """The bytes `storage_data` points at: files checked once each, byte ranges read once each."""

    def __init__(self, directory: Path, locations: _Locations, where: Path, store: Store, collect: bool = False):
        self.directory = directory
        self.store = store
        self.locations = locations
        self.where = where  # .metadata, for messages about what it says
        self.root: Path | None = None
        self.files: dict[str, tuple[Path, int]] = {}
        # read_torch's answer for each byte range, under the name it was read as: crafted metadata may point
        # many entries at one range, each of which takes that answer renamed, not a parse of its own
        self.read: dict[tuple[str, int, int], tuple[str, dict[str, str], list[TorchTensor]]] = {}
        # names that answers given again may make: as many as the metadata's size justifies
        self.renames = _RENAMES + 4 * len(locations)
        # with `collect` (for `findings`), each chunk and item looked up, in order
        self.used: list[tuple[str, tuple[int, ...] | None, _Location]] | None = [] if collect else None
        self.audits: dict[str, Audit] = {}  # what the pickles of each file name and call, by its path

    def item(self, fqn: str) -> tuple[dict[str, str], list[DcpTensor]]:
        """The metadata and tensors of one non-tensor item: a torch.save file of any object."""
        path, metadata, inner = self._torch_save(fqn, None)
        tensors = [
            DcpTensor(
                t.name,
                t.dtype,
                t.dtype_name,
                t.shape,
                (DcpChunk((0,) * len(t.shape), t.shape, path, t),),
                t.skip_reason,
            )
            for t in inner
        ]
        return metadata, tensors

    def chunk(
        self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype_name: str, skip: bool
    ) -> DcpChunk:
        """One chunk of a tensor: a torch.save file of one tensor of the chunk's shape and the tensor's dtype."""
        path, metadata, inner = self._torch_save(fqn, offsets)
        if metadata or len(inner) != 1 or inner[0].name != fqn:  # read as an item named fqn: only a tensor is fqn
            raise MalformedError(
                f"the chunk at offsets {offsets} is a torch.save file of something other than one tensor", path, fqn
            )
        t = inner[0]
        if t.shape != sizes or t.dtype_name != dtype_name:
            raise MalformedError(
                f"the chunk at offsets {offsets} holds a {t.dtype_name} tensor of shape {t.shape}, "
                f"where {dtype_name} of shape {sizes} belongs",
                path,
                fqn,
            )
        if t.skip_reason is not None and not skip:
            raise MalformedError(f"the chunk at offsets {offsets} is a {t.skip_reason}", path, fqn)
        return DcpChunk(offsets, sizes, path, t)

    def _torch_save(self, fqn: str, offsets: tuple[int, ...] | None) -> tuple[Path, dict[str, str], list[TorchTensor]]:
        """The torch.save file of a chunk (offsets) or item (None), read as an item named `fqn`."""
        location = self.locations.get((fqn, offsets))
        if location is None:
            raise MalformedError(
                f"the {_what(offsets)} is not in storage_data: nothing says where it lies", self.where, fqn
            )
        if self.used is not None:
            self.used.append((fqn, offsets, location))
        path, size = self._file(location.relative_path, fqn)
        start, end = location.offset, location.offset + location.length
        if end > size:
            raise defect(
                "short-file",
                f"the {_what(offsets)} lies at bytes {start}..{end} of the file, which holds {size}",
                path,
                fqn,
            )
        if location.transforms:
            raise UnsupportedError(
                f"the {_what(offsets)} is stored through the transform {', '.join(location.transforms)[:200]} "
                "(compression or encryption); clipcli reads only untransformed distributed checkpoints",
                path,
                fqn,
            )
        key = (str(path), start, end)
        if key not in self.read:
            if offsets is not None:
                _refuse_safetensors(self.store, path, start, fqn, offsets)
            try:
                audit = self.audits.setdefault(str(path), Audit())
                self.read[key] = (fqn, *read_torch(path, start, end, fqn, self.store, audit))
            except ClipcliError as e:
                # a chunk's messages name its tensor; an item's name the entry inside it, if any
                tensor = fqn if offsets is not None or e.tensor is None else e.tensor
                error_type = MalformedError if isinstance(e, FileTypeError) else type(e)  # it must be a torch.save file
                raise error_type(f"the {_what(offsets)} (bytes {start}..{end}): {e.message}", path, tensor) from e
        first, metadata, tensors = self.read[key]
        if first != fqn:
            self.renames -= len(metadata) + len(tensors)
            if self.renames < 0:
                raise MalformedError(
                    f"the {_what(offsets)} (bytes {start}..{end}) is named by so many entries that their names "
                    "would not end",
                    path,
                    fqn,
                )
            metadata, tensors = _renamed(first, fqn, metadata, tensors)
        return path, metadata, tensors

    def _file(self, relative: str, fqn: str) -> tuple[Path, int]:
        """A file `storage_data` names, checked to be a regular file inside the directory, and its size."""
        known = self.files.get(relative)
        if known is not None:
            return known
        parts = PurePosixPath(relative).parts
        if not relative or "\x00" in relative or "\\" in relative or relative.startswith("/") or ".." in parts:
            raise MalformedError(
                f"the file {relative[:200]!r} is not a plain path inside the checkpoint", self.directory, fqn
            )
        path = self.directory / relative
        try:
            size = self.store.size(path)  # raises as the file system says
            kind = self.store.kind(path)
            if self.root is None:
                self.root = self.store.real(self.directory)
            real = self.store.real(path)
        except FileNotFoundError as e:
            raise MissingFileError(f"{relative}, which {METADATA} lists, does not exist", self.directory, fqn) from e
        except OSError as e:
            raise InputError(f"cannot read {relative}: {e.strerror or e}", self.directory, fqn) from e
        if kind != "file":
            raise MalformedError(f"{relative}, which {METADATA} lists, is not a regular file", self.directory, fqn)
        if not real.is_relative_to(self.root):
            raise MalformedError(f"{relative} leads outside the checkpoint's directory", self.directory, fqn)
        self.files[relative] = (path, size)
        return self.files[relative]


def _renamed(
    old: str, new: str, metadata: dict[str, str], tensors: list[TorchTensor]
) -> tuple[dict[str, str], list[TorchTensor]]:
    """What a torch.save file read as the item `old` holds, as read as the item `new` (`old.key` is `new.key`)."""

    def rename(name: str) -> str:
        return new + name[len(old) :]

    renamed = [dataclasses.replace(t, name=rename(t.name)) for t in tensors]
    return {rename(k): v for k, v in metadata.items()}, renamed


def _refuse_safetensors(store: Store, path: Path, start: int, fqn: str, offsets: tuple[int, ...]) -> None:
    """Refuses a chunk written in DCP's safetensors format (raw bytes after a safetensors header)."""
    try:
        with store.open(path) as f:
            f.seek(start)
            head = f.read(9)
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path, fqn) from e
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < MAX_PICKLE:
        raise UnsupportedError(
            f"the {_what(offsets)} is stored in DCP's safetensors format (SerializationFormat.SAFETENSORS); "
            "clipcli reads distributed checkpoints in torch.save format, torch's default",
            path,
            fqn,
        )


# -- tensors ---------------------------------------------------------------------------------------------


def _tensor(fqn: str, entry: DcpObject, files: _Files) -> DcpTensor:
    """One tensor of `state_dict_metadata` with its chunks, each checked against its torch.save file."""
    try:
        dtype, dtype_name = _tensor_dtype(entry, fqn)
        shape = _dims(entry.get("size"), "global shape", fqn)
        boxes = _boxes(entry.get("chunks"), len(shape), fqn)
        check_elements(shape)
        problem = layout_error(shape, boxes)
        if problem is not None:
            kind = "chunk-overlap" if "overlap" in problem else "chunk-gap" if "hole" in problem else "chunk-outside"
            raise defect(kind, problem)
    except ClipcliError as e:
        e.path, e.tensor = e.path or str(files.where), fqn
        raise
    skip = None if dtype is not None else f"dtype {dtype_name} has no NumPy type"
    chunks = tuple(files.chunk(fqn, offsets, sizes, dtype_name, skip is not None) for offsets, sizes in boxes)
    return DcpTensor(fqn, dtype, dtype_name, shape, chunks, skip)


def _tensor_dtype(entry: DcpObject, fqn: str) -> tuple[np.dtype | None, str]:
    properties = entry.get("properties")
    if not (isinstance(properties, DcpObject) and properties.cls == "TensorProperties"):
        raise MalformedError(f"the tensor's properties are a {kind(properties)}", tensor=fqn)
    found = dtype_of(properties.get("dtype"))
    if found is None:
        raise MalformedError(f"the tensor's dtype is a {kind(properties.get('dtype'))}", tensor=fqn)
    return found


def _boxes(chunks: Any, ndim: int, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of every chunk, each of the tensor's rank."""
    if type(chunks) is not list:
        raise MalformedError(f"the tensor's chunks are a {kind(chunks)}, not a list", tensor=fqn)
    boxes = []
    for chunk in chunks:
        if not (isinstance(chunk, DcpObject) and chunk.cls == "ChunkStorageMetadata"):
            raise MalformedError(f"a chunk is a {kind(chunk)}, not a ChunkStorageMetadata", tensor=fqn)
        offsets = _dims(chunk.get("offsets"), "offset of a chunk", fqn)
        sizes = _dims(chunk.get("sizes"), "shape of a chunk", fqn)
        if len(offsets) != ndim or len(sizes) != ndim:
            raise MalformedError(
                f"the chunk at offsets {offsets} with shape {sizes} does not have the tensor's {ndim} dimensions",
                tensor=fqn,
            )
        boxes.append((offsets, sizes))
    return boxes


def findings(directory: Path, store: Store = LOCAL) -> list[Finding]:
    """Every defect of a distributed checkpoint that `read_dcp` meets, one per tensor and item rather than the
    first (a `.distcp` file missing or too short, chunks that leave a hole in a tensor or overlap, ...), and
    byte ranges that several chunks or items share (`region-twice`); from `.metadata` and the torch.save files'
    directories and pickles, never the tensors' data.

    Raises:
        InputError: for a `.metadata` clipcli cannot read at all.
    """
    where = directory / METADATA
    try:
        root = _read_metadata(where, store, Audit())
        _check_version(root)
        items = _state_dict_items(root)
        files = _Files(directory, _locations(root), where, store, collect=True)
    except MalformedError as e:
        return [Finding.of(e, "metadata", where)]
    out = []
    for fqn, entry in items:
        try:
            if entry.cls == "BytesStorageMetadata":
                files.item(fqn)
            else:
                _tensor(fqn, entry, files)
        except MissingFileError as e:
            out.append(Finding.of(e, "missing-file", where))
        except MalformedError as e:
            out.append(Finding.of(e, file=where))
    return out + _shared_regions(directory, files.used or [])


def _shared_regions(directory: Path, used: list[tuple[str, tuple[int, ...] | None, _Location]]) -> list[Finding]:
    """A finding for each chunk or item whose bytes overlap those of one before it in the same file."""
    out = []
    by_file: dict[str, list[tuple[int, int, str, tuple[int, ...] | None]]] = {}
    for fqn, offsets, at in dict.fromkeys(used):  # a name looked up twice is one use
        if at.length:
            by_file.setdefault(at.relative_path, []).append((at.offset, at.offset + at.length, fqn, offsets))
    for relative, regions in by_file.items():
        end, last = -1, None
        for start, stop, fqn, offsets in sorted(regions, key=lambda r: r[:2]):
            if start < end and last is not None:
                shared = f"bytes {start}..{min(stop, end)}"
                problem = f"its {_what(offsets)} shares {shared} with the {_what(last[1])} of {last[0]}"
                out.append(Finding(str(directory / relative), fqn, "region-twice", problem))
            if stop > end:
                end, last = stop, (fqn, offsets)
    return out


def _open(directory: Path, store: Store = LOCAL) -> Opened:
    audit, file_audits = Audit(), {}
    metadata, tensors = open_directory(directory, store, audit, file_audits)
    files = sorted({Path(t.file) for t in tensors})
    checked = audit.result(str(Path(directory) / METADATA), TRUSTED)
    # the torch.save files of the .distcp files: torch's DCP reader loads items with weights_only=False
    held = tuple(file_audits[name].result(name) for name in sorted(file_audits))
    return Opened(metadata, tensors, files, "distcp", sharded=True, audits=(checked, *held))


FORMAT = Format("distcp", recognises=is_dcp, open=_open, findings=findings)
