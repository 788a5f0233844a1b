"""global-norm and stats of a checkpoint by --jobs 1, 2, 4, 8, 16, against `cat` of it: medians of REPS
alternating rounds (cat, global-norm, stats) per --jobs, as a table (the lent 16-core machine's figures in the
README's Performance section). With a fourth argument, another clipcli command (an older tree) instead of `cat`:
each command of each, alternating, by --jobs 2, 8 and 16.

    python benchmarks/scaling.py benchmarks/data/f32-2g.safetensors clipcli 5
    python benchmarks/scaling.py FILE "env PYTHONPATH=$PWD python -P -m clipcli" 5 \
        "env PYTHONPATH=$PWD/../before python -P -m clipcli"
"""

import statistics
import subprocess
import sys
import time


def seconds(command: str) -> float:
    """Wall time of one shell command; fails loudly if it fails."""
    start = time.perf_counter()
    subprocess.run(command, shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(path: str, clipcli: str, reps: int) -> None:
    seconds(f"cat {path} > /dev/null")  # the page cache warm
    print("| --jobs | cat | global-norm | gn / cat | stats | stats / gn |")
    print("|---|---|---|---|---|---|")
    for jobs in (1, 2, 4, 8, 16):
        cat, norm, stats = [], [], []
        for _ in range(reps):
            cat.append(seconds(f"cat {path} > /dev/null"))
            norm.append(seconds(f"{clipcli} global-norm {path} -q --jobs {jobs}"))
            stats.append(seconds(f"{clipcli} stats {path} -q --jobs {jobs}"))
        c, g, s = map(statistics.median, (cat, norm, stats))
        print(f"| {jobs} | {c:.3f} s | {g:.3f} s | {g / c:.2f}x | {s:.3f} s | {s / g:.2f}x |", flush=True)


def versus(path: str, clipcli: str, reps: int, other: str) -> None:
    seconds(f"cat {path} > /dev/null")
    print("| --jobs | command | the other | this | ratio |")
    print("|---|---|---|---|---|")
    for jobs in (2, 8, 16):
        for command in ("global-norm", "stats"):
            theirs, ours = [], []
            for _ in range(reps):
                theirs.append(seconds(f"{other} {command} {path} -q --jobs {jobs}"))
                ours.append(seconds(f"{clipcli} {command} {path} -q --jobs {jobs}"))
            t, o = statistics.median(theirs), statistics.median(ours)
            print(f"| {jobs} | {command} | {t:.3f} s | {o:.3f} s | {o / t:.2f}x |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 4:
        versus(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
