"""TorchScript archives (torch.jit.save): their modules' parameters and buffers, named as `state_dict()` names them.

A TorchScript archive is torch's zip format with a program beside the weights: `data.pkl` pickles the module
as objects of its TorchScript classes (`__torch__.Net`, `__torch__.torch.nn.modules.linear.Linear`, each
NEWOBJ then BUILD with a dict of its attributes), `constants.pkl` a tuple of the constants its code uses
(tensors whose storages are the `constants/` records), `code/` the classes' source, which declares of each
module class which attributes are parameters and buffers (`__parameters__ = ["weight", "bias", ]`,
`__buffers__ = [...]`). The pickle machine turns the classes into inert placeholders; nothing here imports
or calls them, nor runs any of the code: only those two declarations are read from it, as text.

Choices where torch leaves room:
- a module's entries are its parameters, then its buffers (each in attribute order, None left out), then its
  submodules' (attributes holding module objects), as `Module.state_dict()` orders them; attributes that are
  neither (`training`, other tensors, lists, script objects) are not listed, and a submodule without
  parameters or buffers adds nothing;
- a module class whose declarations are not in `code/` lists every tensor attribute as a parameter and every
  `__torch__` object as a submodule; a class without a `__buffers__` line (archives older than torch 1.6)
  takes its tensor attributes that are not parameters as buffers;
- the constants are named `CONSTANTS.c0`, `CONSTANTS.c1`, ... as the code refers to them; a constant that is
  not a tensor is metadata under that name.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

from clipcli.checkpoint.formats._pickle import Placeholder, a_kind
from clipcli.checkpoint.formats._torch_records import Tensor
from clipcli.errors import MalformedError, UnsupportedError

# Records of a torch.jit.save archive that torch.save never writes (torch.load takes constants.pkl as the sign)
SCRIPT_RECORDS = ("constants.pkl", "code/")
# Globals of a TorchScript archive's pickles that torch.jit.load resolves itself (the archive's own classes,
# compiled from code/, and its unpickler's helpers), never through Python
SCRIPT_GLOBALS = ("__torch__.", "torch.jit._pickle.")
CONSTANTS = "CONSTANTS"  # the code's name for the constants table: CONSTANTS.c0
MAX_MODULE_DEPTH = 200  # submodules nested deeper are refused (real models nest a few dozen levels at most)

Declared = tuple[tuple[str, ...], tuple[str, ...] | None]  # a module class's parameters and buffers (None: unknown)
# What a class's name is known as: a module class's declarations, NOT_MODULE for a class of code/ that is no
# module, None when code/ does not define it
Lookup = Callable[[str], "Declared | str | None"]
NOT_MODULE = "not a module"

_CLASS = re.compile(r"^class (\w+)(\([^\n]*\))?:[ \t]*$", re.M)
_DECLARATION = re.compile(r"^  (__parameters__|__buffers__) = (\[[^\n]*\])[ \t]*$", re.M)


def code_record(qualified: str) -> tuple[str, str] | None:
    """The record under `code/` that defines a class (`__torch__.a.b.C`: `code/__torch__/a/b.py`), and its name."""
    qualifier, _, name = qualified.rpartition(".")
    if not qualifier.startswith("__torch__") or not name:
        return None
    return "code/" + qualifier.replace(".", "/") + ".py", name


def declared_classes(text: str, record: str) -> dict[str, Declared | str]:
    """The classes a `code/` record defines: each module class's declared parameters and buffers, NOT_MODULE
    for any other class.

    Raises:
        MalformedError: when a declaration is not a list of names.
    """
    out: dict[str, Declared | str] = {}
    headers = list(_CLASS.finditer(text))
    for i, header in enumerate(headers):
        name, bases = header.group(1), header.group(2)
        if bases != "(Module)":
            out[name] = NOT_MODULE
            continue
        end = headers[i + 1].start() if i + 1 < len(headers) else len(text)
        body = text[header.end() : end]
        first_def = body.find("\n  def ")
        found = dict(m.groups() for m in _DECLARATION.finditer(body, 0, len(body) if first_def < 0 else first_def))
        params = _names(found.get("__parameters__", "[]"), record, name)
        buffers = _names(found["__buffers__"], record, name) if "__buffers__" in found else None
        out[name] = (params, buffers)
    return out


def _names(text: str, record: str, cls: str) -> tuple[str, ...]:
    try:
        value = ast.literal_eval(text)  # a literal only: ast never evaluates anything else
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise MalformedError(f"{record}: class {cls} declares its parameters or buffers as {text[:60]!r}") from e
    if type(value) is not list or not all(type(v) is str for v in value):
        raise MalformedError(f"{record}: class {cls} declares its parameters or buffers as {text[:60]!r}")
    return tuple(value)


def module_state(root: Any, lookup: Lookup, constants: Any) -> dict[str, Any]:
    """The archive's entries as a dict to flatten: the root module's state (nested dicts of tensors by attribute
    name, as `state_dict()`'s names split at the dots), and its constants under `CONSTANTS`.

    Raises:
        MalformedError: when data.pkl holds no module object, modules hold themselves or nest too deeply, or
            constants.pkl holds no tuple.
    """
    if not _is_script_object(root):
        raise MalformedError(f"the TorchScript archive's data.pkl holds {a_kind(root)}, not a module")
    state = _Walk(lookup).state(root, 0)
    if type(constants) is not tuple:
        raise MalformedError(f"the TorchScript archive's constants.pkl holds {a_kind(constants)}, not a tuple")
    if constants:
        if CONSTANTS in state:
            raise UnsupportedError(
                f"the module has an entry named {CONSTANTS}, which is the name clipcli gives the archive's constants"
            )
        state[CONSTANTS] = {f"c{i}": value for i, value in enumerate(constants)}
    return state


def _is_script_object(value: Any) -> bool:
    return isinstance(value, Placeholder) and value.args is not None and value.name.startswith("__torch__.")


def _attributes(p: Placeholder) -> dict[str, Any]:
    """An object's attributes, as each BUILD of a dict (or of a (dict, slots) pair) sets them."""
    out: dict[str, Any] = {}
    for state in p.states:
        parts = state if type(state) is tuple and len(state) == 2 else (state,)
        for part in parts:
            if isinstance(part, dict) and all(type(k) is str for k in part):
                out.update(part)
    return out


class _Walk:
    """Module objects to their state dicts, each object once (modules shared by two parents are named twice)."""

    def __init__(self, lookup: Lookup):
        self.lookup = lookup
        self.done: dict[int, dict[str, Any]] = {}
        self.open: set[int] = set()

    def state(self, module: Placeholder, depth: int) -> dict[str, Any]:
        key = id(module)
        if key in self.done:
            return self.done[key]
        if key in self.open:
            raise MalformedError(f"the TorchScript module {module.name} holds itself")
        if depth > MAX_MODULE_DEPTH:
            raise MalformedError(f"TorchScript modules nested deeper than {MAX_MODULE_DEPTH} levels")
        self.open.add(key)
        attributes = _attributes(module)
        declared = self.lookup(module.name)
        tensors = [(k, v) for k, v in attributes.items() if isinstance(v, Tensor)]
        if isinstance(declared, tuple):
            params, buffers = declared
            out = {k: v for k, v in tensors if k in params}
            out.update((k, v) for k, v in tensors if (k in buffers if buffers is not None else k not in params))
        else:  # a class code/ does not define: every tensor attribute; a class of code/ that is no module: none
            out = dict(tensors) if declared is None else {}
        for k, v in attributes.items():
            if _is_script_object(v) and k not in out:
                sub = self.lookup(v.name)
                if sub is not NOT_MODULE:
                    child = self.state(v, depth + 1)
                    if child:
                        out[k] = child
        self.open.discard(key)
        self.done[key] = out
        return out
