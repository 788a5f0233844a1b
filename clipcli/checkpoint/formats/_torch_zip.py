"""A PyTorch zip archive (torch.save since 1.6, torch.jit.save) read without torch: its records, its pickle's
object and where each storage's bytes lie."""

from __future__ import annotations

import copy
import lzma
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

from clipcli.checkpoint.formats._pickle import unpickle
from clipcli.checkpoint.formats._pickle_audit import Audit
from clipcli.checkpoint.formats._torch_records import Storage, Storages, resolve
from clipcli.checkpoint.formats._torchscript import SCRIPT_RECORDS, code_record, declared_classes, module_state
from clipcli.checkpoint.plugin import defect
from clipcli.checkpoint.zipmember import zip_data_start
from clipcli.errors import ClipcliError, FileTypeError, MalformedError, UnsupportedError

# Bytes of pickle clipcli reads: a state dict of 10^5 tensors takes ~10 MB; unpickled, a pickle can take
# up to ~100 times its size (an EMPTY_DICT opcode is 1 byte, a dict 64).
MAX_PICKLE = 256 << 20
MAX_CODE = 64 << 20  # bytes of one TorchScript code/ record (the source of a module's classes) clipcli reads
Resolver = Callable[[str, str], Any]  # a pickle's global (module, name) -> what the machine makes of it


class Region:
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


def read_zip(region: Region, audit: Audit, resolver: Resolver) -> tuple[Any, Storages, bool, int, bool]:
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
        raise MalformedError(f"not a valid zip archive: truncated or damaged ({one_line(e)})") from e


def _locate(storages: Storages, folder: str, members: dict[str, zipfile.ZipInfo], region: Region) -> None:
    """Finds each storage's bytes: the stored record `folder + key`."""
    for storage in storages.by_key.values():
        info = members.get(folder + storage.key)
        if info is None:
            raise MalformedError(f"storage {storage.key} is not in the archive (no {folder}{storage.key})")
        storage.file_offset = region.start + _stored_data_offset(region, info, storage)


_READ_PICKLES = ("data.pkl", "constants.pkl")


def _read_script(
    z: zipfile.ZipFile, members: dict[str, zipfile.ZipInfo], prefix: str, region: Region, audit: Audit, root: Any
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
    z: zipfile.ZipFile, info: zipfile.ZipInfo, region: Region, limit: int, compressed: bool = False
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
    try:
        data = z.read(info)
    except zipfile.BadZipFile as e:
        if "CRC" not in str(e):
            raise
        # the defect verify names for a storage too (`zipmember.crc_findings`): a record damaged, not malformed
        raise defect("crc", f"member {info.filename}: Bad CRC-32 for the member (it is damaged)") from e
    if len(data) != info.file_size:
        raise MalformedError(f"record {info.filename} holds {len(data)} bytes, not {info.file_size}")
    return data


def _stored_data_offset(region: Region, info: zipfile.ZipInfo, storage: Storage) -> int:
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


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
