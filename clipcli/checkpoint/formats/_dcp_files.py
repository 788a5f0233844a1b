"""A distributed checkpoint's files: where `storage_data` places each chunk and item, and the torch.save records
there, each file checked once and each byte range read once."""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from clipcli.checkpoint.formats._dcp_records import DcpObject
from clipcli.checkpoint.formats._pickle import a_kind, with_article
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats._torch_zip import MAX_PICKLE
from clipcli.checkpoint.formats.torch import TorchTensor, read_torch
from clipcli.checkpoint.plugin import defect
from clipcli.checkpoint.source import Store
from clipcli.errors import ClipcliError, FileTypeError, InputError, MalformedError, MissingFileError, UnsupportedError

METADATA = ".metadata"
_MAX_INDEX = 1 << 63  # sizes and offsets are int64 in torch
_RENAMES = 250_000  # names that a byte range named by several entries may make again, at least (each costs ~10 µs)


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


@dataclass(frozen=True)
class Location:
    """Where one chunk or item lies: bytes [offset, offset + length) of a file of the checkpoint."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


# where each chunk (name, offsets) and item (name, None) lies
Locations = dict[tuple[str, tuple[int, ...] | None], Location]


def storage_locations(root: DcpObject) -> Locations:
    """`storage_data` by (name, chunk offsets); the offsets are None for a non-tensor item."""
    data = root.get("storage_data")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MalformedError(f"storage_data is {a_kind(data)}, not a dict")
    out: Locations = {}
    for index, info in data.items():
        if not (isinstance(index, DcpObject) and index.cls == "MetadataIndex"):
            raise MalformedError(f"storage_data is keyed by {a_kind(index)}, not a MetadataIndex")
        fqn, offset = index.get("fqn"), index.get("offset")
        if type(fqn) is not str:
            raise MalformedError(f"a MetadataIndex names {a_kind(fqn)}")
        offsets = None if offset is None else checked_dims(offset, "offset of a MetadataIndex", fqn)
        if not (isinstance(info, DcpObject) and info.cls == "_StorageInfo"):
            raise MalformedError(f"storage_data holds {a_kind(info)}, not a _StorageInfo", tensor=fqn)
        location = _location(info, fqn)
        if (fqn, offsets) in out:
            raise MalformedError(f"storage_data places the {entry_text(offsets)} twice", tensor=fqn)
        out[(fqn, offsets)] = location
    return out


def _location(info: DcpObject, fqn: str) -> Location:
    path, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    transforms = info.get("transform_descriptors")
    if type(path) is not str:
        raise MalformedError(f"a _StorageInfo's relative_path is {a_kind(path)}", tensor=fqn)
    if not (type(offset) is int and type(length) is int and 0 <= offset < _MAX_INDEX and 0 <= length < _MAX_INDEX):
        raise MalformedError("a _StorageInfo's offset or length is not a non-negative integer", tensor=fqn)
    if transforms is None:
        transforms = ()
    if type(transforms) not in (list, tuple) or not all(type(t) is str for t in transforms):
        raise MalformedError(f"a _StorageInfo's transform_descriptors is {a_kind(transforms)}", tensor=fqn)
    return Location(path, offset, length, tuple(transforms))


def checked_dims(value: Any, what: str, fqn: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or not all(type(d) is int and 0 <= d < _MAX_INDEX for d in value):
        raise MalformedError(f"the {what} is not a tuple of non-negative integers", tensor=fqn)
    return tuple(value)


def entry_text(offsets: tuple[int, ...] | None) -> str:
    return "item" if offsets is None else f"chunk at offsets {offsets}"


# -- the files and what they hold ---------------------------------------------------------------------


class Files:
    """The bytes `storage_data` points at: files checked once each, byte ranges read once each."""

    def __init__(self, directory: Path, locations: Locations, where: Path, store: Store, collect: bool = False):
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
        self.used: list[tuple[str, tuple[int, ...] | None, Location]] | None = [] if collect else None
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
                f"the chunk at offsets {offsets} holds {with_article(t.dtype_name)} tensor of shape {t.shape}, "
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
                f"the {entry_text(offsets)} is not in storage_data: nothing says where it lies", self.where, fqn
            )
        if self.used is not None:
            self.used.append((fqn, offsets, location))
        path, size = self._file(location.relative_path, fqn)
        start, end = location.offset, location.offset + location.length
        if end > size:
            raise defect(
                "short-file",
                f"the {entry_text(offsets)} lies at bytes {start}..{end} of the file, which holds {size}",
                path,
                fqn,
            )
        if location.transforms:
            raise UnsupportedError(
                f"the {entry_text(offsets)} is stored through the transform {', '.join(location.transforms)[:200]} "
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
                raise error_type(f"the {entry_text(offsets)} (bytes {start}..{end}): {e.message}", path, tensor) from e
        first, metadata, tensors = self.read[key]
        if first != fqn:
            self.renames -= len(metadata) + len(tensors)
            if self.renames < 0:
                raise MalformedError(
                    f"the {entry_text(offsets)} (bytes {start}..{end}) is named by so many entries that their names "
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
            f"the {entry_text(offsets)} is stored in DCP's safetensors format (SerializationFormat.SAFETENSORS); "
            "clipcli reads distributed checkpoints in torch.save format, torch's default",
            path,
            fqn,
        )
