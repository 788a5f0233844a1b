"""Fixtures shared by the test packages: the sample checkpoints, copied into each test's own directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import SAMPLES


@pytest.fixture
def grads(tmp_path) -> Path:
    path = tmp_path / "grads.safetensors"
    shutil.copy(SAMPLES / "grads.safetensors", path)
    return path


@pytest.fixture
def sharded(tmp_path) -> Path:
    shutil.copytree(SAMPLES / "sharded", tmp_path / "sharded")
    return tmp_path / "sharded"


@pytest.fixture
def steps(tmp_path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    shutil.copy(SAMPLES / "weights-step-1000.safetensors", a)
    shutil.copy(SAMPLES / "weights-step-2000.safetensors", b)
    return a, b
