"""Zip members read as streams: decompressed no more than a read asks for, checked against their CRC-32."""

from __future__ import annotations

import bz2
import io
import lzma
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from clipcli.checkpoint.crc import crc32
from clipcli.checkpoint.plugin import Finding
from clipcli.checkpoint.source import SourceFile, Store, pread_of
from clipcli.checkpoint.tensor import ZipMember
from clipcli.errors import MalformedError, UnsupportedError

MAX_LZMA_DICTIONARY = 64 << 20  # of an LZMA member: 7-Zip's "ultra" setting; Python's zipfile writes 8 MiB
# What a damaged zip member raises while it is decompressed (bzip2 reports bad data as OSError).
DATA_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError)


def data_start(raw: BinaryIO, member: zipfile.ZipInfo) -> int:
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
    `raw` is the archive (a file object a store opened), read by position (its position is left alone), and
    closed with the stream if `own`.
    """

    _READ = 1 << 16  # compressed bytes read at a time

    def __init__(self, raw: BinaryIO, member: zipfile.ZipInfo, start: int, own: bool = False):
        super().__init__()
        self._raw, self._own = raw, own
        self._pread, self._at, self._end = pread_of(raw), start, start + member.compress_size
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
            self._crc = crc32(out, self._crc)
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
        data = self._pread(self._at, min(n, self._end - self._at))
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


def open_member(store: Store, path: Path, z: zipfile.ZipFile, location: ZipMember) -> BinaryIO:
    """A compressed member's stream (with a file object of its own), positioned at the tensor's data."""
    member = z.getinfo(location.member)
    raw = store.open(path)
    try:
        start = data_start(raw, member)
        stream = MemberStream(raw, member, start, own=True)
        stream.read(location.data_offset)
    except BaseException:
        raw.close()
        raise
    return stream  # type: ignore[return-value]


# records torch.save and torch.jit.save write in their zip's one folder (`archive/data.pkl`, `archive/code/...`)
TORCH_RECORDS = ("data.pkl", "constants.pkl", "version")


def torch_record(name: str) -> bool:
    """Whether a zip member's name is a record of torch's zip format (a PyTorch or TorchScript archive)."""
    folder, _, record = name.partition("/")
    return bool(folder) and (record in TORCH_RECORDS or record.startswith("code/"))


def zip_data_start(read: Callable[[int, int], bytes], info: Any) -> int | None:
    """Where a zip member's bytes begin (after its local header, whose lengths may differ from the
    directory's), or None when no local header of that name is where the directory says: the directory
    would point at another member's bytes. `read(offset, n)` reads the archive; `info` is a ZipInfo."""
    local = read(info.header_offset, 30)
    if len(local) < 30 or not local.startswith(b"PK\x03\x04"):
        return None
    flags, name_len, extra_len = struct.unpack("<H18xHH", local[6:30])
    raw_name = read(info.header_offset + 30, name_len)
    name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")  # as zipfile decodes it
    if name != info.orig_filename:
        return None
    return info.header_offset + 30 + name_len + extra_len


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


class Window:
    """Bytes [start, start + length) of a file a store opened, as a source of their own (a torch.save archive
    that a distributed checkpoint's file holds among others), read by position: `SourceFile` makes it a file."""

    def __init__(self, raw: BinaryIO, start: int, length: int):
        self.name = str(getattr(raw, "name", ""))
        self._pread, self._start, self._length = pread_of(raw), start, length

    def size(self) -> int:
        return self._length

    def read_into(self, offset: int, view: memoryview) -> int:
        data = self._pread(self._start + offset, max(0, min(len(view), self._length - offset)))
        view[: len(data)] = data
        return len(data)


def crc_findings(
    path: Path,
    store: Store,
    tensor_of: Callable[[str], str | None] = lambda m: None,
    zero_is_none: bool = False,
    window: tuple[int, int] | None = None,
) -> list[Finding]:
    """Each member of a zip whose bytes do not match their CRC-32 (`crc`) or cannot be read whole (`zip-member`),
    every member read through once (decompressed no further than the size the zip directory declares); the
    tensor a member holds is `tensor_of(member name)`. With `zero_is_none`, a stored member whose CRC-32 is
    recorded as 0 has none to check (torch.save's `compute_crc32 = False`); a `window` (start, length) is the
    archive's place in the file. [] for an archive zipfile cannot open (what opening the checkpoint says of it
    is the finding)."""
    out = []
    with store.open(path) as opened:
        raw: BinaryIO = SourceFile(Window(opened, *window)) if window is not None else opened  # type: ignore[assignment]
        try:
            z = zipfile.ZipFile(raw)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            return []
        buffer = bytearray(1 << 20)
        with z:
            for member in z.infolist():
                if zero_is_none and member.CRC == 0 and member.compress_type == zipfile.ZIP_STORED:
                    continue
                try:
                    with MemberStream(raw, member, data_start(raw, member)) as stream:
                        while stream.readinto(buffer):
                            pass
                except (*DATA_ERRORS, MalformedError, UnsupportedError, NotImplementedError, ValueError) as e:
                    text = e.message if isinstance(e, MalformedError | UnsupportedError) else _one_line(e)
                    kind = "crc" if "CRC" in text else "zip-member"
                    problem = f"member {member.filename}: {text}"
                    out.append(Finding(str(path), tensor_of(member.filename), kind, problem))
    return out
