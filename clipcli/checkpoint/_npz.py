""".npz archives of .npy members: stored members read in place, compressed ones streamed, never unpickled."""

from __future__ import annotations

import bz2
import contextlib
import io
import lzma
import os
import re
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
# The most a compressed member may expand: deflate's own limit (a 258-byte match costs it at least 2 bits),
# plus room for a small member's headers. bzip2 and LZMA go far beyond it (6 KB of bzip2 hold 8 GiB of zeros),
# and every byte would be decompressed to read the member: a file may not cost more than its bytes justify.
MAX_RATIO, RATIO_SLACK = 1032, 1 << 16
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
    stored = member.compress_type == zipfile.ZIP_STORED
    if not stored and member.file_size > MAX_RATIO * member.compress_size + RATIO_SLACK:
        raise UnsupportedError(
            f"the member {member.filename!r} declares {member.file_size:,} bytes from {member.compress_size:,} "
            f"compressed, more than deflate can expand ({MAX_RATIO}:1): refused as a decompression bomb "
            "(store it, or compress it with deflate)"
        )
    start = _data_start(raw, member)
    with contextlib.ExitStack() as stack:
        if stored:  # read in place, past the local header: no decompressor to set up
            raw.seek(start)
            stream: BinaryIO = raw
        else:
            stream = stack.enter_context(MemberStream(raw, member, start))
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


class MemberStream(io.RawIOBase):
    """A zip member's bytes, decompressed no more than a read asks for.

    zipfile's own reader gives a bzip2 or LZMA decompressor each 4 KiB read whole, and a few KiB of bzip2 or
    LZMA can expand to gigabytes; here every decompressor is asked for at most what the caller's buffer
    holds, and never past the size the zip directory declares. Damage comes as zipfile.BadZipFile.
    `raw` is the archive, read with `pread` (its position is left alone), and closed with the stream if `own`.
    """

    _READ = 1 << 16  # compressed bytes read at a time

    def __init__(self, raw: BinaryIO, member: zipfile.ZipInfo, start: int, own: bool = False):
        super().__init__()
        self._raw, self._own = raw, own
        self._fd, self._at, self._end = raw.fileno(), start, start + member.compress_size
        self._left = member.file_size  # decompressed bytes still to come
        self._crc, self._expected = 0, member.CRC
        self._decompressor = _decompressor(member.compress_type, self._take)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self._own:
            self._raw.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        """Fills `buffer` (short only at the member's end)."""
        view = memoryview(buffer).cast("B")
        got = 0
        while got < len(view) and self._left:
            out = self._decompress(min(len(view) - got, self._left))
            view[got : got + len(out)] = out
            got += len(out)
            self._left -= len(out)
            self._crc = zlib.crc32(out, self._crc)
            if not self._left and self._crc != self._expected:
                raise zipfile.BadZipFile("Bad CRC-32 for the member (it is damaged)")
        return got

    def _decompress(self, n: int) -> bytes:
        d = self._decompressor
        try:
            while True:
                if d.eof:
                    raise zipfile.BadZipFile("the member's data ends before the size the zip directory declares")
                out = d.decompress(self._take(self._READ) if d.needs_input else b"", n)
                if out:
                    return out
        except (zlib.error, lzma.LZMAError, OSError, EOFError, ValueError) as e:  # bzip2 says OSError
            raise zipfile.BadZipFile(f"the member's compressed data is damaged ({_one_line(e)})") from e

    def _take(self, n: int) -> bytes:
        """The next compressed bytes (at most `n`)."""
        data = os.pread(self._fd, min(n, self._end - self._at), self._at)
        if not data:
            raise zipfile.BadZipFile("the member's compressed data is truncated")
        self._at += len(data)
        return data


class _Inflate:
    """zlib's raw deflate decompressor with the needs_input/eof interface of bz2's and lzma's."""

    def __init__(self) -> None:
        self._d = zlib.decompressobj(-zlib.MAX_WBITS)

    @property
    def eof(self) -> bool:
        return self._d.eof

    @property
    def needs_input(self) -> bool:
        return not self._d.unconsumed_tail

    def decompress(self, data: bytes, n: int) -> bytes:
        return self._d.decompress(self._d.unconsumed_tail + data, n)


class _Copy:
    """A stored member's bytes given out as a decompressor would (a member carried whole is read so)."""

    eof = False

    def __init__(self) -> None:
        self._tail = b""

    @property
    def needs_input(self) -> bool:
        return not self._tail

    def decompress(self, data: bytes, n: int) -> bytes:
        data = self._tail + data
        self._tail = data[n:]
        return data[:n]


def _decompressor(method: int, take: Callable[[int], bytes]) -> Any:
    if method == zipfile.ZIP_STORED:
        return _Copy()
    if method == zipfile.ZIP_DEFLATED:
        return _Inflate()
    if method == zipfile.ZIP_BZIP2:
        return bz2.BZ2Decompressor()
    return _lzma_decompressor(take)


def _lzma_decompressor(take: Callable[[int], bytes]) -> lzma.LZMADecompressor:
    """The raw LZMA1 decoder of a zip member, from the properties before its data (read through `take`).

    Refuses a dictionary of more than MAX_LZMA_DICTIONARY bytes: the decoder allocates it up front, so a
    few crafted bytes could otherwise ask for 4 GiB.
    """
    head = take(4)
    (size,) = struct.unpack("<2xH", head) if len(head) == 4 else (0,)
    props = take(size) if size else b""
    if len(props) != 5:  # lc/lp/pb (1), dictionary size (4)
        raise zipfile.BadZipFile("bad LZMA properties")
    dictionary = int.from_bytes(props[1:], "little")
    if dictionary > MAX_LZMA_DICTIONARY:
        raise UnsupportedError(
            f"LZMA dictionary of {dictionary} bytes exceeds the {MAX_LZMA_DICTIONARY} clipcli allows"
        )
    pb, rest = divmod(props[0], 45)
    lp, lc = divmod(rest, 9)
    if pb > 4:
        raise zipfile.BadZipFile("bad LZMA properties")
    lzma1 = {"id": lzma.FILTER_LZMA1, "dict_size": dictionary, "lc": lc, "lp": lp, "pb": pb}
    return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[lzma1])


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def open_member(z: zipfile.ZipFile, location: ZipMember) -> BinaryIO:
    """A compressed member's stream (with its own descriptor), positioned at the tensor's data."""
    member = z.getinfo(location.member)
    raw = open(z.filename or "", "rb")  # noqa: SIM115 (closed with the stream)
    try:
        start = _data_start(raw, member)
        stream = MemberStream(raw, member, start, own=True)
        stream.read(location.data_offset)
    except BaseException:
        raw.close()
        raise
    return stream  # type: ignore[return-value]


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
