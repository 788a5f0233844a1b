"""Fuzzing the pickle machine through clipcli's entry points: random opcode streams and mutated torch files.

Each example is a `.pt` (or a legacy file) read by `clipcli.open` (every tensor's values too) and by the
`inspect` command in-process. It must end in clipcli's own error (exit 3) or a reading, within 2 CPU seconds,
in memory proportional to its bytes, importing nothing, calling nothing (os.system and friends are replaced
by recorders, and a sentinel file the payloads would create never appears). The normal run is bounded (a
few seconds); the large run is

    CLIPCLI_FUZZ_EXAMPLES=10000 CLIPCLI_FUZZ_LOG=/tmp/fuzz.log python -m pytest tests/checkpoint/test_pickle_fuzz.py
"""

from __future__ import annotations

import codecs
import importlib
import io
import os
import pickle
import pickletools
import pkgutil
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import clipcli
from clipcli.checkpoint import formats
from clipcli.errors import ClipcliError
from tests.helpers import DATA, byte_mutations, run, torch_tensor_pickle, torch_zip_file

EXAMPLES = int(os.environ.get("CLIPCLI_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # each example's time is measured and bounded below, with its memory
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    derandomize=EXAMPLES <= 1000,  # the normal run is the same every time; the large run explores
)
LOG = os.environ.get("CLIPCLI_FUZZ_LOG")  # a file to append each example's size, seconds, peak bytes, outcome
SECONDS = 2.0  # CPU seconds per example: a few kB of pickle take milliseconds
SENTINEL = "clipcli-pwned"  # what the payloads below would create in the current directory
ONE = struct.pack("<f", 1.0) * 4  # storage "0": four float32 ones


# -- what an example may do ----------------------------------------------------------------------------


def memory_bound(size: int) -> int:
    """Bytes an example of `size` bytes may allocate: 64 a byte (an object costs up to ~100 times the opcode
    that makes it, torch.py's MAX_PICKLE comment, and most bytes are not such opcodes) and a fixed 4 MiB
    (zipfile's records, a first use of a code path), which dominates for these few-kB files. In 10,000
    random streams the peak was at most 0.1 MB; in 2,002 mutated files at most 19 times the file's size,
    but 3.2 MB once (a first use)."""
    return 64 * size + (4 << 20)


@pytest.fixture
def inert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A checker run in `tmp_path` with os.system, subprocess.Popen and importlib.import_module replaced by
    recorders: `inert(path)` reads the file both ways and asserts everything the module docstring says."""
    monkeypatch.chdir(tmp_path)
    for path in (DATA / "torch" / "inert" / "numpy.pt", DATA / "torch" / "nested_legacy.pt"):
        inspected(path, read(path)[0])  # what clipcli imports lazily, imported before the first example
    for module in pkgutil.iter_modules(formats.__path__):  # a damaged file's sniffing may ask any format
        importlib.import_module(f"{formats.__name__}.{module.name}")
    for codec in ("cp437", "raw_unicode_escape", "unicode_escape", "latin-1", "ascii"):  # zip names, protocol 0
        codecs.lookup(codec)
    calls: list[tuple] = []
    armed: list[bool] = []  # while an example runs: hypothesis imports its own modules between examples
    for owner, name in ((os, "system"), (subprocess, "Popen")):
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: calls.append((_n, a, k)))
    import_module = importlib.import_module

    def recorded_import(name: str, *args: object) -> object:
        if armed and not name.startswith("clipcli."):  # the registry imports its format modules by name
            calls.append(("import_module", name))
        return import_module(name, *args)

    monkeypatch.setattr(importlib, "import_module", recorded_import)

    def check(path: Path) -> str:
        modules = set(sys.modules)
        armed.append(True)
        start = time.process_time()  # CPU time: the machine may be shared, and a hang spins the CPU
        try:
            outcome, peak = read(path)
            inspected(path, outcome)
        finally:
            armed.clear()
        elapsed = time.process_time() - start
        assert elapsed < SECONDS, elapsed
        assert peak < memory_bound(path.stat().st_size), peak
        assert set(sys.modules) == modules, set(sys.modules) ^ modules
        assert calls == [] and not (tmp_path / SENTINEL).exists()
        if LOG:  # the figures of a large run, one line an example
            with open(LOG, "a") as f:
                f.write(f"{path.stat().st_size} {elapsed:.4f} {peak} {'ok' if outcome == 'ok' else 'refused'}\n")
        return outcome

    return check


def read(path: Path) -> tuple[str, int]:
    """'ok' after `clipcli.open` read every tensor, or clipcli's one-line error; and the bytes it allocated at
    its peak (tracemalloc)."""
    tracemalloc.start()
    try:
        with clipcli.open(path) as ckpt:
            for name in ckpt.names:
                if ckpt.info(name).skip is None:
                    ckpt.read(name)
        outcome = "ok"
    except ClipcliError as e:
        outcome = str(e)
        assert "\n" not in outcome and outcome.startswith(str(path)), outcome
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return outcome, peak


def inspected(path: Path, outcome: str) -> None:
    """`inspect` agrees with `read`: exit 0 (perhaps with warnings), or exit 3 with the same one line."""
    result = run("inspect", path)  # an exception other than an exit is raised by run()
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.output, result.output
    if outcome == "ok":
        assert result.exit_code == 0 and all(line.startswith("clipcli: warning: ") for line in lines), result.stderr
    else:
        assert result.exit_code == 3 and lines == [f"clipcli: error: {outcome}"], result.stderr


# -- random opcode streams -----------------------------------------------------------------------------

MODULES = ["os", "posix", "nt", "builtins", "__builtin__", "subprocess", "importlib", "functools", "argparse"]
MODULES += ["numpy.core.multiarray", "numpy._core.multiarray", "numpy", "torch._utils", "torch", "collections"]
MODULES += ["pathlib", "torch.distributed.checkpoint.metadata", "__main__", "os.path", "sys"]
NAMES = ["system", "eval", "exec", "Popen", "import_module", "partial", "Namespace", "_reconstruct", "ndarray"]
NAMES += ["dtype", "scalar", "_rebuild_tensor_v2", "_rebuild_parameter", "FloatStorage", "OrderedDict", "getattr"]
NAMES += ["PosixPath", "Size", "float32", "apply", "__import__", "__reduce_ex__", "UntypedStorage"]

# plain words, and what pickle's own names look like to a parser: dots, spaces, newlines, non-ASCII
_word = st.sampled_from(MODULES + NAMES) | st.text(min_size=0, max_size=12)
_dotted = st.lists(st.sampled_from(NAMES) | st.text(max_size=6), min_size=1, max_size=3).map(".".join)
_payload_text = st.sampled_from([f"touch {SENTINEL}", f"open({SENTINEL!r}, 'w').close()", "antigravity", ""])


def _text(s: str, how: int) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    if how == 0:
        return b"X" + struct.pack("<I", len(raw)) + raw
    if how == 1 and len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw
    if how == 2:
        return b"\x8d" + struct.pack("<Q", len(raw)) + raw
    return b"V" + s.encode("raw_unicode_escape", "replace").replace(b"\n", b"\\u000a") + b"\n"


@st.composite
def globals_(draw: st.DrawFn) -> bytes:
    """GLOBAL, STACK_GLOBAL or INST of a dotted name, known, hostile or random."""
    module = draw(st.sampled_from(MODULES) | _dotted)
    name = draw(st.sampled_from(NAMES) | _dotted)
    how = draw(st.sampled_from(["global", "stack", "inst"]))
    if how == "stack":
        return _text(module, draw(st.integers(0, 3))) + _text(name, draw(st.integers(0, 3))) + b"\x93"
    line = module.encode("utf-8", "replace") + b"\n" + name.encode("utf-8", "replace") + b"\n"
    return (b"c" if how == "global" else b"(" + _text(draw(_payload_text), 0) + b"i") + line


@st.composite
def data_ops(draw: st.DrawFn) -> bytes:
    """Strings, bytes and numbers of random lengths, with their length fields right or (rarely) wrong."""
    kind = draw(st.sampled_from(["text", "bytes", "int", "float", "persid", "frame"]))
    if kind == "text":
        return _text(draw(_payload_text | _word | st.text(max_size=300)), draw(st.integers(0, 3)))
    if kind == "bytes":
        raw = draw(st.binary(max_size=300))
        op = draw(st.sampled_from([b"C", b"B", b"\x8e", b"\x96", b"T", b"U"]))
        width = {b"C": "<B", b"U": "<B", b"B": "<I", b"T": "<I"}.get(op, "<Q")
        length = len(raw) if draw(st.integers(0, 9)) else draw(st.integers(0, 2**31))
        limit = 2 ** (8 * struct.calcsize(width)) - 1
        return op + struct.pack(width, min(length, limit)) + raw
    if kind == "int":
        return draw(
            st.sampled_from([b"K\x00", b"K\x03", b"M\xff\xff", b"J\xff\xff\xff\xff", b"I01\n", b"L12L\n", b"\x88"])
            | st.integers(0, 8).map(lambda n: b"\x8a" + bytes([n]) + b"\x7f" * n)
            | st.integers(-(2**70), 2**70).map(lambda n: pickle.dumps(n, 2)[2:-1])
        )
    if kind == "float":
        return draw(st.sampled_from([b"G" + struct.pack(">d", 1.5), b"F1e309\n", b"Fnan\n", b"G\x7f\xf0" + bytes(6)]))
    if kind == "persid":
        pid = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ"
        huge = pid.replace(b"K\x04", b"J\xff\xff\xff\x7f")  # a storage of 2**31 - 1 elements, 16 bytes held
        return draw(st.sampled_from([pid, huge, b"P0\n", b"Pstorage\n", b"N\x51"]))
    return b"\x95" + struct.pack("<Q", draw(st.sampled_from([0, 1, 9, 2**20, 2**63]) | st.integers(0, 500)))


_STRUCTURE = [b"(", b"t", b")", b"\x85", b"\x86", b"\x87", b"]", b"}", b"\x8f", b"\x90", b"\x91", b"a", b"e"]
_STRUCTURE += [b"s", b"u", b"d", b"l", b"0", b"1", b"2", b"N", b"\x89", b"\x97", b"\x98"]
_CALLS = [b"R", b"\x81", b"\x92", b"b", b"o"]
_MEMO = [b"\x94", b"q\x00", b"q\x01", b"h\x00", b"h\x01", b"r\x02\x00\x00\x00", b"j\x02\x00\x00\x00", b"p0\n", b"g0\n"]
_ANY_OPCODE = sorted({o for o in (getattr(pickle, n) for n in dir(pickle) if n.isupper()) if type(o) is bytes})


@st.composite
def opcode_streams(draw: st.DrawFn) -> bytes:
    """A pickle made of tokens: globals, what calls and builds them, the memo, containers, data, a tensor."""
    token = st.one_of(
        globals_(),
        st.sampled_from(_CALLS),
        st.sampled_from(_MEMO),
        st.sampled_from(_STRUCTURE),
        data_ops(),
        st.just(torch_tensor_pickle()),
        st.sampled_from([o for o in _ANY_OPCODE if len(o) == 1]),
    )
    tokens = draw(st.lists(token, max_size=60))
    proto = draw(st.sampled_from([b"", b"\x80\x02", b"\x80\x04", b"\x80\x05", b"\x80\x06"]))
    stop = draw(st.sampled_from([b".", b".", b".", b""]))
    return proto + b"".join(tokens) + stop


@st.composite
def plausible_streams(draw: st.DrawFn) -> bytes:
    """A dict of a tensor and a few entries, each an object a hostile or unknown global makes: these get past
    the first opcodes, where most random streams end."""
    entries = []
    for i in range(draw(st.integers(1, 4))):
        key = _text(f"k{i}", 0)
        callee = draw(globals_())
        args = b"(" + b"".join(draw(st.lists(data_ops() | st.just(torch_tensor_pickle()), max_size=3))) + b"t"
        how = draw(st.sampled_from(["reduce", "newobj", "build", "nested", "raw"]))
        if how == "reduce":
            value = callee + args + b"R"
        elif how == "newobj":
            value = callee + args + b"\x81"
        elif how == "build":
            value = callee + b")\x81}" + _text("state", 0) + args + b"sb"
        elif how == "nested":  # functools.partial around the callee, then called
            value = b"cfunctools\npartial\n(" + callee + _text(draw(_payload_text), 0) + b"tR)R"
        else:
            value = b"".join(draw(st.lists(st.sampled_from(_CALLS + _MEMO + _STRUCTURE) | data_ops(), max_size=8)))
        entries.append(key + value)
    body = b"X\x01\x00\x00\x00w" + torch_tensor_pickle() + b"".join(entries)
    return b"\x80\x02}(" + body + b"u."


def legacy_file(path: Path, obj: bytes) -> Path:
    """A legacy torch.save file around the pickle `obj`, with storage "0"."""
    from tests.helpers import torch_legacy

    return torch_legacy(path, obj.replace(b"cpu\x4b\x04tQ", b"cpu\x4b\x04NtQ"), {"0": ONE})


@FUZZ
@given(stream=opcode_streams() | plausible_streams(), legacy=st.booleans())
def test_random_opcode_streams(inert, tmp_path: Path, stream: bytes, legacy: bool) -> None:
    path = tmp_path / "fuzz.pt"
    if legacy:
        inert(legacy_file(path, stream))
    else:
        inert(torch_zip_file(path, stream, {"0": ONE}))


def test_the_streams_reach_the_machine_and_its_placeholders(inert, tmp_path: Path) -> None:
    """The strategies above make pickles that read: a hostile call among them becomes a placeholder."""
    stream = b"\x80\x02}(X\x01\x00\x00\x00w" + torch_tensor_pickle()
    stream += b"X\x01\x00\x00\x00xcfunctools\npartial\n(cos\nsystem\n" + _text(f"touch {SENTINEL}", 0) + b"tR)Ru."
    assert inert(torch_zip_file(tmp_path / "a.pt", stream, {"0": ONE})) == "ok"
    with clipcli.open(tmp_path / "a.pt") as ckpt:
        assert ckpt.names == ["w"] and ckpt.metadata["x"] == "<functools.partial>"
        uses = {g["name"]: g["use"] for g in ckpt.pickle["globals"]}
    assert uses["functools.partial"] == "call" and uses["os.system"] == "name"  # called by the partial, not the pickle
    assert inert(legacy_file(tmp_path / "b.pt", stream)) == "ok"


# -- mutated real files --------------------------------------------------------------------------------

ZIPPED = sorted(p for p in (DATA / "torch").rglob("*") if p.suffix in (".pt", ".pth", ".ckpt", ".bin"))
ZIPPED = [p for p in ZIPPED if p.is_file() and zipfile.is_zipfile(p)]


def _intact(path: Path) -> bool:
    with zipfile.ZipFile(path) as z:
        return z.testzip() is None  # no_crc32.pt's zeroed CRCs: zipfile would not read its data.pkl here


INTACT = [p for p in ZIPPED if _intact(p)]
LEGACY = sorted(p for p in (DATA / "torch").rglob("*.pt") if p.is_file() and not zipfile.is_zipfile(p))


def _members(path: Path) -> tuple[str, dict[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        return next(n for n in names if n.endswith("/data.pkl")), {n: z.read(n) for n in names}


def _boundaries(data: bytes) -> list[int]:
    """Where each opcode of a pickle starts (as far as pickletools reads it)."""
    try:
        return [pos for _, _, pos in pickletools.genops(data)]
    except Exception:  # a stream pickletools cannot read to its end: its start still splices
        return [0]


@st.composite
def spliced(draw: st.DrawFn, data: bytes, donor: bytes) -> bytes:
    """`data` with opcodes inserted, deleted or copied from `donor` (another file's pickle), at opcode starts."""
    out = data
    for _ in range(draw(st.integers(1, 3))):
        cuts = _boundaries(out)
        at = draw(st.sampled_from(cuts))
        kind = draw(st.sampled_from(["insert", "delete", "donor"]))
        if kind == "insert":
            piece = draw(globals_() | data_ops() | st.sampled_from(_CALLS + _MEMO + _STRUCTURE))
            out = out[:at] + piece + out[at:]
        elif kind == "delete":
            end = draw(st.sampled_from([c for c in cuts if c >= at] or [at]))
            out = out[:at] + out[end:]
        else:
            places = _boundaries(donor)
            i, j = sorted(draw(st.sampled_from(places)) for _ in range(2))
            out = out[:at] + donor[i:j] + out[at:]
    return out


@FUZZ
@given(data=st.data(), source=st.sampled_from(INTACT), donor=st.sampled_from(INTACT))
def test_mutated_data_pkl_of_real_files(inert, tmp_path: Path, data: st.DataObject, source: Path, donor: Path) -> None:
    """Real files' data.pkl flipped, cut or spliced with another's opcodes, in a zip with their own storages."""
    name, members = _members(source)
    original = members[name]
    pkl = data.draw(spliced(original, _members(donor)[1][_members(donor)[0]]) | byte_mutations(original))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for member, content in members.items():
            z.writestr(member, pkl if member == name else content)
    path = tmp_path / source.name
    path.write_bytes(buffer.getvalue())
    inert(path)


@FUZZ
@given(data=st.data(), source=st.sampled_from(LEGACY + ZIPPED))
def test_mutated_whole_files(inert, tmp_path: Path, data: st.DataObject, source: Path) -> None:
    """Real files (legacy ones above all: their pickles and storages are one stream) flipped, cut and spliced."""
    raw = source.read_bytes()
    mutated = data.draw(byte_mutations(raw) | spliced(raw, raw) if source in LEGACY else byte_mutations(raw))
    path = tmp_path / source.name
    path.write_bytes(mutated)
    inert(path)


def test_the_corpus_is_there() -> None:
    assert len(ZIPPED) >= 10 and len(LEGACY) >= 4, (ZIPPED, LEGACY)
    assert any("hostile" in p.name for p in ZIPPED) and any("hostile" in p.name for p in LEGACY)
