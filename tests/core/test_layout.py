"""The shape of `clipcli.core`: its API, what it imports, the size of its modules, who touches whose state."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import clipcli.core

CORE = Path(clipcli.core.__file__).parent
MODULES = sorted(CORE.glob("*.py"))
API = {"clip_by_value", "clip_by_norm", "clip_by_global_norm", "global_norm", "norm", "diff", "DiffStats"}


def imported(tree: ast.Module) -> list[str]:
    """Every module an import statement names, at any depth (`from clipcli import _fused` names clipcli._fused)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "clipcli":
            names += [f"clipcli.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def allowed(name: str) -> bool:
    top = name.split(".")[0]
    return (
        top in sys.stdlib_module_names
        or top in ("numpy", "ml_dtypes")
        or name == "clipcli._fused"
        or (name == "clipcli.core" or name.startswith("clipcli.core."))
    )


def test_the_package_exports_exactly_the_library_api():
    assert set(clipcli.core.__all__) == API
    assert all(callable(getattr(clipcli.core, name)) for name in API)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_core_module_imports_only_numpy_ml_dtypes_the_stdlib_and_the_core(path: Path):
    names = imported(ast.parse(path.read_text()))
    assert [name for name in names if not allowed(name)] == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_a_core_module_stays_under_600_lines(path: Path):
    assert len(path.read_text().splitlines()) < 600


def owners(function: ast.FunctionDef, cls: ast.ClassDef | None) -> set[str]:
    """The names in `function` whose private attributes it may touch: its class's own instances."""
    if cls is None:
        return set()
    names = {"self", "cls"}
    args = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
    names |= {a.arg for a in args if isinstance(a.annotation, ast.Name) and a.annotation.id == cls.name}
    names |= {a.arg for a in args if isinstance(a.annotation, ast.Constant) and a.annotation.value == cls.name}
    for node in ast.walk(function):  # acc = cls(...) or acc = TheClass(...)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            callee = node.value.func
            if isinstance(callee, ast.Name) and callee.id in ("cls", cls.name):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def private_touches(tree: ast.Module) -> list[str]:
    """`x._field` where x is not an instance of the class whose method this is (dunders aside)."""
    found = []

    def visit(node: ast.AST, cls: ast.ClassDef | None, function: ast.FunctionDef | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child, None)
            elif isinstance(child, ast.FunctionDef):
                visit(child, cls, child)
            else:
                if isinstance(child, ast.Attribute) and child.attr.startswith("_") and not child.attr.startswith("__"):
                    base = child.value
                    mine = function is not None and isinstance(base, ast.Name) and base.id in owners(function, cls)
                    if not mine:
                        found.append(f"line {child.lineno}: {ast.unparse(child)}")
                visit(child, cls, function)

    visit(tree, None, None)
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_class_reads_or_sets_another_class_private_state(path: Path):
    assert private_touches(ast.parse(path.read_text())) == []


def test_importing_the_core_imports_no_more_than_numpy_and_ml_dtypes_need():
    # fractions (and decimal, which it imports) serve only orders above 1000: imported when one is asked for
    code = "import sys, clipcli.core; print(sorted(m for m in ('fractions', 'decimal') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "[]\n"
