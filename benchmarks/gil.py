"""How much of a worker's chunk time holds the GIL, by profile (issue 13's measure where no 16-core
machine is lent).

Runs each command with one worker (`--jobs 1`, in the caller) under py-spy with native frames
(`pip install py-spy`; it needs ptrace), keeps the samples taken inside the engine's task loop, and
sorts each by its innermost frame: NumPy's compiled inner loops (casts, minimum/maximum, bit operations),
BLAS and the read system calls release the GIL; everything else there — the interpreter, NumPy's
dispatch between kernels, ml_dtypes' casts (NumPy runs a user dtype's legacy cast with the GIL held) —
holds it. The GIL's share bounds what
threads can gain (Amdahl: n threads take at least share + (1 - share) / n of one's time); worker
processes, which clipcli uses for large inputs, do not share it.

    python benchmarks/gil.py            # the 2 GiB checkpoints of benchmarks/data (made if missing)
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import ensure

KINDS = [("f32", "f32", "float32"), ("bf16", "bf16", "bfloat16"), ("f16", "f16", "float16")]

# Innermost native frames that run without the GIL: NumPy's inner loops, BLAS, reads, clipcli's own loops.
RELEASED = re.compile(
    r"_X86_|_AVX|_contig_cast|_cast_|aligned_|_strided_|_to_|BINARY_|UNARY_|_maximum|_minimum|_bitwise|_shift"
    r"|_and_|simd_|dot_compute|ddot|openblas|preadv|pread64|__libc_pread|\bread \(libc|_fused\.c"
)
LOOP = "loop (clipcli/checkpoint/engine.py"


def share(raws: list[Path]) -> tuple[float, int, list[tuple[str, float]]]:
    """(GIL share, samples in the loop, the largest innermost frames and their shares) of py-spy raw files."""
    leaves: collections.Counter[str] = collections.Counter()
    for raw in raws:
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if LOOP in stack:
                leaves[stack.split(";")[-1]] += int(count)
    total = sum(leaves.values())
    held = sum(n for leaf, n in leaves.items() if not RELEASED.search(leaf))
    top = [(leaf, n / total) for leaf, n in leaves.most_common(6)]
    return held / max(total, 1), total, top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=100, help="samples a second (more and py-spy falls behind)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command, their samples added")
    args = parser.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    files = {kind: ensure(f"{tag}-2g.safetensors", 2.0, dtype) for kind, tag, dtype in KINDS}
    b = ensure("f32-2g-b.safetensors", 2.0, "float32", perturb=1e-3)
    runs = {f"global-norm {kind}": ["global-norm", str(path)] for kind, path in files.items()}
    runs["diff f32 (slightly different)"] = ["diff", str(files["f32"]), str(b)]
    runs["clip-global-norm --dry-run f32"] = ["clip-global-norm", str(files["f32"]), "--clip-norm", "1", "--dry-run"]
    print("| command (one worker) | samples in the chunk loop | holding the GIL | largest innermost frames |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, command in runs.items():
            clipcli = [sys.executable, "-m", "clipcli", *command, "--jobs", "1", "--quiet"]
            subprocess.run(clipcli, check=True)  # the page cache warm: reads cost what a copy costs
            raws = [Path(tmp) / f"raw{i}.txt" for i in range(args.repeat)]
            for raw in raws:
                spy_args = ["record", "--native", "-r", str(args.rate), "--format", "raw", "-o", str(raw), "--"]
                done = subprocess.run([spy, *spy_args, *clipcli], check=True, capture_output=True, text=True)
                if "behind in sampling" in done.stderr:
                    print(f"({name}: py-spy fell behind; take a lower --rate)", file=sys.stderr)
            held, samples, top = share(raws)
            frames = ", ".join(f"{leaf.split(' (')[0]} {s:.0%}" for leaf, s in top)
            print(f"| {name} | {samples} | {held:.0%} | {frames} |")


if __name__ == "__main__":
    main()
