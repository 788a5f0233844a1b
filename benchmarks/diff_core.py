"""Times DiffAccumulator against two NormAccumulators on the same pair of tensors, in one process.

    python benchmarks/diff_core.py                 # 64 MiB per side of float32, then bfloat16
    python benchmarks/diff_core.py --mib 256 --reps 5

For each dtype: the best of --reps runs of `DiffAccumulator.add(a, b)` (the p = 2 fast path),
`DiffAccumulator.add_identical(a)`, and two `NormAccumulator.add` calls (one per tensor, as
`global-norm` of both files computes them), each with `result()`, and the ratios. Rounds alternate,
so drift of a shared machine touches both sides alike; only ratios from one run mean anything.
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from clipcli.core.differences import DiffAccumulator
from clipcli.core.norms import NormAccumulator


def best(f, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64, help="size of each tensor (MiB)")
    parser.add_argument("--reps", type=int, default=5, help="runs per figure (the best is kept)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per dtype")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for dtype in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        n = int(args.mib * 2**20) // dtype.itemsize
        a = rng.standard_normal(n, dtype=np.float32).astype(dtype)
        b = (a.astype(np.float32) + rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)).astype(dtype)

        def norms(a=a, b=b):
            for x in (a, b):
                acc = NormAccumulator(2)
                acc.add(x)
                acc.result()

        def diff(a=a, b=b):
            acc = DiffAccumulator(2)
            acc.add(a, b)
            acc.result()

        def identical(a=a):
            acc = DiffAccumulator(2)
            acc.add_identical(a)
            acc.result()

        for _ in range(args.rounds):
            tn, td, ti = best(norms, args.reps), best(diff, args.reps), best(identical, args.reps)
            print(
                f"{dtype.name:>8} {args.mib:g} MiB x 2: two norms {tn * 1e3:6.1f} ms, diff {td * 1e3:6.1f} ms "
                f"(x{td / tn:.2f}), add_identical {ti * 1e3:6.1f} ms (x{ti / tn:.2f})"
            )


if __name__ == "__main__":
    main()
