"""clipcli's own share of a run's fixed cost: its imports past NumPy and Typer, and the run (issue 22 item 24).

Each run is a fresh interpreter that imports NumPy and Typer (what every run pays, and most of the noise), then
starts the clock and runs the command line's `main`; the trees given take turns, so that the machine's moment
weighs on each alike. Prints each tree's median and minimum.

    python benchmarks/startup.py --reps 21 --trees .,/tmp/base -- global-norm benchmarks/data/many-1.safetensors -q
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

# The clock starts once NumPy and Typer are in (OPENBLAS_NUM_THREADS as the command sets it before NumPy's import).
RUN = """
import contextlib, io, os, sys, time
os.environ["OPENBLAS_NUM_THREADS"] = "1"
import numpy, typer.main
start = time.perf_counter()
from clipcli.__main__ import main
sys.argv = ["clipcli", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    main()
os.write(2, b"%f" % (time.perf_counter() - start))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--trees", default=".", help="comma-separated roots holding a `clipcli` package")
    parser.add_argument("args", nargs="+", help="the command line's arguments")
    a = parser.parse_args()
    # Python as users run it: with its bytecode cache (some sandboxes turn it off for every process).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    trees = [os.path.abspath(t) for t in a.trees.split(",")]
    times: dict[str, list[float]] = {t: [] for t in trees}
    for _ in range(a.reps):
        for tree in trees:
            done = subprocess.run(
                [sys.executable, "-P", "-c", RUN, *a.args],
                env={**env, "PYTHONPATH": tree},
                capture_output=True,
                check=True,
            )
            times[tree].append(float(done.stderr.decode().rsplit("\n", 1)[-1]) * 1e3)
    for tree, ms in times.items():
        print(f"{tree}: median {statistics.median(ms):.1f} ms, min {min(ms):.1f} ms over {a.reps} runs")


if __name__ == "__main__":
    main()
