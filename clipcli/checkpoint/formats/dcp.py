"""PyTorch distributed checkpoints (torch.distributed.checkpoint, Megatron's torch_dist) read without torch.

A distributed checkpoint ("DCP") is a directory. Its `.metadata` is a pickle of DCP's `Metadata`:
`state_dict_metadata` gives every fully qualified name either a tensor (global shape, dtype, and the
chunks it was saved in, each at its offsets in the global tensor) or a non-tensor item; `storage_data`
says where each chunk and item lies: bytes [offset, offset + length) of a `.distcp` file, each a
complete torch.save file. The pickle runs on clipcli's restricted machine (`_pickle`), which resolves the
classes and functions DCP's metadata names to plain records here and makes any other global an inert,
audited placeholder (the read fails only where one stands in place of a record it needs);
the torch.save files are read by `_torch`, through `_dcp_files` (where each lies, each file checked once).
Nothing of torch is imported or run, and no tensor data is
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
from pathlib import Path
from typing import Any

import numpy as np

from clipcli.checkpoint.formats._dcp_files import (
    METADATA,
    DcpChunk,
    DcpTensor,
    Files,
    Location,
    checked_dims,
    entry_text,
    storage_locations,
)
from clipcli.checkpoint.formats._dcp_layout import layout_error
from clipcli.checkpoint.formats._dcp_records import TRUSTED, DcpObject, resolve
from clipcli.checkpoint.formats._pickle import a_kind, unpickle
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats.torch import (
    MAX_PICKLE,
    dtype_of,
    is_contiguous,
    view_byte_range,
)
from clipcli.checkpoint.plugin import Finding, Format, Opened, defect
from clipcli.checkpoint.source import LOCAL, Store, size_of
from clipcli.checkpoint.tensor import Held, Piece, Pieces, TensorInfo, check_elements
from clipcli.checkpoint.zipmember import crc_findings
from clipcli.errors import ClipcliError, InputError, MalformedError, MissingFileError, UnsupportedError

__all__ = ["METADATA", "DcpChunk", "DcpTensor", "is_dcp", "read_dcp"]

# what names the metadata class in the first bytes of a .metadata pickle (Megatron's subclass included)
_SIGNATURES = (b"torch.distributed.checkpoint", b"megatron.core.dist_checkpointing")


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
    """Whether `directory` holds a `.metadata` file that looks like a distributed checkpoint's, or one beside
    `.distcp` files (a damaged one: reading it then says what is wrong with it).

    Only the file's first bytes are read: a pickle (protocol 2 to 5) that names DCP's or Megatron's
    metadata class. A directory that cannot be read is not one.
    """
    path = Path(directory) / METADATA
    try:
        if store.kind(path) != "file":
            return False
        with store.open(path) as f:
            head = f.read(1024)
        if len(head) > 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and any(s in head for s in _SIGNATURES):
            return True
        return any(p.name.endswith(".distcp") for p in store.list(Path(directory)))
    except OSError:
        return False


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
        MalformedError: when the checkpoint breaks the format (UnsafePickleError when a pickle runs an
            opcode clipcli never runs); a foreign global is a placeholder, counted in `audit`.
        UnsupportedError: for storage transforms, DCP's safetensors format, dtypes or versions clipcli
            does not read.
    """
    directory = Path(directory)
    where = directory / METADATA
    root = _read_metadata(where, store, audit or Audit())
    try:
        _check_version(root)
        items = _state_dict_items(root)
        files = Files(directory, storage_locations(root), where, store)
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
        root = unpickle(data, resolve, audit=audit, placeholders=True)
    except ClipcliError as e:
        e.path = str(where)
        raise
    if not (isinstance(root, DcpObject) and root.cls == "Metadata"):
        raise MalformedError(f"the pickle holds {a_kind(root)}, not a distributed checkpoint's Metadata", where)
    return root


def _state_dict_items(root: DcpObject) -> list[tuple[str, DcpObject]]:
    """(name, TensorStorageMetadata or BytesStorageMetadata) for each item of `state_dict_metadata`."""
    items = root.get("state_dict_metadata")
    if not isinstance(items, dict):
        raise MalformedError(f"state_dict_metadata is {a_kind(items)}, not a dict")
    out = []
    for fqn, entry in items.items():
        if type(fqn) is not str:
            raise MalformedError(f"state_dict_metadata has {a_kind(fqn)} as a name")
        if not (isinstance(entry, DcpObject) and entry.cls in ("TensorStorageMetadata", "BytesStorageMetadata")):
            raise MalformedError(f"the item is {a_kind(entry)}, not tensor or bytes metadata", tensor=fqn)
        out.append((fqn, entry))
    return out


def _check_version(root: DcpObject) -> None:
    version = root.get("version")
    if version is None:  # torch < 2.4 wrote none
        return
    if type(version) is not str:
        raise MalformedError(f"the metadata's version is {a_kind(version)}")
    if version.split(".")[0] != "1":
        raise UnsupportedError(f"distributed checkpoint metadata version {version[:20]!r} (clipcli reads 1.x)")


# -- tensors ---------------------------------------------------------------------------------------------


def _tensor(fqn: str, entry: DcpObject, files: Files) -> DcpTensor:
    """One tensor of `state_dict_metadata` with its chunks, each checked against its torch.save file."""
    try:
        dtype, dtype_name = _tensor_dtype(entry, fqn)
        shape = checked_dims(entry.get("size"), "global shape", fqn)
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
        raise MalformedError(f"the tensor's properties are {a_kind(properties)}", tensor=fqn)
    found = dtype_of(properties.get("dtype"))
    if found is None:
        raise MalformedError(f"the tensor's dtype is {a_kind(properties.get('dtype'))}", tensor=fqn)
    return found


def _boxes(chunks: Any, ndim: int, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of every chunk, each of the tensor's rank."""
    if type(chunks) is not list:
        raise MalformedError(f"the tensor's chunks are {a_kind(chunks)}, not a list", tensor=fqn)
    boxes = []
    for chunk in chunks:
        if not (isinstance(chunk, DcpObject) and chunk.cls == "ChunkStorageMetadata"):
            raise MalformedError(f"a chunk is {a_kind(chunk)}, not a ChunkStorageMetadata", tensor=fqn)
        offsets = checked_dims(chunk.get("offsets"), "offset of a chunk", fqn)
        sizes = checked_dims(chunk.get("sizes"), "shape of a chunk", fqn)
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
        files = Files(directory, storage_locations(root), where, store, collect=True)
    except MalformedError as e:
        return [Finding.of(e, "malformed", where)]
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
    return out + _shared_regions(directory, files.used or []) + _crc_regions(directory, files.used or [], store)


def _crc_regions(
    directory: Path, used: list[tuple[str, tuple[int, ...] | None, Location]], store: Store
) -> list[Finding]:
    """The zip records of each chunk's torch.save archive whose bytes do not match their CRC-32 (as verify finds
    them in a .pt), every record read through once; an item of bytes, which is no archive, has none."""
    out = []
    for fqn, _, at in dict.fromkeys(used):
        if at.length:
            where = directory / at.relative_path
            try:
                out += crc_findings(where, store, lambda m, f=fqn: f, zero_is_none=True, window=(at.offset, at.length))
            except (OSError, InputError):  # a file missing or unreadable: its finding is the chunk's already
                continue
    return out


def _shared_regions(directory: Path, used: list[tuple[str, tuple[int, ...] | None, Location]]) -> list[Finding]:
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
                problem = f"its {entry_text(offsets)} shares {shared} with the {entry_text(last[1])} of {last[0]}"
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


FORMAT = Format("distcp", recognises=is_dcp, open=_open, findings=findings, markers=(METADATA,))
