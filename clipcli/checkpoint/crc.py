"""CRC-32s: the one function that computes them, and a stored zip member's, read in parts by any worker, checked."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any
from zlib import crc32

from clipcli.errors import MalformedError

try:  # compiled beside the core's loops (clipcli/_fused.c): by carry-less multiplication, several times zlib's speed
    from clipcli import _fused
except ImportError:  # not built (no compiler): zlib's, the same values
    _fused = None
if _fused is not None and _fused.CRC32_LEVEL > 0:  # (its tables alone are no faster than zlib's)
    crc32 = _fused.crc32

__all__ = ["ReadLog", "crc32", "crc32_of_parts"]


def crc32_of_parts(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive byte strings from their own CRC-32s and lengths, in order.

    zlib's crc32_combine, which Python's zlib lacks: appending `n` zero bytes to a string maps its CRC
    linearly over GF(2); the maps for 2**k bytes are kept, and `n`'s bits pick which to apply.
    """
    crc = 0
    for part_crc, length in parts:
        crc = _append_zeros(crc, length) ^ part_crc
    return crc


_ZERO_BYTES: list[list[int]] = []  # _ZERO_BYTES[k]: the map of appending 2**k zero bytes, as 32 columns


def _append_zeros(crc: int, length: int) -> int:
    k = 0
    while length:
        if k == len(_ZERO_BYTES):
            if k == 0:
                step = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
                for _ in range(3):  # eight zero bits
                    step = [_gf2_apply(step, column) for column in step]
            else:
                step = [_gf2_apply(_ZERO_BYTES[-1], column) for column in _ZERO_BYTES[-1]]
            _ZERO_BYTES.append(step)
        if length & 1:
            crc = _gf2_apply(_ZERO_BYTES[k], crc)
        length >>= 1
        k += 1
    return crc


def _gf2_apply(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


Log = dict[str, tuple[Any, dict[int, tuple[int, int]]]]  # tensor -> (its info, {offset: (CRC-32, length)})


class ReadLog:
    """The CRC-32s of the parts of stored members read and not yet checked, by whichever reader or worker."""

    def __init__(self) -> None:
        self._parts: Log = {}
        self._lock = threading.Lock()

    def check(self, t: Any, offset: int, data: memoryview) -> None:
        """Logs the CRC-32 of a part read; once every byte of the member has been read, checks the whole.

        Raises:
            MalformedError: when a member's bytes do not match the CRC-32 its zip directory records.
        """
        crc = t.location.crc
        if offset == 0 and len(data) == t.nbytes:  # read whole: the member's CRC follows on from its header's
            if crc32(data, crc.head) != crc.expected:
                raise _damaged(t)
            return
        self.add({f"{t.file}\0{t.name}": (t, {offset: (crc32(data), len(data))})})

    def take(self) -> Log:
        """The parts logged and not yet checked (a worker process hands them to its parent)."""
        with self._lock:
            log, self._parts = self._parts, {}
        return log

    def add(self, log: Log) -> None:
        """Adds the CRC-32s of parts read (here or by a worker), checking each member read whole.

        Raises:
            MalformedError: when a member's bytes do not match the CRC-32 its zip directory records.
        """
        for key, (t, parts) in log.items():
            with self._lock:
                seen = self._parts.setdefault(key, (t, {}))[1]
                seen.update(parts)
                if sum(n for _, n in seen.values()) < t.nbytes:
                    continue
                del self._parts[key]
            crc = t.location.crc
            whole = crc32_of_parts([(crc.head, crc.head_length), *(seen[k] for k in sorted(seen))])
            if whole != crc.expected:
                raise _damaged(t)


def _damaged(t: Any) -> MalformedError:
    return MalformedError(f"Bad CRC-32 for file {t.location.crc.member!r} (the member is damaged)", t.file, t.name)
