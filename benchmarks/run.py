"""Times clipcli against `cat`, `cat && cp`, `cmp` and naive baselines, as whole processes, in alternating pairs.

    python benchmarks/run.py                       # everything (2 GiB float32, 1 GiB bfloat16 and float16)
    python benchmarks/run.py --gib 0.25            # a quick one
    python benchmarks/run.py --jobs 1,2,4,8,16     # the scaling tables, one per --jobs
    python benchmarks/run.py --only scaling,tiny   # some sections: scaling, baselines, diff, trust, torch,
                                                   # distcp, workers, tiny, help, memory
    python -P benchmarks/run.py --clipcli "env PYTHONPATH=$PWD python -P -m clipcli" \
        --versus "env PYTHONPATH=$PWD/../before python -P -m clipcli"   # this tree against another, row by row
                                                   # (-P: `python -m` would import the clipcli in the cwd)

Prints, for each comparison, the median wall time of each side over --reps alternating pairs, the ratio of
the medians, and each side's peak memory: the largest sum of PSS (proportional set size: a page shared by
n processes counts 1/n to each) over the command's whole process tree, clipcli's worker processes
included, sampled every 5 ms in a run of its own. Checkpoints are generated into benchmarks/data/
(git-ignored) when missing (the PyTorch one needs torch: --torch-python names a Python that has it); the
page cache is warmed first. The machine is shared and noisy: only ratios measured side by side in one run
mean anything. `cp` copies with copy_file_range and does not fsync; neither does clipcli's atomic write of a
new file (the outputs are removed between runs; a write that replaces a file is fsynced).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
PY = shlex.quote(sys.executable)
q = shlex.quote
# Python as users run it: with its bytecode cache (some sandboxes turn it off for every process).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

NAIVE_NORM = """
import sys, numpy as np
from safetensors import safe_open
total = 0.0
with safe_open(sys.argv[1], "np") as f:
    for k in f.keys():
        total += float(np.linalg.norm(f.get_tensor(k))) ** 2
print(total ** 0.5)
"""

NAIVE_LOAD_NORM = """
import sys, numpy as np
from safetensors.numpy import load_file
print(sum(float(np.linalg.norm(t)) ** 2 for t in load_file(sys.argv[1]).values()) ** 0.5)
"""

NAIVE_CLIP = """
import sys, numpy as np
from safetensors.numpy import load_file, save_file
tensors = load_file(sys.argv[1])
g = sum(float(np.linalg.norm(t)) ** 2 for t in tensors.values()) ** 0.5
scale = np.float32(5.0 / max(g, 5.0))
save_file({k: t * scale for k, t in tensors.items()}, sys.argv[2])
"""

# What a one-off comparison script does: per tensor ‖A−B‖ and the cosine, both files opened with safe_open.
NAIVE_DIFF = """
import sys, numpy as np
from safetensors import safe_open
with safe_open(sys.argv[1], "np") as fa, safe_open(sys.argv[2], "np") as fb:
    for k in fa.keys():
        a, b = fa.get_tensor(k).astype(np.float64), fb.get_tensor(k).astype(np.float64)
        d = float(np.linalg.norm(a - b))
        cos = float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)))
"""

# What a one-off script does to compare two small files: load both, ‖A−B‖ in float64 tensor by tensor.
NAIVE_LOAD_DIFF = """
import sys, numpy as np
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
total = 0.0
for k, x in a.items():
    d = float(np.linalg.norm(x.astype(np.float64) - b[k].astype(np.float64)))
    total += d * d
print(total ** 0.5)
"""

TORCH_CONVERT = """
import sys, torch
from safetensors.torch import save_file
state = torch.load(sys.argv[1], weights_only=True)
save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2])
"""

# The same tensors with what fairseq and scientific checkpoints keep beside them: an argparse.Namespace of the
# run's arguments and a config of NumPy arrays and scalars (clipcli reads them as inert placeholders and data).
TORCH_SAVE_WITH_CONFIG = """
import argparse, sys
import numpy as np, torch
from safetensors.torch import load_file
state = load_file(sys.argv[1])
state["args"] = argparse.Namespace(arch="transformer_lm", lr=[3e-4], betas="(0.9, 0.98)", layers=48, seed=1)
state["config"] = {
    "mean": np.linspace(0, 1, 4096, dtype=np.float32), "cov": np.eye(64), "mask": np.ones(1000, bool),
    "scale": np.float64(0.5), "steps": np.int64(100000), "cutoff": np.float32(6.0),
}
torch.save(state, sys.argv[2])
"""

# The commands with 16 workers whatever the cores (the command line never starts more than the cores).
SIXTEEN_WORKERS = """
import sys
from pathlib import Path
from clipcli.checkpoint import open_checkpoint
from clipcli.commands import clip, diff, global_norm
command, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
with open_checkpoint(path) as ckpt:
    if command == "global-norm":
        global_norm.global_norm(ckpt, global_norm.NormOptions(jobs=16))
    elif command == "clip-global-norm":
        clip.clip_global_norm(ckpt, clip.ClipGlobalNormOptions(output=Path(out), clip_norm=5.0, jobs=16))
    elif command == "diff":
        with open_checkpoint(out) as other:
            diff.diff(ckpt, other, diff.DiffOptions(jobs=16))
"""

NPZ_LOAD_ALL = """
import sys, numpy as np
with np.load(sys.argv[1]) as z:
    for k in z.files:
        z[k]
"""


def tree_pss(pid: int) -> int:
    """The PSS (KiB) of a process and all its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def measure(command: str) -> float:
    """Wall time (s) of one shell command; fails loudly if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(["bash", "-c", command], stdout=subprocess.DEVNULL, env=ENV)
    _, status, _ = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({status}): {command}")
    return elapsed


def peak_memory(command: str) -> float:
    """The largest PSS (MiB) of the command's process tree, sampled every 5 ms (a run of its own)."""
    if not os.path.exists("/proc/self/smaps_rollup"):
        return float("nan")
    proc = subprocess.Popen(["bash", "-c", "exec " + command], stdout=subprocess.DEVNULL, env=ENV)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_pss(proc.pid))
        time.sleep(0.005)
    return peak / 1024


# How to run clipcli (--clipcli), and the other clipcli that --versus puts in every baseline's place.
CLIPCLI = {"ours": "clipcli", "versus": ""}


def compare(label: str, ours: str, baseline: str, reps: int, cleanup: str = "", memory: bool = True) -> dict:
    """Alternating pairs: baseline, ours, baseline, ours, ... Medians and their ratio. With --versus, the
    baseline is the same command run by the other clipcli (`ours` always starts with `clipcli `)."""
    command = ours.removeprefix("clipcli ")
    ours = f"{CLIPCLI['ours']} {command}"
    if CLIPCLI["versus"]:
        baseline = f"{CLIPCLI['versus']} {command}"
    elif baseline.startswith("clipcli "):
        baseline = f"{CLIPCLI['ours']} {baseline.removeprefix('clipcli ')}"
    a_times, b_times = [], []
    measure(baseline)  # warm the page cache and the interpreter's files
    measure(ours)
    for _ in range(reps):
        b_times.append(measure(baseline))
        if cleanup:
            measure(cleanup)
        a_times.append(measure(ours))
        if cleanup:
            measure(cleanup)
    ours_mem = peak_memory(ours) if memory else float("nan")
    base_mem = peak_memory(baseline) if memory else float("nan")
    if cleanup:
        measure(cleanup)
    row = {"label": label, "ours": statistics.median(a_times), "baseline": statistics.median(b_times)}
    row["ratio"] = row["ours"] / row["baseline"]
    print(
        f"| {label} | {row['ours']:.3f} s | {row['baseline']:.3f} s | **{row['ratio']:.2f}x** | "
        f"{ours_mem:.0f} MiB | {base_mem:.0f} MiB |",
        flush=True,
    )
    return row


def ensure(name: str, gib: float, dtype: str, compressed: bool = False, scale: float = 1.0, perturb=0.0) -> Path:
    path = DATA / name
    if not path.exists():
        DATA.mkdir(exist_ok=True)
        args = [sys.executable, str(HERE / "make_checkpoint.py"), str(path), "--gib", str(gib), "--dtype", dtype]
        args += ["--scale", str(scale), "--perturb", str(perturb)]
        subprocess.run([*args, *(["--compressed"] if compressed else [])], check=True)
    return path


def ensure_many(path: Path, n: int, shape: tuple[int, int] = (16, 8), perturb: float = 0.0) -> Path:
    """A LoRA-adapter-like checkpoint of `n` tiny float32 tensors (the same values for every `perturb`, plus
    `perturb` times noise of their scale)."""
    if not path.exists():
        DATA.mkdir(exist_ok=True)
        code = (
            "import sys, numpy as np; from safetensors.numpy import save_file; "
            "rng, noise = np.random.default_rng(0), np.random.default_rng(1); "
            f"save_file({{f'base_model.model.layers.{{i // 8}}.lora_{{i % 2}}.{{i}}.weight': "
            f"(rng.standard_normal({shape}) + {perturb} * noise.standard_normal({shape})).astype(np.float32) "
            f"for i in range({n})}}, sys.argv[1])"
        )
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    return path


def ensure_shards(path: Path, source: Path, n: int) -> Path:
    """`source` converted to a sharded directory of `n` shards (and its index)."""
    if not path.exists():
        size = source.stat().st_size // n + 1
        command = f"{CLIPCLI['ours']} convert {q(str(source))} -o {q(str(path))} --max-shard-size {size} -q"
        subprocess.run(["bash", "-c", command], check=True, env=ENV)
    return path


def ensure_members(path: Path, n: int) -> Path:
    """An .npz of `n` small members (gensim's test data has one of 7,488)."""
    if not path.exists():
        DATA.mkdir(exist_ok=True)
        code = (
            "import sys, numpy as np; rng = np.random.default_rng(1); "
            f"np.savez(sys.argv[1], **{{f'v{{i}}': rng.standard_normal(rng.integers(1, 200)) for i in range({n})}})"
        )
        subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    return path


def ensure_torch(path: Path, source: Path, python: str, code: str = "") -> Path | None:
    """The same tensors as a torch.save state dict, written by real torch (by `code`, given both paths)."""
    if not path.exists():
        code = code or (
            "import sys, torch; from safetensors.torch import load_file; "
            "torch.save(load_file(sys.argv[1]), sys.argv[2])"
        )
        if subprocess.run([python, "-c", code, str(source), str(path)], check=False).returncode != 0:
            return None
    return path


def header() -> None:
    print("| comparison | clipcli | baseline | ratio | clipcli peak PSS | baseline peak PSS |")
    print("|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="size of the float32 checkpoint (half for 16-bit)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--jobs", default="", help="comma-separated --jobs for the scaling tables (default: cores)")
    parser.add_argument("--only", default="", help="comma-separated sections")
    parser.add_argument("--torch-python", default=os.environ.get("TORCH_PYTHON", ""), help="a Python with torch")
    parser.add_argument("--clipcli", default="clipcli", help="how to run clipcli (e.g. 'python -m clipcli')")
    parser.add_argument("--versus", default="", help="another clipcli command: every row times it as the baseline")
    args = parser.parse_args()
    CLIPCLI.update(ours=args.clipcli, versus=args.versus)
    gib, reps = args.gib, args.reps
    everything = {"scaling", "baselines", "diff", "trust", "torch", "distcp", "workers", "tiny", "help"}
    sections = set(filter(None, args.only.split(","))) or everything
    sections |= {"memory"} if not args.only else set()
    tag = f"{gib:g}g"
    if sections - {"tiny", "help"}:  # (the sections of small files need none of the large ones)
        f32 = ensure(f"f32-{tag}.safetensors", gib, "float32")
        bf16 = ensure(f"bf16-{tag}.safetensors", gib / 2, "bfloat16")
        f16 = ensure(f"f16-{tag}.safetensors", gib / 2, "float16")
    out = DATA / "out.safetensors"
    clean = f"rm -f {q(str(out))}"
    print(
        f"clipcli benchmarks, {time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, medians of {reps} alternating pairs\n",
        flush=True,
    )
    if args.versus:
        print(f"Every baseline below is the row's own clipcli command run by `{args.versus}`.\n", flush=True)

    if "scaling" in sections:
        b32 = ensure(f"f32-{tag}-b.safetensors", gib, "float32", perturb=1e-3)
        for jobs in [int(j) for j in args.jobs.split(",") if j] or [os.cpu_count() or 1]:
            j = f"--jobs {jobs}"
            print(f"\n### --jobs {jobs}\n")
            header()
            compare(
                f"global-norm {gib:g} GiB float32 vs `cat`",
                f"clipcli global-norm {q(str(f32))} -q {j}",
                f"cat {q(str(f32))} > /dev/null",
                reps,
            )
            compare(
                f"global-norm {gib / 2:g} GiB bfloat16 vs `cat`",
                f"clipcli global-norm {q(str(bf16))} -q {j}",
                f"cat {q(str(bf16))} > /dev/null",
                reps,
            )
            compare(
                f"global-norm {gib / 2:g} GiB float16 vs `cat`",
                f"clipcli global-norm {q(str(f16))} -q {j}",
                f"cat {q(str(f16))} > /dev/null",
                reps,
            )
            compare(
                f"clip-global-norm {gib:g} GiB float32 vs `cat && cp`",
                f"clipcli clip-global-norm {q(str(f32))} -o {q(str(out))} --clip-norm 5 -q {j}",
                f"cat {q(str(f32))} > /dev/null && cp {q(str(f32))} {q(str(out))}",
                reps,
                clean,
            )
            compare(
                f"diff two {gib:g} GiB float32 vs `cat A B`",
                f"clipcli diff {q(str(f32))} {q(str(b32))} -q {j}",
                f"cat {q(str(f32))} {q(str(b32))} > /dev/null",
                reps,
            )

    if "baselines" in sections:
        print("\n### Naive scripts\n")
        header()
        compare(
            f"global-norm {gib:g} GiB float32 vs naive `safe_open` + `np.linalg.norm`",
            f"clipcli global-norm {q(str(f32))} -q",
            f"{PY} -c {q(NAIVE_NORM)} {q(str(f32))}",
            reps,
        )
        compare(
            f"global-norm {gib:g} GiB float32 vs naive `load_file` + norms",
            f"clipcli global-norm {q(str(f32))} -q",
            f"{PY} -c {q(NAIVE_LOAD_NORM)} {q(str(f32))}",
            reps,
        )
        compare(
            f"clip-global-norm {gib:g} GiB float32 vs naive load/scale/`save_file`",
            f"clipcli clip-global-norm {q(str(f32))} -o {q(str(out))} --clip-norm 5 -q",
            f"{PY} -c {q(NAIVE_CLIP)} {q(str(f32))} {q(str(out))}",
            max(3, reps // 2),
            clean,
        )

    if "diff" in sections:
        b32 = ensure(f"f32-{tag}-b.safetensors", gib, "float32", perturb=1e-3)
        copy = DATA / f"f32-{tag}-copy.safetensors"
        if not copy.exists():
            subprocess.run(["cp", str(f32), str(copy)], check=True)
        print("\n### diff\n")
        header()
        compare(
            f"diff two {gib:g} GiB float32 vs `global-norm A B` (one pass over each)",
            f"clipcli diff {q(str(f32))} {q(str(b32))} -q",
            f"clipcli global-norm {q(str(f32))} {q(str(b32))} -q",
            reps,
        )
        compare(
            f"diff two {gib:g} GiB float32 vs naive `safe_open` + NumPy ‖A−B‖ and cosine",
            f"clipcli diff {q(str(f32))} {q(str(b32))} -q",
            f"{PY} -c {q(NAIVE_DIFF)} {q(str(f32))} {q(str(b32))}",
            max(3, reps // 2),
        )
        compare(
            f"diff of identical {gib:g} GiB files vs `cmp A B`",
            f"clipcli diff {q(str(f32))} {q(str(copy))} -q",
            f"cmp {q(str(f32))} {q(str(copy))}",
            reps,
        )

    if "trust" in sections:
        shards = ensure_shards(DATA / f"f32-{tag}-10-shards", f32, 10)
        one = ensure_many(DATA / "many-1.safetensors", 1)
        print("\n### Can I trust this checkpoint? (stats, hash, verify)\n")
        header()
        compare(
            f"stats {gib:g} GiB float32 vs `global-norm` of it",
            f"clipcli stats {q(str(f32))} -q",
            f"clipcli global-norm {q(str(f32))} -q",
            reps,
        )
        compare(
            f"hash {gib:g} GiB float32 vs `sha256sum`",
            f"clipcli hash {q(str(f32))} -q",
            f"sha256sum {q(str(f32))}",
            reps,
        )
        row = compare(
            f"verify of {gib:g} GiB in 10 shards (no --values) vs verify of a 1-tensor file",
            f"clipcli verify {q(str(shards))} -q",
            f"clipcli verify {q(str(one))} -q",
            reps,
        )
        print(f"\nverify of 10 shards, beyond start-up: {row['ours'] - row['baseline']:+.3f} s", flush=True)

    if "torch" in sections:
        print("\n### PyTorch files\n")
        header()
        out_pt = DATA / "out.pt"
        compare(
            f"convert {gib:g} GiB float32 `.safetensors` to `.pt` vs `cat && cp`",
            f"clipcli convert {q(str(f32))} -o {q(str(out_pt))} -q",
            f"cat {q(str(f32))} > /dev/null && cp {q(str(f32))} {q(str(out_pt))}",
            reps,
            f"rm -f {q(str(out_pt))}",
        )
        pt = ensure_torch(DATA / f"f32-{tag}.pt", f32, args.torch_python or sys.executable)
        if pt is None:
            print("\n(no torch: the other PyTorch rows are left out; give --torch-python)\n")
        else:
            compare(
                f"global-norm {gib:g} GiB float32 `.pt` vs the same tensors as `.safetensors`",
                f"clipcli global-norm {q(str(pt))} -q",
                f"clipcli global-norm {q(str(f32))} -q",
                reps,
            )
            configured = ensure_torch(
                DATA / f"f32-{tag}-config.pt", f32, args.torch_python or sys.executable, TORCH_SAVE_WITH_CONFIG
            )
            if configured is not None:  # goal: 1.05x (issue 24)
                compare(
                    f"global-norm {gib:g} GiB float32 `.pt` with a Namespace and a NumPy config vs the plain `.pt`",
                    f"clipcli global-norm {q(str(configured))} -q 2>/dev/null",  # its audit's warning
                    f"clipcli global-norm {q(str(pt))} -q",
                    reps,
                )
            compare(
                f"convert {gib:g} GiB `.pt` to `.safetensors` vs `cat && cp`",
                f"clipcli convert {q(str(pt))} -o {q(str(out))} -q",
                f"cat {q(str(pt))} > /dev/null && cp {q(str(pt))} {q(str(out))}",
                reps,
                clean,
            )
            python = q(args.torch_python or sys.executable)
            compare(
                f"convert {gib:g} GiB `.pt` vs `torch.load` + `safetensors.torch.save_file`",
                f"clipcli convert {q(str(pt))} -o {q(str(out))} -q",
                f"{python} -c {q(TORCH_CONVERT)} {q(str(pt))} {q(str(out))}",
                max(3, reps // 2),
                clean,
            )

    if "distcp" in sections:
        dcp = DATA / f"dcp-{tag}"
        if not dcp.exists():
            code = (
                "import sys, torch, torch.distributed.checkpoint as dcp; from safetensors.torch import load_file; "
                "dcp.save(load_file(sys.argv[1]), checkpoint_id=sys.argv[2])"
            )
            python = args.torch_python or sys.executable
            if subprocess.run([python, "-W", "ignore", "-c", code, str(f32), str(dcp)], check=False).returncode:
                dcp = None
        if dcp is None:
            print("\n(no torch: the distributed checkpoint rows are left out; give --torch-python)\n")
        else:
            print("\n### Distributed checkpoints (torch.distributed.checkpoint)\n")
            header()
            compare(
                f"global-norm {gib:g} GiB float32 DCP vs the same tensors as `.safetensors`",
                f"clipcli global-norm {q(str(dcp))} -q",
                f"clipcli global-norm {q(str(f32))} -q",
                reps,
            )
            compare(
                f"convert {gib:g} GiB DCP to `.safetensors` vs `cat && cp` of its file",
                f"clipcli convert {q(str(dcp))} -o {q(str(out))} -q",
                f"cat {q(str(dcp / '__0_0.distcp'))} > /dev/null && cp {q(str(dcp / '__0_0.distcp'))} {q(str(out))}",
                max(3, reps // 2),
                clean,
            )

    if "workers" in sections:
        b32 = ensure(f"f32-{tag}-b.safetensors", gib, "float32", perturb=1e-3)
        print("\n### Peak PSS of 16 worker processes (MiB), whatever the cores\n")
        print("| command | peak PSS, 16 workers |\n|---|---|")
        for command, path, other in (
            ("global-norm", f32, out),
            ("global-norm", bf16, out),
            ("clip-global-norm", f32, out),
            ("clip-global-norm", bf16, out),
            ("diff", f32, b32),
        ):
            peak = peak_memory(f"{PY} -c {q(SIXTEEN_WORKERS)} {command} {q(str(path))} {q(str(other))}")
            print(f"| {command} {path.name} | {peak:.0f} |", flush=True)
        measure(clean)

    if "tiny" in sections:
        many = ensure_many(DATA / "many-10000.safetensors", 10_000)
        members = ensure_members(DATA / "members-7488.npz", 7488)
        # two LoRA adapters of 12,000 tensors of 8x16 float32 (6 MB each), and a copy of the first
        lora = ensure_many(DATA / "lora-12000.safetensors", 12_000, (8, 16))
        lora_b = ensure_many(DATA / "lora-12000-b.safetensors", 12_000, (8, 16), perturb=1e-3)
        lora_copy = DATA / "lora-12000-copy.safetensors"
        if not lora_copy.exists():
            subprocess.run(["cp", str(lora), str(lora_copy)], check=True)
        print("\n### Many small tensors\n")
        header()
        compare(
            "global-norm, 10,000 tiny tensors vs naive `safe_open` + `np.linalg.norm`",
            f"clipcli global-norm {q(str(many))} -q",
            f"{PY} -c {q(NAIVE_NORM)} {q(str(many))}",
            reps,
        )
        for what, other in (("changed", lora_b), ("identical", lora_copy)):
            compare(
                f"diff of two 12,000-tensor LoRA adapters ({what}) vs naive `load_file` + float64 ‖A−B‖",
                f"clipcli diff {q(str(lora))} {q(str(other))} -q",
                f"{PY} -c {q(NAIVE_LOAD_DIFF)} {q(str(lora))} {q(str(other))}",
                reps,
            )
        compare(
            "diff of two 12,000-tensor LoRA adapters (changed): the table vs JSON",
            f"clipcli diff {q(str(lora))} {q(str(lora_b))}",
            f"clipcli diff {q(str(lora))} {q(str(lora_b))} --format json",
            reps,
        )
        compare(
            "global-norm, 10,000 tiny tensors, JSON vs `python -c 'import numpy'`",
            f"clipcli global-norm {q(str(many))} --format json",
            f"{PY} -c 'import numpy'",
            reps,
        )
        compare(
            "global-norm, 10,000 tiny tensors: the table vs JSON",
            f"clipcli global-norm {q(str(many))}",
            f"clipcli global-norm {q(str(many))} --format json",
            reps,
        )
        compare(
            "inspect, 10,000 tiny tensors: the table vs JSON",
            f"clipcli inspect {q(str(many))}",
            f"clipcli inspect {q(str(many))} --format json",
            reps,
        )
        compare(
            "global-norm, .npz of 7,488 members vs `np.load` reading every member",
            f"clipcli global-norm {q(str(members))} -q",
            f"{PY} -c {q(NPZ_LOAD_ALL)} {q(str(members))}",
            reps,
        )

    if "help" in sections:
        print()
        header()
        compare(
            '`clipcli --help` vs `python -c "import numpy, typer, rich, safetensors.numpy, ml_dtypes"`',
            "clipcli --help",
            f"{PY} -c 'import numpy, typer, rich, safetensors.numpy, ml_dtypes'",
            reps,
        )

    if "memory" in sections:
        npz = ensure(f"f32-{tag}.npz", gib / 4, "float32")
        npz_c = ensure(f"f32-{tag}-deflated.npz", gib / 8, "float32", compressed=True)
        print("\n### Peak PSS over the whole process tree (MiB)\n")
        print("| command | --jobs 1 | --jobs 2 | --jobs 16 |\n|---|---|---|---|")
        for path in (f32, bf16, npz, npz_c):
            p = q(str(path))
            o = q(str(DATA / ("o" + path.suffix)))
            for label, command in (
                (f"global-norm {path.name}", f"clipcli global-norm {p} -q"),
                (f"clip-global-norm {path.name}", f"clipcli clip-global-norm {p} -o {o} --clip-norm 5 -q"),
                (f"clip-norm --axes 0 {path.name}", f"clipcli clip-norm {p} -o {o} --clip-norm 5 --axes 0 -q"),
                (f"clip-value {path.name}", f"clipcli clip-value {p} -o {o} --min -1 --max 1 -q"),
                (f"stats {path.name}", f"clipcli stats {p} -q"),
                (f"hash {path.name}", f"clipcli hash {p} -q"),
            ):
                peaks = [peak_memory(f"{command} --jobs {j}") for j in (1, 2, 16)]
                print(f"| {label} | " + " | ".join(f"{m:.0f}" for m in peaks) + " |", flush=True)
            measure(f"rm -f {o}")


if __name__ == "__main__":
    main()
