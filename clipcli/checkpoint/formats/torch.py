"""PyTorch `torch.save` files (zip and legacy) and TorchScript archives, read without torch: tensors and their bytes.

A `torch.save` file is a pickle whose tensors point at storages stored beside it: members
`<prefix>/data/<key>` of a zip archive (torch >= 1.6), or, in the legacy format, raw storages after the
pickle stream, each behind its element count. The pickle runs on clipcli's restricted machine
(`_pickle`) with an allowlist of the globals torch writes, each resolved to one of the constructors
of `_torch_records`; they build descriptions of tensors, never tensors. Nothing here reads a tensor's data.
A TorchScript archive (`torch.jit.save`, any suffix: `.pt`, `.jit`, `.ptl`) is the same zip with a program
beside the weights, known by its records (`constants.pkl`, `code/`), never by its first one: `_torchscript`
names its modules' parameters and buffers as `state_dict()` does, and its constants.

Names (`_torch_names`): nested dicts, lists and tuples flatten to dotted names (`state.0.exp_avg`); list and tuple items
are named by their index; a dict key that is not a string is written as its decimal (ints) or as a
Python literal (`None`, `1.5`, `(1, 'a')`). A tensor saved on its own (not in a container) is named
after the file's stem, as a .npy file is. Leaves that are not tensors become metadata: strings as they
are, other values as Python literals (`0.001`, `True`, `None`, `b'ab'`, `(1-2j)`, sets with their
members sorted, `{1, 2}`), dtypes and devices as torch prints them (`torch.float16`, `cuda:0`), empty
containers below the top as `{}`, `[]` and `()`. An OrderedDict's attributes (a state dict's
`_metadata` of module versions) are not metadata: torch.load does not show them as entries either.
"""

from __future__ import annotations

import copy
import lzma
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from clipcli.checkpoint.formats._common import first_zip_member
from clipcli.checkpoint.formats._pickle import (
    PickleTruncatedError,
    unpickle,
    unpickle_at,
)
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats._torch_names import flatten
from clipcli.checkpoint.formats._torch_records import (
    Storage,
    Storages,
    TorchTensor,
    dtype_of,
    is_contiguous,
    resolve,
    resolve_global,
    resolve_nothing,
    shared_storages,
    view_byte_range,
)
from clipcli.checkpoint.formats._torchscript import (
    SCRIPT_GLOBALS,
    SCRIPT_RECORDS,
    code_record,
    declared_classes,
    module_state,
)
from clipcli.checkpoint.formats.torch_write import check_file, check_tensor, write
from clipcli.checkpoint.plugin import Finding, Format, Opened, refusals
from clipcli.checkpoint.source import LOCAL, Store, size_of
from clipcli.checkpoint.tensor import Held, Piece, Pieces, Span, TensorInfo
from clipcli.checkpoint.zipmember import crc_findings, torch_record, zip_data_start
from clipcli.errors import (
    ClipcliError,
    FileTypeError,
    InputError,
    MalformedError,
    MissingFileError,
    UnsupportedError,
    shown_path,
)

__all__ = [
    "TorchTensor",
    "dtype_of",
    "is_contiguous",
    "open_file",
    "read_torch",
    "resolve_global",
    "shared_storages",
    "view_byte_range",
]

# Bytes of pickle clipcli reads: a state dict of 10^5 tensors takes ~10 MB; unpickled, a pickle can take
# up to ~100 times its size (an EMPTY_DICT opcode is 1 byte, a dict 64).
MAX_PICKLE = 256 << 20
MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # the first pickle of a legacy torch.save file
PROTOCOL_VERSION = 1001  # its second
_FIRST_WINDOW = 1 << 20  # bytes of a legacy file read first to find its pickles (grown 8-fold as needed)
MAX_CODE = 64 << 20  # bytes of one TorchScript code/ record (the source of a module's classes) clipcli reads
Resolver = Callable[[str, str], Any]  # a pickle's global (module, name) -> what the machine makes of it


# -- the file --------------------------------------------------------------------------------------


class _Region:
    """The bytes [start, end) of an open file, as a file object of their own (for zipfile)."""

    def __init__(self, f: BinaryIO, start: int, end: int):
        self._f = f
        self.start = start
        self.size = end - start
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self.size - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        self._f.seek(self.start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def pread(self, offset: int, n: int) -> bytes:
        self.seek(offset)
        return self.read(n)

    def close(self) -> None:
        pass  # the file belongs to read_torch


def open_audited(path: Path, store: Store = LOCAL) -> Opened:
    """`open_file`, with the pickle audit of the file (a TorchScript archive's own classes are no warning)."""
    audit = Audit()
    metadata, tensors, script = _open(path, store, 0, None, audit)
    trusted = frozenset(n for n in audit.uses if n.startswith(SCRIPT_GLOBALS)) if script else frozenset()
    return Opened(metadata, tensors, [path], "torch", audits=(audit.result(str(path), trusted),))


def open_file(
    path: Path, store: Store = LOCAL, start: int = 0, end: int | None = None, audit: Audit | None = None
) -> tuple[dict[str, str], list[TensorInfo]]:
    """The metadata and tensors of a torch.save or torch.jit.save file (or one at bytes [start, end) of a larger
    file).

    A view that is contiguous reads like any tensor (in chunks, by any worker); one with gaps, in another
    order or with values repeated (a slice with a step, a transpose, an expand) is read in order, in chunks,
    from its storage's bytes (`Pieces` of one strided piece). Names on one storage (tied weights) are
    separate tensors that know whom they share it with.
    """
    metadata, tensors, _ = _open(path, store, start, end, audit or Audit())
    return metadata, tensors


def _open(
    path: Path, store: Store, start: int, end: int | None, audit: Audit
) -> tuple[dict[str, str], list[TensorInfo], bool]:
    """`open_file`, and whether the file is a TorchScript archive."""
    if Path(path).suffix == ".distcp":  # torch.save archives one after another: only the whole directory reads
        raise FileTypeError(
            f"one file of a distributed checkpoint, which reads only as a whole: name its directory "
            f"({shown_path(str(Path(path).parent))}) instead",
            path,
        )
    metadata, tensors, script = _read_torch(path, start, end, None, store, audit)
    # a storage is known by its file and key: shards of one checkpoint each have their own keys
    shared = {name: f"{path}:{key}" for key, names in shared_storages(tensors).items() for name in names}
    out = []
    for t in tensors:
        dtype = t.dtype if t.skip_reason is None else None
        location: Any = None
        if t.held is not None:
            location = Held(t.held)
        elif dtype is not None:
            start_byte, end_byte = view_byte_range(t)
            location = Span(start_byte) if is_contiguous(t) else _strided(t, str(path), start_byte, end_byte)
        stored = dtype.newbyteorder(">") if dtype is not None and t.big_endian and dtype.itemsize > 1 else None
        out.append(
            TensorInfo(
                t.name,
                t.dtype_name,
                t.shape,
                t.nbytes,
                str(path),
                dtype,
                location=location,
                stored_dtype=stored,
                skip=t.skip_reason,
                storage=shared.get(t.name),
            )
        )
    return metadata, out, script


def _strided(t: TorchTensor, path: str, start: int, end: int) -> Pieces:
    """A view with gaps, in another order or with values repeated: one strided piece of its storage's bytes."""
    view = Piece((0,) * len(t.shape), t.shape, path, start, (t.strides, end - start))
    return Pieces(t.shape, t.dtype.itemsize, (view,))


def read_torch(
    path: Path,
    start: int = 0,
    end: int | None = None,
    name: str | None = None,
    store: Store = LOCAL,
    audit: Audit | None = None,
) -> tuple[dict[str, str], list[TorchTensor]]:
    """The metadata and tensors of a torch.save file, or of one at bytes [start, end) of a larger file.

    Reads the zip directory (or the legacy file's pickles and storage headers) and the pickle, never
    the tensors' data; every tensor is checked to lie inside its storage, and every storage inside
    the file. A TorchScript archive (torch.jit.save) gives its modules' parameters and buffers under their
    `state_dict()` names and its constants (`_torchscript`).

    Args:
        path: the file.
        start: where the torch.save file begins in it.
        end: where it ends (None: at the end of the file).
        name: the name of the saved object, as one item of a larger whole (a distributed checkpoint's
            `optim.param_groups.0.betas`): a container's items are named `name.key`, and an empty
            container is the metadata `{}`, `[]` or `()`. None: the object is the file's, its items
            are named by their keys alone, and a tensor or value saved on its own takes the file's stem.
        store: where the file is read from (by default the file system).
        audit: counts the globals its pickles name and call (`_pickle_audit`).

    Raises:
        MissingFileError: when the file cannot be opened.
        FileTypeError: when it is not a torch.save file.
        MalformedError: when it breaks the format (UnsafePickleError when its pickle asks for code).
        UnsupportedError: for the tar format of torch 0.1.x and compressed storages.
    """
    metadata, tensors, _ = _read_torch(path, start, end, name, store, audit or Audit())
    return metadata, tensors


def _read_torch(
    path: Path, start: int, end: int | None, name: str | None, store: Store, audit: Audit
) -> tuple[dict[str, str], list[TorchTensor], bool]:
    path = Path(path)
    try:
        f = store.open(path)
    except OSError as e:
        raise MissingFileError(e.strerror or str(e), path) from e
    with f:
        try:
            return _read(f, path, start, end, name, audit)
        except ClipcliError as e:
            if e.path is None:
                e.path = str(path)
            raise
        except OSError as e:
            raise InputError(f"cannot read: {e.strerror or e}", path) from e


def _read(
    f: BinaryIO, path: Path, start: int, end: int | None, name: str | None, audit: Audit
) -> tuple[dict[str, str], list[TorchTensor], bool]:
    size = size_of(f)
    stop = size if end is None else end
    if not 0 <= start <= stop <= size:
        raise MalformedError(f"bytes {start}..{stop} are not inside the file ({size} bytes)")
    root, storages, big_endian, pickle_size, script = _unpickled(_Region(f, start, stop), audit)
    item = name is not None
    metadata, tensors = flatten(root, path.stem if name is None else name, storages, big_endian, pickle_size, item)
    return metadata, tensors, script


def _unpickled(region: _Region, audit: Audit, resolver: Resolver = resolve) -> tuple[Any, Storages, bool, int, bool]:
    """A zip or legacy file's object, storages, byte order, pickle size and whether it is TorchScript."""
    head = region.pread(0, 512)
    if head.startswith(_ZIP):
        return _read_zip(region, audit, resolver)
    if len(head) >= 262 and head[257:262] == b"ustar":
        raise UnsupportedError(
            "a torch.save file in the tar format that torch wrote until early 2017 (torch 0.1.x); load it with "
            "torch and save it again"
        )
    root, storages, pickle_size = _read_legacy(region, head, audit, resolver)
    return root, storages, False, pickle_size, False


def read_root(path: Path, store: Store = LOCAL, resolver: Resolver = resolve) -> tuple[Any, bool]:
    """The object a torch.save file holds, as the pickle machine builds it (tensors as records, never their data),
    for a writer that keeps its structure (`torch_write`, whose `resolver` keeps some types the names need not
    tell apart), and whether the file is a TorchScript archive.

    Raises:
        what `read_torch` raises.
    """
    with store.open(path) as f:
        root, _, _, _, script = _unpickled(_Region(f, 0, size_of(f)), Audit(), resolver)
        return root, script


# what zipfile raises for a damaged archive (see formats/npz.py, which reads .npz the same way)
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    zlib.error,
    lzma.LZMAError,
    IndexError,
    NotImplementedError,
    ValueError,
    RuntimeError,
    struct.error,
    OverflowError,
)


def _read_zip(region: _Region, audit: Audit, resolver: Resolver) -> tuple[Any, Storages, bool, int, bool]:
    """The object, storages, byte order and pickle size of a zip archive, and whether it is TorchScript."""
    try:
        with zipfile.ZipFile(region) as z:  # type: ignore[arg-type]
            infos = z.infolist()
            members: dict[str, zipfile.ZipInfo] = {}
            for info in infos:
                if info.filename in members:
                    raise MalformedError(f"the zip holds two members named {info.filename!r}")
                members[info.filename] = info
            prefix = _archive_prefix(infos)
            _check_starts_at_zero(infos)
            data_pkl = members.get(prefix + "data.pkl")
            if data_pkl is None and prefix + "model.json" in members:
                raise UnsupportedError(
                    "an older TorchScript archive (model.json, no data.pkl), which clipcli does not read: load it "
                    "with torch.jit.load and save it again"
                )
            if data_pkl is None:
                raise FileTypeError("a zip archive without data.pkl, not a torch.save file")
            script = any(n.startswith(prefix + r) for n in members for r in SCRIPT_RECORDS)
            order = members.get(prefix + "byteorder")
            big_endian = False
            if order is not None:
                text = _read_member(z, order, region, 16)
                if text not in (b"little", b"big"):
                    raise MalformedError("the byteorder record is neither 'little' nor 'big'")
                big_endian = text == b"big"
            data = _read_member(z, data_pkl, region, MAX_PICKLE)
            storages = Storages(legacy=False)
            root = unpickle(data, resolver, storages.persistent_load, audit, placeholders=True)
            _locate(storages, f"{prefix}data/", members, region)
            size = len(data)
            if script:
                root, constants_size = _read_script(z, members, prefix, region, audit, root)
                size += constants_size
            return root, storages, big_endian, size, script
    except ClipcliError:
        raise
    except _ZIP_ERRORS as e:
        raise MalformedError(f"not a valid zip archive: truncated or damaged ({_one_line(e)})") from e


def _locate(storages: Storages, folder: str, members: dict[str, zipfile.ZipInfo], region: _Region) -> None:
    """Finds each storage's bytes: the stored record `folder + key`."""
    for storage in storages.by_key.values():
        info = members.get(folder + storage.key)
        if info is None:
            raise MalformedError(f"storage {storage.key} is not in the archive (no {folder}{storage.key})")
        storage.file_offset = region.start + _stored_data_offset(region, info, storage)


_READ_PICKLES = ("data.pkl", "constants.pkl")


def _read_script(
    z: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], prefix: str, region: _Region, audit: Audit, root: Any
) -> tuple[dict[str, Any], int]:
    """A TorchScript archive's entries (`_torchscript`) from its data.pkl's object, and the size of its
    constants.pkl; its other pickles (a mobile archive's bytecode.pkl, traced_inputs.pkl) are audited."""
    constants: Any = ()
    size = 0
    info = members.get(prefix + "constants.pkl")
    if info is not None:
        audit.refuse()  # torch.load(weights_only=True) refuses every archive that holds a constants.pkl
        data = _read_member(z, info, region, MAX_PICKLE)
        size = len(data)
        storages = Storages(legacy=False)
        constants = unpickle(data, resolve, storages.persistent_load, audit, placeholders=True)
        _locate(storages, f"{prefix}constants/", members, region)
        for storage in storages.by_key.values():
            storage.key = f"constants/{storage.key}"  # apart from data/'s keys: '0' there is another storage
    for name, other in members.items():
        record = name.removeprefix(prefix)
        if record != name and record.endswith(".pkl") and "/" not in record and record not in _READ_PICKLES:
            data = _read_member(z, other, region, MAX_PICKLE)
            unpickle(data, resolve, Storages(legacy=False).persistent_load, audit, placeholders=True)
    classes: dict[str, dict[str, Any]] = {}

    def lookup(qualified: str) -> Any:
        where = code_record(qualified)
        if where is None:
            return None
        record, cls = where
        if record not in classes:
            code = members.get(prefix + record)
            text = b"" if code is None else _read_member(z, code, region, MAX_CODE, compressed=True)
            classes[record] = declared_classes(text.decode("utf-8", "replace"), record)
        return classes[record].get(cls)

    return module_state(root, lookup, constants), size


def _archive_prefix(infos: list[zipfile.ZipInfo]) -> str:
    """The folder all records are in: torch names it after the file (`archive/` when saved to a buffer)."""
    if not infos:
        raise FileTypeError("an empty zip archive, not a torch.save file")
    first = infos[0].filename
    if "/" not in first:
        what = "an .npz (a zip of .npy files)" if first.endswith(".npy") else "a zip archive"
        raise FileTypeError(f"not a PyTorch file: {what}, not a torch.save file")
    return first[: first.index("/") + 1]


def _check_starts_at_zero(infos: list[zipfile.ZipInfo]) -> None:
    """Refuses a zip whose first record is not at its first byte: torch reads only such a zip, and
    zipfile would read the last of two archives in one file (a .distcp file holds one per item)."""
    first = min(info.header_offset for info in infos)
    if first:
        raise MalformedError(
            f"the zip archive's first record is at byte {first}, not 0 (another archive or other bytes come "
            "before it); torch reads only a zip that starts the file"
        )


def _read_member(
    z: zipfile.ZipFile, info: zipfile.ZipInfo, region: _Region, limit: int, compressed: bool = False
) -> bytes:
    # torch stores every record but TorchScript's code; a compressed pickle would build objects far beyond the
    # bytes in the file
    if info.compress_type != zipfile.ZIP_STORED and not compressed:
        raise UnsupportedError(
            f"record {info.filename} is compressed (method {info.compress_type}); torch never compresses it, "
            "and clipcli reads it only stored"
        )
    if info.file_size > limit or info.compress_size > region.size:
        raise MalformedError(f"record {info.filename} claims {info.file_size} bytes")
    if info.CRC == 0 and info.file_size:
        # torch.save with `torch.utils.serialization.config.save.compute_crc32 = False` records every CRC-32
        # as 0, and torch reads such files: no checksum to check, rather than a wrong one
        info = copy.copy(info)
        del info.CRC
    data = z.read(info)
    if len(data) != info.file_size:
        raise MalformedError(f"record {info.filename} holds {len(data)} bytes, not {info.file_size}")
    return data


def _stored_data_offset(region: _Region, info: zipfile.ZipInfo, storage: Storage) -> int:
    """Where a storage member's bytes begin in the region, from its local header; checks its size."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
        raise UnsupportedError(
            f"storage {storage.key} is compressed or encrypted (torch never does either); clipcli reads it only stored"
        )
    start = zip_data_start(region.pread, info)
    if start is None:
        raise MalformedError(f"storage {storage.key}: bad local zip header (the zip directory points elsewhere)")
    if info.file_size != info.compress_size or info.file_size != storage.nbytes:
        raise MalformedError(
            f"storage {storage.key} holds {info.file_size} bytes but the pickle declares {storage.numel} "
            f"{storage.dtype.name} elements ({storage.nbytes} bytes)"
        )
    if start + storage.nbytes > region.size:
        raise MalformedError(f"storage {storage.key} runs past the end of the file")
    return start


def _read_legacy(region: _Region, head: bytes, audit: Audit, resolver: Resolver) -> tuple[Any, Storages, int]:
    """The object and storages of a legacy file: five pickles, then each storage behind its count."""
    window = min(region.size, _FIRST_WINDOW)
    while True:
        data = region.pread(0, window)
        try:
            attempt = Audit()  # counted again if the window grows
            root, storages, keys, end = _legacy_pickles(data, head, attempt, resolver)
            break
        except PickleTruncatedError:
            if window >= region.size or window >= MAX_PICKLE:
                raise
            window = min(region.size, window * 8, MAX_PICKLE)
    audit.uses.update(attempt.uses)
    audit.weights_only = audit.weights_only and attempt.weights_only
    pos = end
    for key in keys:
        storage = storages.by_key.get(key)
        if storage is None:
            raise MalformedError(f"storage {key} follows the pickle but the pickle never uses it")
        count_bytes = region.pread(pos, 8)
        if len(count_bytes) < 8:
            raise MalformedError(f"the file ends before storage {key}")
        (count,) = struct.unpack("<q", count_bytes)
        if count != storage.numel:
            raise MalformedError(f"storage {key} holds {count} elements but the pickle declares {storage.numel}")
        storage.file_offset = region.start + pos + 8
        pos += 8 + storage.nbytes
        if pos > region.size:
            raise MalformedError(f"storage {key} runs past the end of the file")
    missing = [key for key in storages.by_key if storages.by_key[key].file_offset < 0]
    if missing:
        raise MalformedError(f"storage {missing[0]} has no data in the file")
    return root, storages, end


def _legacy_pickles(data: bytes, head: bytes, audit: Audit, resolver: Resolver) -> tuple[Any, Storages, list[str], int]:
    try:  # ~15 bytes, well inside the first window: any failure means another kind of file
        magic, pos = unpickle_at(data, 0, resolve_nothing, audit=audit)
    except MalformedError:
        magic, pos = None, 0
    if type(magic) is not int or magic != MAGIC_NUMBER:
        from clipcli.checkpoint.registry import describe  # here: only a file that is no torch.save needs it

        what = describe(head)
        if what.startswith("a Python pickle"):
            what = "a Python pickle, not a torch.save file"
        raise FileTypeError(f"not a PyTorch file: {what}")
    version, pos = unpickle_at(data, pos, resolve_nothing, audit=audit)
    if version != PROTOCOL_VERSION:
        raise UnsupportedError(f"legacy torch.save protocol version {version!r} (clipcli reads {PROTOCOL_VERSION})")
    sys_info, pos = unpickle_at(data, pos, resolve_nothing, audit=audit)
    if not isinstance(sys_info, dict):
        raise MalformedError("the legacy file's system information is not a dict")
    storages = Storages(legacy=True)
    root, pos = unpickle_at(data, pos, resolver, storages.persistent_load, audit, placeholders=True)
    keys, pos = unpickle_at(data, pos, resolve_nothing, audit=audit)
    if type(keys) is not list or not all(type(k) is str for k in keys) or len(set(keys)) != len(keys):
        raise MalformedError("the legacy file's storage keys are not a list of distinct strings")
    return root, storages, keys, pos


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


# -- the format -------------------------------------------------------------------------------------

# The records of a torch archive (torch.save or torch.jit.save), in its one folder; an .npz holds .npy files.
_ZIP = (b"PK\x03\x04", b"PK\x05\x06")


def _sniff(head: bytes, f: BinaryIO | None = None) -> bool:
    """A zip whose first record is torch's (or, the file `f` given, any record: torch.jit.save writes its
    storages first), or a pickle of torch's legacy magic number."""
    if head.startswith(_ZIP):
        return torch_record(first_zip_member(head)) or (f is not None and _has_torch_record(f))
    return head[:1] in (b"\x80", b"L") and _starts_with_torch_magic(head)  # L: protocols 0 and 1 write a LONG


def _has_torch_record(f: BinaryIO) -> bool:
    try:
        with zipfile.ZipFile(f) as z:
            return any(torch_record(name) for name in z.namelist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False  # the reader says what is wrong with it


def _starts_with_torch_magic(head: bytes) -> bool:
    """Whether the first pickle is torch's legacy magic number, in any pickle protocol."""
    try:
        value, _ = unpickle_at(head, 0, lambda module, name: None)
    except ClipcliError:
        return False
    return type(value) is int and value == MAGIC_NUMBER


def _describe_head(head: bytes) -> str | None:
    first = first_zip_member(head) if head.startswith(_ZIP) else ""
    if _sniff(head) or re.fullmatch(r"[^/]+/data/[0-9]+", first):  # torch.jit.save writes a storage first
        kind = "zip" if head.startswith(b"PK") else "legacy"
        return f"a PyTorch {kind} checkpoint (name it .pt, .pth or .bin)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a Python pickle; clipcli never unpickles"
    if head[4:8] == b"PTMF":  # the file identifier of torch's mobile flatbuffer schema
        return (
            "a PyTorch Mobile flatbuffer (torch.jit's _save_for_lite_interpreter with _use_flatbuffer=True), which "
            "clipcli does not read: save the module with torch.jit.save instead"
        )
    return None


def findings(path: Path, store: Store = LOCAL) -> list[Finding]:
    """What opening a PyTorch file refuses (its first defect) or, for a zip (torch.save's format since 1.6) that
    opens, each member whose bytes do not match their CRC-32 (read through: the pickle and every storage; none
    where torch recorded each as 0, as `_read_member` reads them)."""
    return refusals(open_file, path, store) or _crc_findings(path, store)


def _crc_findings(path: Path, store: Store = LOCAL) -> list[Finding]:
    """Each record of a PyTorch zip whose bytes do not match their CRC-32 (none where torch recorded each as 0)."""
    return crc_findings(path, store, zero_is_none=True)


FORMAT = Format(
    "torch",
    (".pt", ".pth", ".bin", ".ckpt"),
    sniff=_sniff,
    describe=_describe_head,
    open_file=open_file,
    open=open_audited,
    plural="PyTorch files",
    findings=findings,
    scan=_crc_findings,
    write=write,
    check_tensor=check_tensor,
    check_file=check_file,
    c_order=True,
)
