"""torch's zip archive as its writer (miniz, in torch 2.13) lays it out: stored records aligned to 64 bytes."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from clipcli.checkpoint.copy import FileRange
from clipcli.checkpoint.crc import crc32

ALIGNMENT = 64  # torch's `.storage_alignment`
_ZIP64_LIMIT = 0xFFFFFFFF  # miniz's: a size or offset this large or larger is written in a zip64 field
_IN_ZIP64 = 0xFFFFFFFF  # what the 4-byte field holds then
_OVERLAP_BYTES = 1 << 20  # a chunk this large has its CRC-32 computed while it is written


class Member:
    """A record written: its name (bytes), where its local header starts, its size and CRC-32."""

    __slots__ = ("crc", "name", "offset", "size")

    def __init__(self, name: bytes, offset: int):
        self.name, self.offset, self.size, self.crc = name, offset, 0, 0


class Archive:
    """Records written one after another into `f`, each with its data descriptor; `close` writes the directory."""

    def __init__(self, f: BinaryIO, folder: str):
        self.f = f
        self.folder = folder
        self.members: list[Member] = []
        self.at = 0
        self._crcs: ThreadPoolExecutor | None = None

    def begin(self, record: str, size: int) -> Member:
        """Writes the local header of a record of `size` bytes; its data is to follow."""
        name = f"{self.folder}/{record}".encode("utf-8", "surrogateescape")
        m = Member(name, self.at)
        zip64 = b""
        if size >= _ZIP64_LIMIT:
            zip64 += struct.pack("<QQ", size, size)
        if m.offset >= _ZIP64_LIMIT:
            zip64 += struct.pack("<Q", m.offset)
        if zip64:
            zip64 = struct.pack("<HH", 1, len(zip64)) + zip64
        head = 30 + len(name) + len(zip64) + 4
        pad = -(self.at + head) % ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, 0x808, 0, 0, 0, 0, 0, 0, len(name), len(extra)))
        self._write(name + extra)
        return m

    def data(self, m: Member, data: Any) -> None:
        """Writes bytes of the record begun last (a `FileRange`'s copied from its file); their CRC-32 is
        computed by a thread meanwhile (it releases the GIL), and is done when this returns (a chunk's buffer
        is reused once it does)."""
        if isinstance(data, FileRange):
            crc = self._crc_thread().submit(data.crc, m.crc)
            try:
                self.at += data.copy_to(self.f)
            finally:
                m.crc = crc.result()
            m.size += data.nbytes
            return
        view = memoryview(data).cast("B")
        if view.nbytes < _OVERLAP_BYTES:
            m.crc = crc32(view, m.crc)
        else:
            crc = self._crc_thread().submit(crc32, view, m.crc)
            try:
                self._write(view)
            finally:
                m.crc = crc.result()
            m.size += view.nbytes
            return
        m.size += view.nbytes
        self._write(view)

    def _crc_thread(self) -> ThreadPoolExecutor:
        if self._crcs is None:
            self._crcs = ThreadPoolExecutor(1, thread_name_prefix="clipcli-crc")
        return self._crcs

    def release(self) -> None:
        """Ends the thread that computes CRC-32s, if one was started."""
        if self._crcs is not None:
            self._crcs.shutdown()
            self._crcs = None

    def end(self, m: Member) -> None:
        """Writes the record's data descriptor (8-byte sizes where the record needs zip64)."""
        if m.size >= _ZIP64_LIMIT or m.offset >= _ZIP64_LIMIT:
            self._write(struct.pack("<IIQQ", 0x08074B50, m.crc, m.size, m.size))
        else:
            self._write(struct.pack("<IIII", 0x08074B50, m.crc, m.size, m.size))
        self.members.append(m)

    def record(self, record: str, data: bytes) -> None:
        m = self.begin(record, len(data))
        self.data(m, data)
        self.end(m)

    def close(self) -> None:
        start = self.at
        for m in self.members:
            zip64 = b""
            size = offset = None
            if m.size >= _ZIP64_LIMIT:
                zip64 += struct.pack("<QQ", m.size, m.size)
                size = _IN_ZIP64
            if m.offset >= _ZIP64_LIMIT:
                zip64 += struct.pack("<Q", m.offset)
                offset = _IN_ZIP64
            if zip64:
                zip64 = struct.pack("<HH", 1, len(zip64)) + zip64
            fields = (0x02014B50, 0, 0, 0x808, 0, 0, 0, m.crc, size or m.size, size or m.size, len(m.name))
            self._write(struct.pack("<IHHHHHHIIIH", *fields))
            self._write(struct.pack("<HHHHII", len(zip64), 0, 0, 0, 0, offset or m.offset) + m.name + zip64)
        end = self.at
        n, length = len(self.members), end - start
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, n, n, length, start))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        count = min(n, 0xFFFF)  # more records than 65535, or a directory past 4 GiB: in the zip64 records alone
        length32, start32 = (x if x < _ZIP64_LIMIT else _IN_ZIP64 for x in (length, start))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, length32, start32, 0))

    def _write(self, data: Any) -> None:
        self.f.write(data)
        self.at += memoryview(data).nbytes


def folder_of(f: BinaryIO) -> str:
    """The archive's folder, as torch names it: the stem of the file written (the target of `atomic_write`'s
    temporary file) or, for a file without a name, `archive` (torch's for a buffer)."""
    target = getattr(f, "target", None)
    name = Path(str(target)).name if target is not None else ""
    stem = name.rsplit(".", 1)[0] if "." in name[1:] else name
    return stem or "archive"
