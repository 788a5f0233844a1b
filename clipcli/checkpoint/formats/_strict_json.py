"""JSON as the reference safetensors reader (serde_json) takes it, where Python's `json` is looser: no NaN or
Infinity, no number past float64's range, no lone surrogate's escape, no nesting of 128 levels or more (its
recursion limit). Hooks for `json.loads` and checks of what it gives."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from clipcli.errors import MalformedError

MAX_DEPTH = 127
LONG_NUMBER = re.compile(r"[0-9]{309}")  # an integer that may pass float64's range (10**308)
SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # the escape of a surrogate, paired or not
_LONE = re.compile("[\ud800-\udfff]")  # one Python's JSON left unpaired


def loads(text: str, object_pairs_hook: Any) -> Any:
    """`json.loads` of a header held to the reference reader's rules: no NaN or Infinity, no number past float64's
    range, "-0" a float (-0.0, which a shape or offset refuses), no lone surrogate in a tensor's entry, no nesting
    deeper than MAX_DEPTH.

    Raises:
        ValueError, RecursionError: where the text breaks one (as `json.loads` raises).
        MalformedError: for nesting too deep.
    """
    # ("-0", and integers of 309 digits or more, which may pass float64's range, take a call each; others none)
    ints = {"parse_int": json_int_or_zero} if "-0" in text else {}
    if not ints and LONG_NUMBER.search(text):
        ints = {"parse_int": json_int}
    checks = {"parse_constant": no_constant, "parse_float": json_float, **ints}
    header = json.loads(text, object_pairs_hook=object_pairs_hook, **checks)
    if SURROGATE.search(text):  # an escape of one: a lone one only where Python's JSON did not pair it
        refuse_lone_surrogates(header)
    check_depth(header)
    return header


def no_constant(text: str) -> Any:
    raise ValueError(f"invalid number {text}")


def json_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range: {text[:20]}")
    return value


def json_int(text: str) -> int:
    if len(text) > 310:  # (a sign and 309 digits at most: 10**309 lies past float64's range; not converted)
        raise ValueError(f"number out of range: {text[:20]}...")
    value = int(text)
    if value.bit_length() > 1024:  # past float64's range, where the reference reader takes an integer beyond 64 bits
        raise ValueError(f"number out of range: {text[:20]}...")
    return value


def json_int_or_zero(text: str) -> int | float:
    """`json_int`, but "-0", which is a float to the reference reader (-0.0), not an unsigned int."""
    return -0.0 if text == "-0" else json_int(text)


def refuse_lone_surrogates(header: Any) -> None:
    """Refuses a lone surrogate in a tensor's object (an unknown key, its value); one in a name or the metadata is
    refused later, naming it (`reader._checked_text`)."""
    if not isinstance(header, dict):
        return
    entries = [entry for name, entry in header.items() if name != "__metadata__" and isinstance(entry, dict)]
    if any(not s.isascii() and _LONE.search(s) for s in _strings(entries)):
        raise ValueError("a lone surrogate's escape in a tensor's entry")


def check_depth(header: Any) -> None:
    """Refuses a header whose objects and arrays nest deeper than the reference reader's limit."""
    pending = [(header, 1)]
    while pending:
        o, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise MalformedError(f"the header nests objects and arrays deeper than {MAX_DEPTH} levels")
        if isinstance(o, dict):
            pending.extend((v, depth + 1) for v in o.values() if isinstance(v, (dict, list)))
        elif type(o) is list:
            pending.extend((v, depth + 1) for v in o if isinstance(v, (dict, list)))


def _strings(obj: Any) -> Iterator[str]:
    pending = [obj]
    while pending:
        o = pending.pop()
        if type(o) is str:
            yield o
        elif isinstance(o, dict):
            pending.extend(o)
            pending.extend(o.values())
        elif type(o) is list:
            pending.extend(o)
