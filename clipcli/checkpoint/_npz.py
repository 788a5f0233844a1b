""".npz archives of .npy members: stored members read in place, compressed ones streamed, never unpickled."""

from __future__ import annotations

import contextlib
import lzma
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from clipcli.checkpoint import _npy
from clipcli.checkpoint._files import Span, StoredCrc, ZipMember, read_head, sniff, write_data, zip_data_start
from clipcli.errors import ClipcliError, FileTypeError, MalformedError, UnsupportedError

MAX_LZMA_DICTIONARY = 64 << 20  # 7-Zip's "ultra" setting; Python's zipfile writes 8 MiB
_METHODS = {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA}
# What a damaged zip member raises while it is decompressed (bzip2 reports bad data as OSError).
DATA_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError)
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


def open_file(path: Path) -> tuple[dict[str, str], list[Any]]:
    """The members of an .npz as tensors, read from the zip directory and each member's .npy header.

    Members that are not numeric tensors (text, records, float128, files that are not .npy) are listed
    and carried as bytes.

    Raises:
        FileTypeError: when the file is no zip archive.
        MalformedError, UnsupportedError: for a damaged archive or member.
    """
    head = read_head(path)
    if not head.startswith((b"PK\x03\x04", b"PK\x05\x06")):  # np.load's test: a zip's first member, or an empty zip
        if head[:2] == b"PK":
            raise MalformedError("not a valid .npz: its first bytes are no zip member's header", path)
        raise FileTypeError(f"not an .npz file: {sniff(head)}", path)
    if b"data.pkl" in head:
        raise FileTypeError(f"not an .npz file: {sniff(head)}", path)
    try:
        with zipfile.ZipFile(path) as z, open(path, "rb") as raw:
            tensors, seen = [], set()
            for member in z.infolist():
                if member.is_dir():
                    continue
                name = tensor_name(member.filename)
                if name in seen:
                    raise MalformedError("two members hold this tensor", path, name)
                seen.add(name)
                try:
                    tensors.append(_member_tensor(path, z, raw, member, name))
                except ClipcliError as e:
                    e.tensor = e.tensor or name
                    raise
    except _ARCHIVE_ERRORS as e:
        raise MalformedError(f"not a valid zip archive: truncated or damaged ({_one_line(e)})", path) from e
    return {}, tensors


def _member_tensor(path: Path, z: zipfile.ZipFile, raw: BinaryIO, member: zipfile.ZipInfo, name: str) -> Any:
    from clipcli.checkpoint import TensorInfo, numpy_tensor

    if member.flag_bits & 0x1:
        raise MalformedError(f"the member {member.filename!r} is encrypted, password required")
    if member.compress_type not in _METHODS:
        raise UnsupportedError(f"zip compression method {member.compress_type} is not one Python's zipfile reads")
    if member.compress_type == zipfile.ZIP_LZMA:
        _check_lzma_dictionary(raw, member)
    stored = member.compress_type == zipfile.ZIP_STORED
    with contextlib.ExitStack() as stack:
        if stored:  # read in place, past the local header: no decompressor to set up
            start = _data_start(raw, member)
            raw.seek(start)
            stream: BinaryIO = raw
        else:
            stream = stack.enter_context(z.open(member))
        magic = stream.read(len(_npy.MAGIC))
        if magic != _npy.MAGIC or member.file_size < len(_npy.MAGIC):  # not a .npy member: a file carried whole
            return TensorInfo(
                name, "bytes", (member.file_size,), member.file_size, str(path), None,
                location=ZipMember(member.filename, 0), compression=member.compress_type,
            )  # fmt: skip
        header = _npy.read_npy_header(stream, magic)
    if header.data_offset + header.nbytes != member.file_size:
        raise MalformedError(
            f"the member holds {member.file_size} bytes but its header declares {header.data_offset + header.nbytes}"
        )
    if stored:
        crc = StoredCrc(member.CRC, zlib.crc32(header.raw), header.data_offset)
        location: Any = Span(start + header.data_offset, crc)
    else:
        location = ZipMember(member.filename, header.data_offset)
    return numpy_tensor(name, header, path, location, member.compress_type)


def _data_start(raw: BinaryIO, member: zipfile.ZipInfo) -> int:
    """Where a member's bytes begin in the archive."""

    def read(offset: int, n: int) -> bytes:
        raw.seek(offset)
        return raw.read(n)

    start = zip_data_start(read, member)
    if start is None:
        raise MalformedError("bad local header (not the member's own: the zip directory points elsewhere)")
    return start


def _check_lzma_dictionary(raw: BinaryIO, member: zipfile.ZipInfo) -> None:
    """Refuses an LZMA member whose decoder would allocate more than MAX_LZMA_DICTIONARY bytes.

    The dictionary size sits in the member's LZMA properties; the decoder allocates it up front, so a
    few crafted bytes could otherwise ask for 4 GiB.
    """
    raw.seek(_data_start(raw, member))
    props = raw.read(9)  # version (2), properties size (2), lc/lp/pb (1), dictionary size (4)
    if len(props) < 9:
        raise MalformedError("truncated LZMA properties")
    (dictionary,) = struct.unpack("<I", props[5:9])
    if dictionary > MAX_LZMA_DICTIONARY:
        raise UnsupportedError(
            f"LZMA dictionary of {dictionary} bytes exceeds the {MAX_LZMA_DICTIONARY} clipcli allows"
        )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def open_member(z: zipfile.ZipFile, location: ZipMember) -> BinaryIO:
    """A compressed member's stream, positioned at the tensor's data."""
    stream = z.open(location.member)
    stream.read(location.data_offset)
    return stream


def write(
    f: BinaryIO,
    tensors: Iterable[Any],
    metadata: dict[str, str],
    chunks: Callable[[Any], Iterable[np.ndarray]],
    expect: Callable[[Any, int], None],
) -> None:
    """Writes tensors as the members of an .npz; each keeps the compression its source member had.

    The metadata has nowhere to go in an .npz and is dropped.
    """
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for t in tensors:
            whole = t.dtype == "bytes" and t.array_dtype is None  # a member that is no .npy, carried whole
            header = b"" if whole else t.prefix or _npy.npy_header(t.array_dtype, t.shape, t.fortran_order)
            info = zip_member_info(t.name if whole else member_name(t.name), len(header) + t.nbytes, t.compression)
            with z.open(info, "w", force_zip64=True) as member:
                member.write(header)
                expect(t, write_data(member, chunks(t)))


def member_name(tensor: str) -> str:
    return f"{tensor}.npy"


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
