"""The house's rules: no import cycle between clipcli's modules, and modules of one idea (under ~600 lines)."""

from __future__ import annotations

import ast
from pathlib import Path

import clipcli

PACKAGE = Path(clipcli.__file__).parent
LONG = {"checkpoint/formats/_pickle.py"}  # the pickle machine: one machine, in sections of small opcode methods


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("clipcli", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_at_load(path: Path, known: dict[str, Path]) -> set[str]:
    """The clipcli modules a module imports when it is loaded (module level, not under TYPE_CHECKING)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clipcli"):
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        out |= {n for n in names if n in known}
    return out


def test_no_import_cycle():
    known = modules()
    graph = {name: imported_at_load(path, known) - {name} for name, path in known.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        assert name not in stack, "import cycle: " + " -> ".join([*stack[stack.index(name) :], name])
        if name in done:
            return
        for child in sorted(graph[name]):
            if not name.startswith(child + "."):  # a package's own __init__, loaded first by Python anyway
                visit(child, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_every_module_but_the_pickle_machine_is_of_one_idea():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 620 and name not in LONG} == {}
