"""What a run imports and builds before its first tensor: the import diet of issue 22 item 24, pinned."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tests.helpers import ROOT, write_st

# Runs the console script's `main` in a fresh interpreter, counting the commands Typer builds, and prints the
# report's JSON and the modules of `HEAVY` that the run imported.
_RUN = """
import contextlib, io, json, sys
import typer.main

built = []
build = typer.main.get_command_from_info
typer.main.get_command_from_info = lambda *a, **kw: built.append(1) or build(*a, **kw)
from clipcli.cli import main

with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[2:])
    except SystemExit as e:
        assert not e.code, e.code
heavy = [m for m in sys.argv[1].split(",") if m in sys.modules]
print(json.dumps({"built": len(built), "heavy": heavy, "stdout": out.getvalue()}))
"""

# rich draws tables only, csv writes CSV only; the remote stores serve URLs only; hashlib is for hash and
# verify; the other commands' modules and other formats' readers (PyTorch's pickle machine) are for the runs
# that need them; ml_dtypes for tensors of its types (bfloat16, float8).
HEAVY = (
    "rich",
    "ml_dtypes",
    "fsspec",
    "http.client",
    "urllib.request",
    "ssl",
    "hashlib",
    "csv",
    "concurrent.futures",
    "clipcli.checkpoint.remote",
    "clipcli.checkpoint.httpfs",
    "clipcli.checkpoint.formats.torch",
    "clipcli.checkpoint.formats.npz",
    "clipcli.commands.diff",
    "clipcli.commands.clip",
    "clipcli.commands.hash",
    "clipcli.commands.stats",
    "clipcli.report.diff",
    "clipcli.report.progress",
)
# what only other commands use: the array operations and differences (their record types cost start-up), inspect's
# listing and the inspect command (with its options class), what writes and verifies checkpoints
NOT_FOR_NORMS = (
    "clipcli.core.ops",
    "clipcli.core.differences",
    "clipcli.report.listing",
    "clipcli.commands.inspect",
    "clipcli.checkpoint.write",
    "clipcli.checkpoint.defects",
    "shlex",
    # found this session: the atomic writer (safetensors' write), the pairs' runner (passes), and the header's
    # checking parse, which a header the reference writer laid out does not take (its JSON rules, 3 regexes)
    "clipcli.checkpoint.atomic",
    "clipcli.checkpoint.pairs",
    "clipcli.checkpoint.formats._strict_json",
)


def started(*args: object, heavy: tuple[str, ...] = HEAVY) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", _RUN, ",".join(heavy), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_json_global_norm_imports_only_what_it_draws_and_builds_one_command(tmp_path):
    # found timing 10,000 tiny tensors against a naive script (issue 22 item 24): start-up was most of the gap,
    # Typer building every command's Click parameters at each run among it
    path = write_st(tmp_path / "g.safetensors", {"a": np.arange(6, dtype=np.float32), "b": np.ones(3, np.float32)})
    run = started("global-norm", path, "--format", "json")
    assert json.loads(run["stdout"])["checkpoints"][0]["global_norm"] == float(np.sqrt(55 + 3))
    assert run["heavy"] == []
    # found profiling the same run: the core's package imported the differences and the operations, and every
    # command the listing of inspect (with `pickle_audit`), for no use; and the checkpoint package its writing side,
    # every command inspect's module (for `pickle_audit`, now in `commands.audit`)
    assert started("global-norm", path, "--format", "json", heavy=NOT_FOR_NORMS)["heavy"] == []
    assert run["built"] == 1


def test_a_quiet_diff_builds_its_command_alone_and_help_lists_every_command(tmp_path):
    a = write_st(tmp_path / "a.safetensors", {"w": np.ones(4, np.float32)})
    b = write_st(tmp_path / "b.safetensors", {"w": np.full(4, 2, np.float32)})
    run = started("diff", a, b, "--format", "json")
    assert json.loads(run["stdout"])["diff_norm"] == 2.0
    assert run["built"] == 1 and "clipcli.commands.global_norm" not in run["heavy"]
    assert "ml_dtypes" not in run["heavy"]  # found timing 10,000 tiny float32 tensors: 5 ms of the start
    from clipcli.cli import app

    every = len(app.registered_commands)
    assert every > 10
    shown = started("--help")
    assert shown["built"] == every
    assert all(f"\n  {c.name or c.callback.__name__} " in shown["stdout"] for c in app.registered_commands)
