"""The README is true: every console example is run and its output compared byte for byte, every snippet runs.

`CLIPCLI_UPDATE_README=1 python -m pytest tests/cli/test_docs.py` rewrites the outputs shown in the README from
a real run (then read the diff before committing it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, ok

README = ROOT / "README.md"


def _commands() -> list[str]:
    """Every command the app has (a new command needs its help, its README section and its options there)."""
    from clipcli.cli import app

    return [c.name or c.callback.__name__.rstrip("_").replace("_", "-") for c in app.registered_commands]


COMMANDS = _commands()
_CONSOLE = re.compile(r"```console\n(.*?)```", re.S)


def _examples(text: str) -> list[tuple[str, str]]:
    """(command, output) for every `$ command` line of the README's console blocks."""
    out = []
    for block in _CONSOLE.findall(text):
        parts = re.split(r"^\$ ", block, flags=re.M)[1:]
        for part in parts:
            command, _, output = part.partition("\n")
            out.append((command, output))
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A copy of the samples (and of a distributed checkpoint), where the examples run as from the root."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(
        ROOT / "samples", root / "samples", ignore=shutil.ignore_patterns("clipped*", "converted*", "shards")
    )
    dcp = Path("tests", "data", "dcp", "sharded")  # the distributed checkpoint the README shows
    shutil.copytree(ROOT / dcp, root / dcp)
    inert = Path("tests", "data", "torch", "inert")  # the PyTorch files with placeholders it shows
    shutil.copytree(ROOT / inert, root / inert)
    script = Path("tests", "data", "torch", "script")  # and the TorchScript archives
    shutil.copytree(ROOT / script, root / script)
    return root


def _run(command: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    env["NO_COLOR"] = "1"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    return done.stdout + done.stderr


def test_every_console_example_prints_what_the_readme_shows(workdir):
    text = README.read_text()
    examples = _examples(text)
    assert len(examples) >= 7
    if shutil.which("jq") is None:  # the vetting example pipes into jq, which a fresh machine may lack
        examples = [(command, output) for command, output in examples if "| jq" not in command]
    got = [(command, _run(command, workdir)) for command, _ in examples]
    if os.environ.get("CLIPCLI_UPDATE_README"):
        for (command, old), (_, new) in zip(examples, got, strict=True):
            text = text.replace(f"$ {command}\n{old}", f"$ {command}\n{new}", 1)
        README.write_text(text)
    for (command, expected), (_, output) in zip(examples, got, strict=True):
        assert output == expected, f"$ {command}"


def test_the_ci_snippet_tells_exploded_gradients_from_a_broken_file(workdir, tmp_path):
    text = README.read_text()
    snippet = re.search(r"A CI step .*?```sh\n(.*?)```", text, re.S).group(1)
    shutil.copy(workdir / "samples" / "grads.safetensors", tmp_path / "grads.safetensors")
    runs = {}
    for case, limit in (("ok", "1000"), ("exploded", "100"), ("broken", "1000")):
        if case == "broken":
            (tmp_path / "grads.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
        done = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", snippet.replace("--fail-above 100", f"--fail-above {limit}")],
            cwd=tmp_path,
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
            capture_output=True,
            text=True,
            check=False,
        )
        runs[case] = (done.returncode, done.stdout.strip())
    assert runs == {
        "ok": (0, "gradients OK"),
        "exploded": (1, "gradients exploded: see norms.json"),
        "broken": (2, "could not read the checkpoint"),
    }


def test_the_trust_ci_recipe_runs_and_catches_a_changed_tensor(workdir, tmp_path):
    # the README's "Can I trust this checkpoint?" CI block, run as it is from the repository's root
    text = README.read_text()
    snippet = re.search(r"^## Can I trust this checkpoint\?\n.*?```sh\n(.*?)```", text, re.S | re.M).group(1)
    root = tmp_path / "root"
    shutil.copytree(workdir / "samples", root / "samples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def recipe(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True, check=False)

    done = recipe(snippet)
    assert done.returncode == 0, done.stderr
    assert (root / "model.manifest.json").exists() and (root / "model.safetensors").exists()
    # a "conversion" that changed the values: verify names the file and exits 1
    changed = snippet.replace(
        "clipcli convert samples/pytorch_model.bin -o model.safetensors --quiet",
        "clipcli clip-value samples/pytorch_model.bin -o model.safetensors --min -0.001 --max 0.001 --quiet",
    )
    assert changed != snippet
    done = recipe(changed)
    assert done.returncode == 1 and "model.safetensors" in done.stderr and "changed" in done.stderr
    # values a float16 cast cannot hold: the stats gate exits 1
    big = snippet.replace(
        "clipcli convert samples/pytorch_model.bin -o model.safetensors --quiet",
        "clipcli clip-value samples/pytorch_model.bin -o model.safetensors --min 1e5 --max 1e6 --quiet && "
        "clipcli hash model.safetensors --format json > model.manifest.json",
    )
    done = recipe(big)
    assert done.returncode == 1 and "float16" in done.stderr


def test_the_python_examples_run(workdir):
    section = re.search(r"## From Python\n(.*?)\n## ", README.read_text(), re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2  # on arrays, on files
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this copy of clipcli, run where the samples are
    for code in blocks:
        done = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_the_makefile_demo_runs(workdir):
    if shutil.which("make") is None:
        pytest.skip("no make")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    # what the README's clip example writes does not stand in for the demo's own target (a review)
    shutil.copy(workdir / "samples" / "grads.safetensors", workdir / "samples" / "clipped.safetensors")
    done = subprocess.run(["make", "-C", "samples"], cwd=workdir, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (workdir / "samples" / "grads-clipped.safetensors.report.json").exists()
    assert (workdir / "samples" / "clipped-sharded" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_and_a_readme_section(command):
    assert len(ok(command, "--help").stdout.split()) > 30
    readme = README.read_text()
    assert f"### `{command}`" in readme and f"$ clipcli {command}" in readme


def test_every_option_is_in_the_readme():
    readme = README.read_text()
    for command in COMMANDS:
        for option in set(re.findall(r"--[a-z][a-z-]*[a-z]", ok(command, "--help").stdout)) - {"--help"}:
            assert option in readme, f"{command} {option}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in ("diff", "convert")])
def test_help_ends_with_examples_and_names_arguments_as_words(command):
    # found trying clipcli as a new user: help lacked examples, and named arguments as {braces} and <str>
    text = ok(command, "--help").stdout
    assert "{" not in text.splitlines()[0] and "CKPT" in text.splitlines()[0]
    examples = text[text.index("Examples:") :].splitlines()[1:]
    assert sum(line.strip().startswith(f"clipcli {command} ") for line in examples) >= 2
    assert "<str>" not in text


def test_ord_reads_as_a_word_and_completion_is_offered():
    # found trying clipcli as a new user: --ord's metavar was not a word, and shell completion was not offered
    assert "--ord P" in ok("global-norm", "--help").stdout
    root = ok("--help").stdout
    assert "--install-completion" in root and "--show-completion" in root
