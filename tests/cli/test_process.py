"""What the console script sets up for its own process, and only for it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tests.helpers import ROOT, write_st

# The console script's `main` in a fresh interpreter, then the threads the process holds (Linux: /proc).
_THREADS = """
import os, sys
from clipcli.__main__ import main
sys.argv = ["clipcli", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
import numpy
print(len(os.listdir("/proc/self/task")), os.environ.get("OPENBLAS_NUM_THREADS"))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def test_numpy_starts_no_blas_threads_in_a_run_and_a_setting_of_the_users_is_kept(tmp_path):
    # OpenBLAS starts a thread per core at NumPy's import, spinning ~0.05 s of a core: clipcli needs none
    path = write_st(tmp_path / "a.safetensors", {"w": np.ones(4, np.float32)})
    args = [sys.executable, "-c", _THREADS, "global-norm", str(path), "-q"]
    done = subprocess.run(args, capture_output=True, text=True, env=_env(), timeout=60, check=True)
    assert done.stdout.split() == ["1", "1"]  # the main thread alone
    kept = subprocess.run(args, capture_output=True, text=True, env=_env(OPENBLAS_NUM_THREADS="3"), timeout=60)
    assert kept.stdout.split()[1] == "3"
