"""Times StatsAccumulator.add against NormAccumulator.add (what global-norm runs) over one float32 array.

    python benchmarks/stats_core.py                  # 256 MiB of float32, 7 alternating rounds
    python benchmarks/stats_core.py --mib 64 --rounds 5

The array is fed as the engine gives it, in chunks of `PIECE` values, to a fresh accumulator of each kind,
whose `result()` is taken too. Rounds alternate the two, so that drift of a shared machine touches both
alike; each side's figure is the median over the rounds of its thread's CPU time (the machine is shared:
wall time counts the neighbours' work too), and its wall time beside it. Only ratios from one run mean
anything. The values are normals of scale 0.02 (a checkpoint's weights): no NaN, inf or overflow. The
clipcli measured is the one of this checkout (not an editable install of another), as the first line says.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's clipcli

import clipcli
from clipcli.core.blocks import PIECE
from clipcli.core.norms import NormAccumulator
from clipcli.core.stats import StatsAccumulator


def timed(f) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) of f()."""
    cpu, wall = time.thread_time(), time.perf_counter()
    f()
    return time.thread_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=256, help="size of the array (MiB)")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    args = parser.parse_args()
    print(f"clipcli of {Path(clipcli.__file__).parent}")
    n = int(args.mib * 2**20) // 4
    x = (np.random.default_rng(0).standard_normal(n, dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    def stats() -> None:
        acc = StatsAccumulator(np.float32)
        for start in range(0, n, PIECE):
            acc.add(x[start : start + PIECE], start)
        acc.result()

    def norm() -> None:
        acc = NormAccumulator(2)
        for start in range(0, n, PIECE):
            acc.add(x[start : start + PIECE])
        acc.result()

    times: dict[str, list[tuple[float, float]]] = {"norm": [], "stats": []}
    stats()  # warm: tables, scratch buffers
    for _ in range(args.rounds):
        for name, f in (("norm", norm), ("stats", stats)):
            times[name].append(timed(f))
    ns = {}
    for name, pairs in times.items():
        cpu = statistics.median(c for c, _ in pairs)
        wall = statistics.median(w for _, w in pairs)
        ns[name] = cpu / n * 1e9
        print(f"{name:>5}: {cpu * 1e3:7.1f} ms CPU ({ns[name]:.2f} ns/value), {wall * 1e3:7.1f} ms wall")
    print(f"stats / norm: x{ns['stats'] / ns['norm']:.2f}; stats beyond norm: {ns['stats'] - ns['norm']:.2f} ns/value")


if __name__ == "__main__":
    main()
