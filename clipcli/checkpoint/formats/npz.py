""".npz archives of .npy members: stored members read in place, compressed ones streamed, never unpickled."""

from __future__ import annotations

import contextlib
import io
import re
import struct
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from clipcli.checkpoint.atomic import write_data
from clipcli.checkpoint.crc import crc32
from clipcli.checkpoint.formats import npy as _npy
from clipcli.checkpoint.formats._common import first_zip_member
from clipcli.checkpoint.formats._common import one_line as _one_line
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.plugin import Finding, Format, Opened, refusals
from clipcli.checkpoint.source import LOCAL, Store, read_head
from clipcli.checkpoint.tensor import Span, StoredCrc, TensorInfo, ZipMember
from clipcli.checkpoint.zipmember import DATA_ERRORS, MemberStream, crc_findings, data_start, torch_record
from clipcli.errors import ClipcliError, FileTypeError, MalformedError, UnsupportedError

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
# The most a compressed member may expand: deflate's own limit (a 258-byte match costs it at least 2 bits),
# plus room for a small member's headers. bzip2 and LZMA go far beyond it (6 KB of bzip2 hold 8 GiB of zeros),
# and every byte would be decompressed to read the member: a file may not cost more than its bytes justify.
MAX_RATIO, RATIO_SLACK = 1032, 1 << 16
_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
# zipfile's own words for a damaged archive, RuntimeError for an encrypted member and IndexError for a member
# whose name is all NUL bytes
_ARCHIVE_ERRORS = (
    *DATA_ERRORS,
    IndexError,
    zipfile.LargeZipFile,
    NotImplementedError,
    ValueError,
    RuntimeError,
    struct.error,
    OverflowError,
    OSError,
)


def open_file(path: Path, store: Store = LOCAL, audit: Audit | None = None) -> tuple[dict[str, str], list[TensorInfo]]:
    """The members of an .npz as tensors, read from the zip directory and each member's .npy header.

    Members that are not numeric tensors (text, records, float128, object arrays, files that are not .npy)
    are listed and carried as bytes; the pickle of an object array is run through clipcli's pickle machine
    and counted in `audit`, never loaded.

    Raises:
        FileTypeError: when the file is no zip archive.
        MalformedError, UnsupportedError: for a damaged archive or member.
    """
    from clipcli.checkpoint.registry import HEAD_BYTES, describe

    head = read_head(store, path, HEAD_BYTES)
    if not _is_zip(head):  # np.load's test: a zip's first member, or an empty zip
        if head[:2] == b"PK":
            raise MalformedError("not a valid .npz: its first bytes are no zip member's header", path)
        raise FileTypeError(f"not an .npz file: {describe(head)}", path)
    if b"data.pkl" in head:
        raise FileTypeError(f"not an .npz file: {describe(head)}", path)
    audit = Audit() if audit is None else audit
    try:
        with store.open(path) as archive, zipfile.ZipFile(archive) as z, store.open(path) as raw:
            if any(torch_record(name) for name in z.namelist()):  # torch.jit.save writes its storages first
                raise FileTypeError("not an .npz file: a PyTorch zip checkpoint (name it .pt, .pth or .bin)", path)
            tensors, seen = [], set()
            for member in z.infolist():
                if member.is_dir():
                    continue
                name = tensor_name(member.filename)
                if name in seen:
                    raise MalformedError("two members hold this tensor", path, name)
                seen.add(name)
                try:
                    tensors.append(_member_tensor(path, z, raw, member, name, audit))
                except ClipcliError as e:
                    e.tensor = e.tensor or name
                    raise
    except _ARCHIVE_ERRORS as e:
        raise MalformedError(f"not a valid zip archive: truncated or damaged ({_one_line(e)})", path) from e
    return {}, tensors


def open_audited(path: Path, store: Store = LOCAL) -> Opened:
    """`open_file`, with the pickle audit of the object arrays it holds (none for an .npz without)."""
    audit = Audit()
    metadata, tensors = open_file(path, store, audit)
    return Opened(metadata, tensors, [path], "npz", audits=_npy.pickle_audits(path, tensors, audit))


def _member_tensor(
    path: Path, z: zipfile.ZipFile, raw: BinaryIO, member: zipfile.ZipInfo, name: str, audit: Audit
) -> TensorInfo:
    if member.flag_bits & 0x1:
        raise MalformedError(f"the member {member.filename!r} is encrypted, password required")
    if member.compress_type not in _METHODS:
        raise UnsupportedError(f"zip compression method {member.compress_type} is not one Python's zipfile reads")
    stored = member.compress_type == zipfile.ZIP_STORED
    if not stored and member.file_size > MAX_RATIO * member.compress_size + RATIO_SLACK:
        raise UnsupportedError(
            f"the member {member.filename!r} declares {member.file_size:,} bytes from {member.compress_size:,} "
            f"compressed, more than deflate can expand ({MAX_RATIO}:1): refused as a decompression bomb "
            "(store it, or compress it with deflate)"
        )
    start = data_start(raw, member)
    with contextlib.ExitStack() as stack:
        if stored:  # read in place, past the local header: its header's bytes alone, never the next member's
            raw.seek(start)
            stream: BinaryIO = io.BytesIO(raw.read(min(member.file_size, 12 + _npy.MAX_HEADER)))
        else:
            stream = stack.enter_context(MemberStream(raw, member, start))
        magic = stream.read(len(_npy.MAGIC))
        if magic != _npy.MAGIC or member.file_size < len(_npy.MAGIC):  # not a .npy member: a file carried whole
            return TensorInfo(
                name, "bytes", (member.file_size,), member.file_size, str(path), None,
                location=ZipMember(member.filename, 0), compression=member.compress_type,
            )  # fmt: skip
        header = _npy.read_npy_header(stream, magic)
        if header.pickled:  # its data is a pickle of whatever length: audited, then carried as it is
            if stored:
                raw.seek(start + header.data_offset)
                stream = raw
            _npy.audit_pickle(stream, member.file_size - header.data_offset, audit)
            location = ZipMember(member.filename, header.data_offset)
            if stored:
                crc = StoredCrc(member.CRC, crc32(header.raw), header.data_offset, member_name(name))
                location = Span(start + header.data_offset, crc)
            nbytes = member.file_size - header.data_offset
            return _npy.numpy_tensor(name, header, path, location, member.compress_type, nbytes)
    if header.data_offset + header.nbytes != member.file_size:
        raise MalformedError(
            f"the member holds {member.file_size} bytes but its header declares {header.data_offset + header.nbytes}"
        )
    if stored:
        crc = StoredCrc(member.CRC, crc32(header.raw), header.data_offset, member_name(name))
        location: Any = Span(start + header.data_offset, crc)
    else:
        location = ZipMember(member.filename, header.data_offset)
    return _npy.numpy_tensor(name, header, path, location, member.compress_type)


def write(
    f: BinaryIO,
    tensors: Iterable[TensorInfo],
    metadata: dict[str, str],
    chunks: Callable[[TensorInfo], Iterable[np.ndarray]],
    expect: Callable[[TensorInfo, int], None],
    store: Store = LOCAL,
) -> None:
    """Writes tensors as the members of an .npz; each keeps the compression its source member had.

    The metadata has nowhere to go in an .npz and is dropped.
    """
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for t in tensors:
            whole = _carried_whole(t)
            header = b"" if whole else t.prefix or _npy.npy_header(t.array_dtype, t.shape, t.fortran_order)
            info = zip_member_info(tensor_member(t), len(header) + t.nbytes, t.compression)
            with z.open(info, "w", force_zip64=True) as member:
                member.write(header)
                expect(t, write_data(member, chunks(t)))


def member_name(tensor: str) -> str:
    return f"{tensor}.npy"


def _carried_whole(t: Any) -> bool:
    """Whether a tensor is a member that is no .npy, carried whole under its own name."""
    return t.dtype == "bytes" and t.array_dtype is None


def tensor_member(t: Any) -> str:
    """The name of the member a tensor is written as."""
    return t.name if _carried_whole(t) else member_name(t.name)


def check_member_name(member: str) -> None:
    """Refuses a member name that `unzip` or another extractor would put outside the directory it extracts
    into: absolute (`/x`, `C:x`), with a `..` part, with a backslash (a separator on Windows). A NUL is
    refused too, as readers cut the name there. Refused, not escaped: the name is the tensor's, which an
    escaped name would not read back as.

    Raises:
        UnsupportedError: saying so.
    """
    parts = member.split("/")
    if member.startswith("/") or ".." in parts or "\\" in member or "\0" in member or _DRIVE.match(member):
        raise UnsupportedError(
            f"the .npz member {member!r} would be written outside the directory it is extracted into "
            "(an absolute path, a '..' part, a backslash or a NUL); write .safetensors, or leave it out with --exclude"
        )


_DRIVE = re.compile(r"[A-Za-z]:")


def tensor_name(member: str) -> str:
    """The key `np.load` gives a member: its name without a `.npy` suffix."""
    return member[:-4] if member.endswith(".npy") else member


def zip_member_info(name: str, size: int, compression: int = zipfile.ZIP_STORED) -> zipfile.ZipInfo:
    """A member with a fixed timestamp, so the same input gives the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = compression
    info.file_size = size
    info.external_attr = 0o644 << 16
    return info


def _check_tensor(t: TensorInfo) -> None:
    """Refuses a tensor that an .npz cannot hold, or whose member name an extractor would misplace."""
    if not (t.array_dtype is None and (t.prefix or t.dtype == "bytes")):
        _npy.check_portable(t.array_dtype, t.name)
    check_member_name(tensor_member(t))


def _check_file(
    target: Path, tensors: list[TensorInfo], source_format: str, metadata: dict[str, str], store: Store = LOCAL
) -> None:
    _npy.check_metadata(target, metadata)


def _is_zip(head: bytes, f: BinaryIO | None = None) -> bool:
    """np.load's test: a zip's first member, or an empty zip."""
    return head.startswith(ZIP_MAGIC)


def _describe_head(head: bytes) -> str | None:
    if head.startswith(ZIP_MAGIC):
        return "a zip archive (an .npz?)" if first_zip_member(head).endswith(".npy") else "a zip archive"
    return None


def findings(path: Path, store: Store = LOCAL) -> list[Finding]:
    """What opening an .npz refuses (its first defect) or, for one that opens, each member whose bytes do not
    match their CRC-32 (read through: the only check that reads tensor bytes without --values)."""
    return refusals(open_file, path, store) or crc_findings(path, store, tensor_name)


FORMAT = Format(
    "npz",
    (".npz",),
    sniff=_is_zip,
    describe=_describe_head,
    open_file=open_file,
    open=open_audited,
    write=write,
    check_tensor=_check_tensor,
    check_file=_check_file,
    findings=findings,
)
