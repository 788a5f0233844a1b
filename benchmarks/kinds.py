"""In one process: the engine's three kinds of workers on the same checkpoints, best of --reps.

    python benchmarks/kinds.py                 # the checkpoints benchmarks/run.py made (2 GiB float32, ...)
    python benchmarks/kinds.py --jobs 4

For each checkpoint the time of global-norm's kernel (and diff's, on two float32 checkpoints) run inline
(one worker, the caller), by `--jobs` threads, and by `--jobs` forked processes. Threads share one GIL:
what NumPy does between its kernels, and BLAS calls, which serialise, hold them back; processes share
nothing but the page cache. Only ratios from one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clipcli.checkpoint import engine as _engine
from clipcli.checkpoint import open_checkpoint
from clipcli.commands.diff import DiffKernel
from clipcli.commands.measure import NormKernel
from clipcli.core.blocks import BLOCK

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diff_core import best  # the best of some runs, as diff_core.py takes it

DATA = Path(__file__).resolve().parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="2")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    j = args.jobs
    print(f"| kernel | inline | {j} threads | {j} processes | threads / inline | processes / inline |")
    print("|---|---|---|---|---|---|")
    for name in (f"f32-{args.gib}g", f"bf16-{args.gib}g", f"f16-{args.gib}g"):
        path = DATA / f"{name}.safetensors"
        if not path.exists():
            continue
        with open_checkpoint(path) as ckpt:
            times = [
                best(
                    lambda k=kind, n=jobs: _engine.run(
                        ckpt, ckpt.tensors, lambda: NormKernel(2.0), n, kind=k, unit=BLOCK
                    ),
                    args.reps,
                )
                for kind, jobs in (("inline", 1), ("threads", j), ("processes", j))
            ]
        row(f"global-norm {name}", times)
    a, b = DATA / f"f32-{args.gib}g.safetensors", DATA / f"f32-{args.gib}g-b.safetensors"
    if a.exists() and b.exists():
        with open_checkpoint(a) as ca, open_checkpoint(b) as cb:
            pairs = list(zip(ca.tensors, cb.tensors, strict=True))
            numeric = [True] * len(pairs)
            times = [
                best(
                    lambda k=kind, n=jobs: _engine.run_pairs(
                        (ca, cb), pairs, lambda: DiffKernel(2.0, pairs, numeric), n, BLOCK, kind=k
                    ),
                    args.reps,
                )
                for kind, jobs in (("inline", 1), ("threads", j), ("processes", j))
            ]
        row("diff f32 A B", times)


def row(label: str, times: list[float]) -> None:
    inline, threads, processes = times
    print(
        f"| {label} | {inline:.3f} s | {threads:.3f} s | {processes:.3f} s | "
        f"{threads / inline:.2f}x | {processes / inline:.2f}x |",
        flush=True,
    )


if __name__ == "__main__":
    main()
