"""PyTorch `torch.save` files (zip and legacy) and TorchScript archives, read without torch: tensors and their bytes.

A `torch.save` file is a pickle whose tensors point at storages stored beside it: members
`<prefix>/data/<key>` of a zip archive (torch >= 1.6), or, in the legacy format, raw storages after the
pickle stream, each behind its element count (`_torch_zip` reads the zip's records). The pickle runs on
clipcli's restricted machine (`_pickle`) with an allowlist of the globals torch writes, each resolved to one
of the constructors of `_torch_records`; they build descriptions of tensors, never tensors. Nothing here reads a
tensor's data. A TorchScript archive (`torch.jit.save`, any suffix: `.pt`, `.jit`, `.ptl`) is the same zip
with a program beside the weights, known by its records (`constants.pkl`, `code/`), never by its first one:
`_torchscript` names its modules' parameters and buffers as `state_dict()` does, and its constants.

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

import re
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

from clipcli.checkpoint.formats._common import first_zip_member
from clipcli.checkpoint.formats._pickle import (
    PickleTruncatedError,
    Placeholder,
    unpickle_at,
)
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats._torch_names import flatten
from clipcli.checkpoint.formats._torch_records import (
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
from clipcli.checkpoint.formats._torch_zip import MAX_PICKLE, Region, Resolver, read_zip
from clipcli.checkpoint.formats._torchscript import SCRIPT_GLOBALS
from clipcli.checkpoint.formats.torch_write import check_file, check_tensor, write
from clipcli.checkpoint.plugin import Finding, Format, Opened, refusals
from clipcli.checkpoint.source import LOCAL, Store, size_of
from clipcli.checkpoint.tensor import Held, Piece, Pieces, Span, TensorInfo
from clipcli.checkpoint.zipmember import crc_findings, torch_record
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

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # the first pickle of a legacy torch.save file
PROTOCOL_VERSION = 1001  # its second
_FIRST_WINDOW = 1 << 20  # bytes of a legacy file read first to find its pickles (grown 8-fold as needed)


# -- the file --------------------------------------------------------------------------------------


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
    root, storages, big_endian, pickle_size, script = _unpickled(Region(f, start, stop), audit)
    item = name is not None
    metadata, tensors = flatten(root, path.stem if name is None else name, storages, big_endian, pickle_size, item)
    return metadata, tensors, script


def _unpickled(region: Region, audit: Audit, resolver: Resolver = resolve) -> tuple[Any, Storages, bool, int, bool]:
    """A zip or legacy file's object, storages, byte order, pickle size and whether it is TorchScript."""
    head = region.pread(0, 512)
    if head.startswith(_ZIP):
        return read_zip(region, audit, resolver)
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
        root, _, _, _, script = _unpickled(Region(f, 0, size_of(f)), Audit(), resolver)
        return root, script


def _read_legacy(region: Region, head: bytes, audit: Audit, resolver: Resolver) -> tuple[Any, Storages, int]:
    """The object and storages of a legacy file: five pickles, then each storage behind its count."""
    window = min(region.size, _FIRST_WINDOW)
    while True:
        data = region.pread(0, window)
        try:
            attempt = Audit()  # counted again if the window grows
            root, storages, keys, end = _legacy_pickles(data, head, attempt, resolver, window >= region.size)
            break
        except PickleTruncatedError:
            if window >= region.size or window >= MAX_PICKLE:
                raise
            window = min(region.size, window * 8, MAX_PICKLE)
        except InputError as e:  # torch.load runs the pickles it reads, whatever it then makes of them: said
            unsafe = attempt.result("").unsafe_calls
            if unsafe and "would call" not in e.message:  # (the machine names them where it stopped after one)
                e.message += f"; torch.load would call {', '.join(unsafe)} (never called here)"
            raise
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


def _legacy_pickles(
    data: bytes, head: bytes, audit: Audit, resolver: Resolver, whole: bool
) -> tuple[Any, Storages, list[str], int]:
    try:  # ~15 bytes, well inside the first window: any failure means another kind of file
        magic, pos = unpickle_at(data, 0, resolve_nothing, audit=audit, placeholders=True)
    except MalformedError:
        magic, pos = None, 0
    if type(magic) is not int or magic != MAGIC_NUMBER:
        from clipcli.checkpoint.registry import describe  # here: only a file that is no torch.save needs it

        what = describe(head)
        if what.startswith("a Python pickle"):
            what = "a Python pickle, not a torch.save file"
        if isinstance(magic, Placeholder) and magic.args is not None:  # a call's result, maybe the magic number
            rest = Audit()  # (eval('0x1950...')): then torch.load goes on to the pickles that follow
            _audit_rest(data, pos, rest, resolver, whole)
            first, then = audit.result("").unsafe_calls, rest.result("").unsafe_calls
            if first:
                more = f", and then, if that gives its magic number, {', '.join(then)}" if then else ""
                what += f"; torch.load would call {', '.join(first)}{more} (never called here)"
        raise FileTypeError(f"not a PyTorch file: {what}")
    version, pos = unpickle_at(data, pos, resolve_nothing, audit=audit, placeholders=True)
    if version != PROTOCOL_VERSION:
        shown = repr(version) if type(version) in (int, str, float) else "that is not a number"
        raise UnsupportedError(f"legacy torch.save protocol version {shown} (clipcli reads {PROTOCOL_VERSION})")
    sys_info, pos = unpickle_at(data, pos, resolve_nothing, audit=audit, placeholders=True)
    if not isinstance(sys_info, dict):
        raise MalformedError("the legacy file's system information is not a dict")
    storages = Storages(legacy=True)
    root, pos = unpickle_at(data, pos, resolver, storages.persistent_load, audit, placeholders=True)
    keys, pos = unpickle_at(data, pos, resolve_nothing, audit=audit, placeholders=True)
    if type(keys) is not list or not all(type(k) is str for k in keys) or len(set(keys)) != len(keys):
        raise MalformedError("the legacy file's storage keys are not a list of distinct strings")
    return root, storages, keys, pos


def _audit_rest(data: bytes, pos: int, audit: Audit, resolver: Resolver, whole: bool) -> None:
    """Runs the pickles a legacy file holds after `pos` (protocol, system information, object, storage keys) on
    the machine for their audit alone, as far as they are pickles (`data` the `whole` file, or its start)."""
    storages = Storages(legacy=True)
    for _ in range(4):
        try:
            _, pos = unpickle_at(data, pos, resolver, storages.persistent_load, audit, placeholders=True)
        except PickleTruncatedError:
            if whole:
                return
            raise  # (a larger window, then again)
        except ClipcliError:
            return


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
    """Each record of a PyTorch zip whose bytes do not match their CRC-32 (none where torch recorded each as 0):
    a storage's, once for each tensor on it (every name of a shared storage), another record's as the file's."""
    found = crc_findings(path, store, tensor_of=lambda member: member, zero_is_none=True)  # the member, for now
    if not found:
        return found
    on_storage: dict[str, list[str]] = {}
    for t in read_torch(path, store=store)[1]:  # opened before (verify's scan): only to name the tensors
        if t.storage_key:
            on_storage.setdefault(t.storage_key, []).append(t.name)
    out = []
    for f in found:
        _, _, record = (f.tensor or "").partition("/")
        names = on_storage.get(record.removeprefix("data/"), [])  # TorchScript's constants keep their folder
        out.extend([f._replace(tensor=name) for name in names] or [f._replace(tensor=None)])
    return out


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
