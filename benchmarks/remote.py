"""Times `clipcli global-norm URL` against `curl -o /dev/null URL` on the loopback Range server, in alternating pairs.

    python benchmarks/remote.py                 # 2 GiB float32 (the goal: global-norm ≤ 1.3x curl)
    python benchmarks/remote.py --gib 0.5 --reps 5 --jobs 1,2,4
    python benchmarks/remote.py --before 'env PYTHONPATH=/tmp/old python -P -m clipcli'   # and another clipcli

Needs the remote extra (`pip install -e '.[remote]'`) and curl. The server is the tests' (`tests/servers.py`:
Python's threading HTTP server, bodies sent with `sendfile`), run in a process of its own so that neither side
shares its GIL. The checkpoint is generated into benchmarks/data/ (git-ignored) when missing and the page cache
warmed first. Prints the median wall time of each side over --reps alternating pairs and their ratio, and
beside them clipcli's on the local file (timed in the same rounds): what the network costs it; and, per row, the
requests, connections and bytes the server counted for one clipcli run. `--before CMD` times another clipcli (an
earlier commit's) in the same rounds, for a before/after. The machine is shared and noisy: only ratios measured
side by side in one run mean anything, and the load average printed before and after says how busy it was.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = HERE / "data"
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # Python as users run it

SERVE = """
import sys, threading
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.servers import RangeServer
server = RangeServer({"m.safetensors": Path(sys.argv[2])})
print(server.url, flush=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
for _ in sys.stdin:  # a line asks what was requested since the last one
    with server.lock:
        gets = [r for m, _, r in server.requests if m == "GET"]
        print(len(server.requests), len(gets), server.connections, server.sent, flush=True)
    server.reset()
    server.connections = 0
"""


def ensure(gib: float) -> Path:
    path = DATA / f"f32-{gib:g}g.safetensors"
    if not path.exists():
        DATA.mkdir(exist_ok=True)
        maker = [sys.executable, str(HERE / "make_checkpoint.py"), str(path), "--gib", str(gib), "--dtype", "float32"]
        subprocess.run(maker, check=True)
    return path


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=ENV)
    return time.perf_counter() - start


def asked(server: subprocess.Popen) -> list[int]:
    """The requests, GETs, connections and bytes sent the server counted since it was last asked."""
    server.stdin.write("\n")  # type: ignore[union-attr]
    server.stdin.flush()  # type: ignore[union-attr]
    return [int(n) for n in server.stdout.readline().split()]  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the float32 checkpoint (default 2)")
    parser.add_argument("--reps", type=int, default=5, help="alternating pairs per row (default 5)")
    parser.add_argument("--jobs", default="", help="--jobs values to time, comma-separated (default: clipcli's own)")
    parser.add_argument(
        "--clipcli", default=f"{shlex.quote(sys.executable)} -P -m clipcli", help="how to run clipcli (default: -P)"
    )
    parser.add_argument("--before", default="", help="another clipcli to time in the same rounds (a command line)")
    args = parser.parse_args(argv)
    path = ensure(args.gib)
    subprocess.run(["cat", str(path)], check=True, stdout=subprocess.DEVNULL)  # the page cache, warmed
    server = subprocess.Popen(
        [sys.executable, "-c", SERVE, str(ROOT), str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        url = f"{server.stdout.readline().strip()}/m.safetensors"  # type: ignore[union-attr]
        curl = ["curl", "-sS", "--fail", "-o", "/dev/null", url]
        clip = [*shlex.split(args.clipcli), "global-norm", url, "--quiet"]
        env_path = os.pathsep.join(p for p in (str(ROOT), ENV.get("PYTHONPATH", "")) if p)
        ENV["PYTHONPATH"] = env_path
        size, load = path.stat().st_size / 2**30, "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
        print(f"{path.name}: {size:.2f} GiB over {url.rsplit('/', 1)[0]}, {args.reps} pairs ({load})")
        before = "| before, the URL | ratio " if args.before else ""
        print(f"| command {before}| clipcli, the URL | curl -o /dev/null | ratio | clipcli, the local file |")
        print("|---|---:|---:|---:|---:|" + ("---:|---:|" if args.before else ""))
        counted = []
        for jobs in [j for j in args.jobs.split(",") if j] or [None]:
            extra = [] if jobs is None else ["--jobs", jobs]
            ours, local = clip + extra, [*shlex.split(args.clipcli), "global-norm", str(path), "--quiet", *extra]
            label = "global-norm" + ("" if jobs is None else f" --jobs {jobs}")
            asked(server)
            timed(ours), timed(curl)  # a first pair for the caches, not counted
            requests, gets, connections, sent = asked(server)  # of that clipcli run and curl's
            mine = (sent - path.stat().st_size) / 2**30  # curl's 1 request, 1 connection and the file, taken off
            counted.append(
                f"{label}: {requests - 1} requests ({gets - 1} GETs), {connections - 1} connections, {mine:.3f} GiB"
            )
            then = [*shlex.split(args.before), "global-norm", url, "--quiet", *extra] if args.before else None
            runs = [(timed(ours), timed(curl), timed(local), timed(then) if then else 0.0) for _ in range(args.reps)]
            a, b, c, d = (statistics.median(r[k] for r in runs) for k in range(4))
            was = f" {d:.2f} s | {d / b:.2f}x |" if then else ""
            print(f"| {label} |{was} {a:.2f} s | {b:.2f} s | {a / b:.2f}x | {c:.2f} s |", flush=True)
        print("\nAt the server, one run of each (curl: 1 GET):", "; ".join(counted))
        print("After: load average {:.2f} {:.2f} {:.2f} (other work on the machine's cores)".format(*os.getloadavg()))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
