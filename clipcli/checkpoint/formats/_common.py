"""What the format modules share: header helpers and zip members' local headers."""

from __future__ import annotations

import contextlib
import gc
import reprlib
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Holds off Python's cyclic garbage collector while a header's objects are made: a header may list a
    million tensors, none of them in a cycle, and each collection would walk all those made so far."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Shown(reprlib.Repr):
    """`repr`, cut short, with an int past 64 bits shown by its size (Python will not print one of more
    than 4,300 digits, and no header needs one)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxtuple, self.maxlist, self.maxdict, self.maxstring = 3, 8, 8, 8, 60

    def repr_int(self, x: int, level: int) -> str:
        return repr(x) if -(1 << 64) < x < 1 << 64 else f"<a {x.bit_length()}-bit number>"


shown = _Shown().repr  # a value from a file's header as an error message quotes it


def one_line(e: BaseException) -> str:
    """A library's exception as one line of a message."""
    return " ".join(str(e).split())[:200] or type(e).__name__


def first_zip_member(head: bytes) -> str:
    """The name of the first member of a zip from its first bytes ("" when they hold no member's header)."""
    if len(head) < 30 or not head.startswith(b"PK\x03\x04"):
        return ""
    n = int.from_bytes(head[26:28], "little")
    return head[30 : 30 + n].decode("utf-8", "replace")
