"""Writes the .npz test files with object members (pickled arrays), with NumPy, and the hostile ones by hand.

Run from the repository root (the tests never need to): `python tests/data/npz/make_npz_files.py`.

- `objects.npz` (`np.savez`, stored members): float32 `w`, float64 `b`, a 0-d object array holding a config
  dict (`cfg`), an object array of mixed Python values (`mixed`) and a record array with an object field
  (`rows`); `objects_deflate.npz` is the same through `np.savez_compressed`, `objects_bzip2.npz` and
  `objects_lzma.npz` hold the same member bytes compressed by those methods.
- `hostile_object.npz`: float32 `w` beside object members whose pickles (written opcode by opcode, never
  by pickling a live object) call `os.system` and `builtins.eval` with a command that would create the
  file `PWNED` in the working directory. Never load it with `np.load(allow_pickle=True)`: it runs them.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
SENTINEL = "PWNED"


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(24)
    return {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": rng.standard_normal(5),
        "cfg": np.array({"lr": 0.1, "betas": (0.9, 0.999), "name": "run-7"}, dtype=object),
        "mixed": np.array([1, "two", None, 3.5], dtype=object),
        "rows": np.array([(1, "a"), (2, None)], dtype=[("id", "<i4"), ("tag", "O")]),
    }


def recompressed(src: Path, dst: Path, method: int) -> None:
    """The members of `src`, the same bytes under the same names, compressed by `method`."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w") as out:
        for info in z.infolist():
            member = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            member.compress_type = method
            out.writestr(member, z.read(info))


def npy_object_member(pickle_bytes: bytes) -> bytes:
    """A .npy member of a 0-d object array whose data is `pickle_bytes`, as np.save lays it out."""
    text = "{'descr': '|O', 'fortran_order': False, 'shape': (), }"
    text += " " * (64 - (10 + len(text) + 1) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1") + pickle_bytes


def reduce_call(module: str, name: str, arg: str) -> bytes:
    """Protocol-2 opcodes of `module.name(arg)`: GLOBAL, a one-string tuple, REDUCE, STOP."""
    raw = arg.encode()
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X" + struct.pack("<I", len(raw)) + raw + b"\x85R."


def main() -> None:
    data = arrays()
    np.savez(HERE / "objects.npz", **data)
    np.savez_compressed(HERE / "objects_deflate.npz", **data)
    recompressed(HERE / "objects.npz", HERE / "objects_bzip2.npz", zipfile.ZIP_BZIP2)
    recompressed(HERE / "objects.npz", HERE / "objects_lzma.npz", zipfile.ZIP_LZMA)
    with zipfile.ZipFile(HERE / "hostile_object.npz", "w") as z:
        buffer = __import__("io").BytesIO()
        np.save(buffer, data["w"])
        z.writestr("w.npy", buffer.getvalue())
        z.writestr("system.npy", npy_object_member(reduce_call("os", "system", f"touch {SENTINEL}")))
        z.writestr("eval.npy", npy_object_member(reduce_call("builtins", "eval", f"open('{SENTINEL}', 'w')")))


if __name__ == "__main__":
    main()
