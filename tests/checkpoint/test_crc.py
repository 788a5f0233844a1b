"""The CRC-32 (`checkpoint.crc.crc32`, compiled in clipcli/_fused.c) against zlib's, every loop of it, any
lengths, addresses, start values and buffers; and zlib's own where the loops were not built."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clipcli.checkpoint import crc
from clipcli.checkpoint.crc import crc32, crc32_of_parts

try:
    from clipcli import _fused
except ImportError:
    _fused = None
needs_loops = pytest.mark.skipif(_fused is None, reason="clipcli/_fused.c was not built (no compiler?)")

# 0: the tables alone; 1: PCLMULQDQ's 128-bit folds; 2: VPCLMULQDQ's 512-bit ones (each capped at what the
# machine has: on one without them, the tables answer every level).
LEVELS = [0, 1, 2]
DATA = np.random.default_rng(24).integers(0, 256, (1 << 20) + 4096, dtype=np.uint8).tobytes()
STARTS = [0, 1, 0xFFFFFFFF, 0x80000000, 0xDEADBEEF, 0x12345678]


@needs_loops
@pytest.mark.parametrize("level", LEVELS)
def test_every_length_up_to_300_and_past_the_folds_thresholds(level):
    view = memoryview(DATA)
    for n in [*range(301), *range(500, 530), 1023, 1024, 1025, 4095, 4096, 4097]:
        for start in STARTS:
            assert _fused.crc32(view[:n], start, level) == zlib.crc32(view[:n], start), (n, start)


@needs_loops
@pytest.mark.parametrize("level", LEVELS)
def test_every_address_offset(level):
    view = memoryview(DATA)
    for offset in range(64):
        for n in (0, 15, 16, 63, 64, 65, 255, 256, 257, 271, 1000, 4099):
            start = (offset * 2654435761) & 0xFFFFFFFF
            data = view[offset : offset + n]
            assert _fused.crc32(data, start, level) == zlib.crc32(data, start), (offset, n)


@needs_loops
@pytest.mark.parametrize("level", LEVELS)
def test_a_megabyte_and_odd_bytes(level):
    for offset, n in [(0, 1 << 20), (5, (1 << 20) + 13), (3, (1 << 20) + 4093), (61, 777_777)]:
        data = memoryview(DATA)[offset : offset + n]
        start = random.Random(n).getrandbits(32)
        assert _fused.crc32(data, start, level) == zlib.crc32(data, start)


@needs_loops
@given(data=st.binary(max_size=3000), start=st.integers(0, 2**32 - 1), level=st.sampled_from(LEVELS))
@settings(max_examples=300, deadline=None)
def test_any_bytes_from_any_start_value(data, start, level):
    assert _fused.crc32(data, start, level) == zlib.crc32(data, start)


@needs_loops
@given(cuts=st.lists(st.integers(0, len(DATA)), max_size=6), level=st.sampled_from(LEVELS))
@settings(max_examples=40, deadline=None)
def test_a_run_in_parts_gives_the_crc_of_the_whole(cuts, level):
    """Each part's CRC is the start value of the next (as the .pt writer takes a record's chunks)."""
    bounds = [0, *sorted(cuts), len(DATA)]
    value = 0
    for a, b in itertools.pairwise(bounds):
        value = _fused.crc32(memoryview(DATA)[a:b], value, level)
    assert value == zlib.crc32(DATA)


def test_any_buffer_and_start_value_as_zlib_takes_them():
    x = np.frombuffer(DATA, np.float32, 4096).reshape(64, 64)
    for data in (x, x[3:9], x.view(np.uint8), bytearray(DATA[:999]), DATA[:77], memoryview(x)):
        assert crc32(data) == zlib.crc32(data)
    for start in (-1, 2**32, 2**40 + 5, -(2**63)):  # any int, its low 32 bits (zlib's bitwise conversion)
        assert crc32(DATA[:100], start) == zlib.crc32(DATA[:100], start)
    assert crc32(b"") == 0 and crc32(b"", 0xFFFFFFFF) == 0xFFFFFFFF
    assert crc32(b"123456789") == 0xCBF43926  # the CRC-32 catalogue's check value


@pytest.mark.parametrize("data", ["text", np.zeros((8, 8), np.float32)[:, ::2]])
def test_what_zlib_refuses_is_refused_alike(data):
    with pytest.raises(Exception) as ours:
        crc32(data)
    with pytest.raises(Exception) as zlibs:
        zlib.crc32(data)
    assert type(ours.value) is type(zlibs.value)


def test_parts_combine_into_the_crc_of_the_whole():
    bounds = [0, 1, 64, 1000, 70_000, len(DATA)]
    parts = [(crc32(DATA[a:b]), b - a) for a, b in itertools.pairwise(bounds)]
    assert crc32_of_parts(parts) == zlib.crc32(DATA)


@needs_loops
def test_the_compiled_crc_is_the_one_used_where_it_folds():
    assert crc.crc32 is (_fused.crc32 if _fused.CRC32_LEVEL else zlib.crc32)


def test_without_the_compiled_loops_zlib_computes_it():
    code = (
        "import sys, zlib; sys.modules['clipcli._fused'] = None\n"
        "from clipcli.checkpoint import crc\n"
        "assert crc.crc32 is zlib.crc32, crc.crc32\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
