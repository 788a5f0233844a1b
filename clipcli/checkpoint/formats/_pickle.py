"""A restricted pickle machine: it builds plain data and calls only the constructors clipcli hands it.

The machine reads the opcodes of protocols 0-5 itself; it never calls `pickle.load`, never imports a
module and never looks a name up. A GLOBAL (or STACK_GLOBAL, INST) goes to the caller's `resolve(module,
name)`, which answers with one of clipcli's own objects; any other global becomes an inert `Placeholder`
that records its dotted name (or, without `placeholders`, is refused). REDUCE and NEWOBJ call only a
`Constructor` that `resolve` returned; on a placeholder, REDUCE, NEWOBJ, INST, OBJ, BUILD, SETITEM(S) and
APPEND(S) record their arguments, state and items in a new placeholder, as data, and call nothing. EXT1/2/4
(names from a registry) are refused. Every global named and called is counted in an `Audit`. Every length
field is checked against the bytes that remain before anything is allocated, and every error is one
`MalformedError` (or `UnsafePickleError`) with a short message.
"""

from __future__ import annotations

import _compat_pickle  # Python 2's module and class names, as pickle.Unpickler maps them for protocols 0-2
import codecs
import pickle  # for its opcode constants only: nothing here calls pickle.load or an Unpickler
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clipcli.checkpoint.formats._pickle_audit import WEIGHTS_ONLY_OPCODES, Audit
from clipcli.errors import ClipcliError, MalformedError, UnsafePickleError

MAX_DEPTH = 1000  # deeper nesting is refused: tuples here (hashing them recurses in C), containers when named
# Keys whose hashes a file can make collide (tuples, frozensets, complex numbers, integers beyond 2**61 - 1)
# cost a dict or set time quadratic in their number; more than this many in one pickle are refused.
MAX_COLLIDING_KEYS = 4096
_HASH_MODULUS = 2**61 - 1  # hash(n) == n for 0 <= n < 2**61 - 1: such integers never collide
_MAX_NAME = 200  # characters of a global's name quoted in a message

Resolve = Callable[[str, str], Any]
PersistentLoad = Callable[[Any], Any]

_NESTABLE = (tuple, frozenset)  # the containers that can be hashed, and so nest in dict keys


@dataclass(frozen=True, eq=False)
class Constructor:
    """One of clipcli's own functions that a pickle may call by its global name.

    REDUCE calls `func(*args)`; NEWOBJ and NEWOBJ_EX call `func(*args, **kwargs)` only when `newobj`
    is set (record types). Nothing else on the pickle's stack is ever called. Every call is charged the
    length of its arguments against a budget proportional to the pickle's size, so that a pickle cannot
    make a constructor work over one memoized container again and again.
    """

    name: str  # "module.name", as the pickle asks for it
    func: Callable[..., Any] = field(repr=False)
    newobj: bool = False
    hashes: bool = False  # it hashes the members of its arguments, or the first items of pairs (set, OrderedDict)


class Record:
    """Base of clipcli's own objects that a pickle may create; BUILD hands them their state."""

    def describe(self) -> str:
        """What the object is, in a word or two for messages (`global torch.float32`, `storage`)."""
        return type(self).__name__

    def build(self, state: Any) -> None:
        """Takes the state of a BUILD opcode; records that have none refuse it.

        Raises:
            UnsafePickleError: always, unless a subclass accepts a state.
        """
        raise UnsafePickleError(f"the pickle sets the state of {a_kind(self)} (BUILD), which clipcli never runs")


class Placeholder(Record):
    """A global clipcli does not know, or an object a pickle makes from one: inert data, never called.

    `args` is None for the global itself; an object made by REDUCE, NEWOBJ, INST or OBJ holds its arguments
    (`args`, `kwargs`), and what BUILD, SETITEM(S) and APPEND(S) gave it (`states`, one per BUILD; `items`;
    `list_items`).
    """

    __slots__ = ("args", "items", "kwargs", "list_items", "name", "states")

    def __init__(self, name: str, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None):
        self.name = name  # the dotted name of the global it is, or that made it
        self.args = args
        self.kwargs = kwargs or {}
        self.states: list[Any] = []
        self.items: dict[Any, Any] = {}
        self.list_items: list[Any] = []

    def describe(self) -> str:
        return f"global {self.name}" if self.args is None else f"{self.name} object"

    def build(self, state: Any) -> None:
        self.states.append(state)


class PickledDict(dict):
    """A dict made by a constructor (OrderedDict); BUILD stores its attributes (e.g. `_metadata`) here."""

    __slots__ = ("attributes",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.attributes: dict[str, Any] = {}


class PickledCounter(PickledDict):
    """A collections.Counter as torch.save pickles one (the class called on a dict of counts): a dict."""

    __slots__ = ()


class PickleTruncatedError(MalformedError):
    """The stream ends before the pickle does (a reader may retry with more bytes)."""


def unsafe_global(module: str, name: str) -> UnsafePickleError:
    """The error for a global that is not on the allowlist."""
    what = f"{module}.{name}"
    if len(what) > _MAX_NAME:
        what = what[:_MAX_NAME] + "..."
    return UnsafePickleError(f"the pickle asks for GLOBAL {what}, which clipcli never runs")


def a_kind(obj: Any) -> str:
    """`kind`, with its article ("an int", "an argparse.Namespace object", "a list")."""
    return with_article(kind(obj))


def with_article(words: str) -> str:
    """Words after "a" or "an", as their first letter asks."""
    return ("an " if words[:1].lower() in "aeiou" else "a ") + words


def kind(obj: Any) -> str:
    """A short word for what an object is, for messages (never its value: it may be huge or deep)."""
    if isinstance(obj, Constructor):
        return f"global {obj.name}"
    if isinstance(obj, PickledDict):
        return "Counter" if isinstance(obj, PickledCounter) else "OrderedDict"
    if isinstance(obj, Record):
        return obj.describe()
    return type(obj).__name__


def unpickle(
    data: bytes,
    resolve: Resolve,
    persistent_load: PersistentLoad | None = None,
    audit: Audit | None = None,
    placeholders: bool = False,
) -> Any:
    """The object one pickle builds; `data` holds that pickle and nothing after it.

    Args:
        data: the pickle's bytes.
        resolve: maps (module, name) of a GLOBAL to one of clipcli's objects, or returns None (a placeholder
            with `placeholders`, else refused) or raises to refuse it.
        persistent_load: maps a persistent id (PERSID/BINPERSID) to an object; None refuses them.
        audit: counts the globals named and called, and what torch's weights-only unpickler refuses.
        placeholders: a global `resolve` does not know becomes a `Placeholder` instead of an error.

    Raises:
        MalformedError: for anything but a well-formed pickle of allowed objects (UnsafePickleError
            when it asks for a global or an opcode that clipcli never runs).
    """
    value, end = unpickle_at(data, 0, resolve, persistent_load, audit, placeholders)
    if end != len(data):
        raise MalformedError(f"{len(data) - end} bytes follow the pickle's STOP opcode")
    return value


def unpickle_at(
    data: bytes,
    offset: int,
    resolve: Resolve,
    persistent_load: PersistentLoad | None = None,
    audit: Audit | None = None,
    placeholders: bool = False,
) -> tuple[Any, int]:
    """The object of the pickle that starts at `offset`, and the offset just after its STOP opcode.

    Raises:
        PickleTruncatedError: when `data` ends before the pickle does.
        MalformedError: as `unpickle`.
    """
    machine = _Machine(bytes(data), offset, resolve, persistent_load, audit or Audit(), placeholders)
    try:
        return machine.run()
    except MalformedError as e:
        if not machine.audit.inert_calls:
            raise
        # what a file attempted is what a user vetting it wants to know, even of a stream that is malformed
        calls = ", ".join(sorted(machine.audit.inert_calls))
        raise type(e)(f"{e.message}; before that it would call {calls}", e.path, e.tensor) from e
    except ClipcliError:
        raise
    except RecursionError as e:  # comparing keys nested MAX_DEPTH deep near the interpreter's limit
        raise MalformedError(f"the pickle nests objects too deeply (at byte {machine.op_pos})") from e
    except (TypeError, ValueError, OverflowError, UnicodeDecodeError, struct.error) as e:
        raise MalformedError(
            f"malformed pickle: bad {machine.op_name()} at byte {machine.op_pos} ({type(e).__name__})"
        ) from e


def python3_name(module: str, name: str, proto: int) -> tuple[str, str]:
    """The global that Python's unpickler looks up for a name in a pickle of protocol `proto`: for protocols
    0-2, Python 2's spellings (`__builtin__.eval`, `commands.Popen`) are Python 3's (`fix_imports`)."""
    if proto < 3:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            return _compat_pickle.NAME_MAPPING[(module, name)]
        return _compat_pickle.IMPORT_MAPPING.get(module, module), name
    return module, name


def _no_persistent_ids(pid: Any) -> Any:
    raise MalformedError("the pickle refers to a persistent object, which this file never holds")


class _Machine:
    """The unpickling machine: a stack, a stack of MARKs and a memo, driven by one opcode at a time."""

    def __init__(
        self,
        data: bytes,
        offset: int,
        resolve: Resolve,
        persistent_load: PersistentLoad | None,
        audit: Audit,
        placeholders: bool,
    ):
        self.data = data
        self.proto = 0  # a PROTO opcode sets it (protocols 0 and 1 have none)
        self.audit = audit
        self.placeholders = placeholders
        self.pos = offset
        self.op_pos = offset
        self.end = len(data)
        self.resolve = resolve
        self.persistent_load = persistent_load or _no_persistent_ids
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        # the nesting depth and expanded size of every tuple and frozenset that holds one or a huge integer,
        # by id (the object is kept so that the id stays its own); any other has depth 1 and size 1 + len
        self.shapes: dict[int, tuple[int, int, Any]] = {}
        # the lengths of the arguments constructors may be handed, and the expanded sizes of the keys hashed,
        # in all: every item takes a byte or more, so only memoized objects used again and again come near this
        self.work_limit = 65536 + 4 * (len(data) - offset)
        self.work_left = self.work_limit
        self.colliding_keys_left = MAX_COLLIDING_KEYS
        self.result: Any = None
        self.dispatch = self._dispatch_table()

    # -- driving -------------------------------------------------------------------------------------

    def run(self) -> tuple[Any, int]:
        data, dispatch = self.data, self.dispatch
        while True:
            pos = self.pos
            if pos >= self.end:
                raise PickleTruncatedError(f"the pickle ends at byte {pos} without a STOP opcode")
            self.op_pos = pos
            op = data[pos]
            self.pos = pos + 1
            handler = dispatch.get(op)
            if handler is None:
                raise MalformedError(f"unknown pickle opcode 0x{op:02x} at byte {pos}")
            if handler():
                return self.result, self.pos

    def op_name(self) -> str:
        if self.op_pos >= self.end:
            return "opcode"
        code = bytes([self.data[self.op_pos]])
        return _OPCODE_NAMES.get(code, f"opcode 0x{code[0]:02x}")

    def _dispatch_table(self) -> dict[int, Callable[[], bool | None]]:
        table: dict[bytes, Callable[[], bool | None]] = {
            pickle.PROTO: self._proto,
            pickle.FRAME: self._frame,
            pickle.STOP: self._stop,
            pickle.MARK: self._mark,
            pickle.POP: self._pop_op,
            pickle.POP_MARK: self._pop_mark_op,
            pickle.DUP: self._dup,
            pickle.NONE: lambda: self.stack.append(None),
            pickle.NEWTRUE: lambda: self.stack.append(True),
            pickle.NEWFALSE: lambda: self.stack.append(False),
            pickle.INT: self._int,
            pickle.BININT: lambda: self.stack.append(self._unpack("<i", 4)),
            pickle.BININT1: self._binint1,
            pickle.BININT2: lambda: self.stack.append(self._unpack("<H", 2)),
            pickle.LONG: self._long,
            pickle.LONG1: lambda: self._long_bytes(self._take(1)[0]),
            pickle.LONG4: lambda: self._long_bytes(self._count("<i", 4)),
            pickle.FLOAT: lambda: self.stack.append(float(self._line())),
            pickle.BINFLOAT: lambda: self.stack.append(self._unpack(">d", 8)),
            pickle.STRING: self._string,
            pickle.BINSTRING: lambda: self.stack.append(self._py2_string(self._take(self._count("<i", 4)))),
            pickle.SHORT_BINSTRING: lambda: self.stack.append(self._py2_string(self._take(self._take(1)[0]))),
            pickle.BINBYTES: lambda: self.stack.append(self._take(self._count("<I", 4))),
            pickle.SHORT_BINBYTES: lambda: self.stack.append(self._take(self._take(1)[0])),
            pickle.BINBYTES8: lambda: self.stack.append(self._take(self._count("<Q", 8))),
            pickle.BYTEARRAY8: lambda: self.stack.append(self._take(self._count("<Q", 8))),
            pickle.NEXT_BUFFER: self._buffer,
            pickle.READONLY_BUFFER: self._buffer,
            pickle.UNICODE: lambda: self.stack.append(str(self._line(), "raw-unicode-escape")),
            pickle.SHORT_BINUNICODE: lambda: self.stack.append(self._text(self._byte())),
            pickle.BINUNICODE: self._binunicode,
            pickle.BINUNICODE8: lambda: self.stack.append(self._text(self._count("<Q", 8))),
            pickle.EMPTY_TUPLE: lambda: self.stack.append(()),
            pickle.TUPLE: self._tuple_mark,
            pickle.TUPLE1: self._tuple1,
            pickle.TUPLE2: self._tuple2,
            pickle.TUPLE3: self._tuple3,
            pickle.EMPTY_LIST: lambda: self.stack.append([]),
            pickle.LIST: self._list_mark,
            pickle.APPEND: self._append,
            pickle.APPENDS: self._appends,
            pickle.EMPTY_DICT: lambda: self.stack.append({}),
            pickle.DICT: self._dict,
            pickle.SETITEM: self._setitem,
            pickle.SETITEMS: self._setitems,
            pickle.EMPTY_SET: lambda: self.stack.append(set()),
            pickle.ADDITEMS: self._additems,
            pickle.FROZENSET: self._frozenset,
            pickle.GET: lambda: self._get(int(self._line())),
            pickle.BINGET: self._binget,
            pickle.LONG_BINGET: self._long_binget,
            pickle.PUT: lambda: self._put(int(self._line())),
            pickle.BINPUT: self._binput,
            pickle.LONG_BINPUT: self._long_binput,
            pickle.MEMOIZE: lambda: self._put(len(self.memo)),
            pickle.GLOBAL: self._global,
            pickle.STACK_GLOBAL: self._stack_global,
            pickle.REDUCE: self._reduce,
            pickle.BUILD: self._build,
            pickle.NEWOBJ: lambda: self._newobj(with_kwargs=False),
            pickle.NEWOBJ_EX: lambda: self._newobj(with_kwargs=True),
            pickle.INST: self._inst,
            pickle.OBJ: self._obj,
            pickle.EXT1: lambda: self._ext(self._take(1)[0], "EXT1"),
            pickle.EXT2: lambda: self._ext(self._unpack("<H", 2), "EXT2"),
            pickle.EXT4: lambda: self._ext(self._unpack("<i", 4), "EXT4"),
            pickle.PERSID: lambda: self._persistent(self._line().decode("ascii")),
            pickle.BINPERSID: self._binpersid,
        }
        return {code[0]: self._refused_by_torch(handler, code[0]) for code, handler in table.items()}

    def _refused_by_torch(self, handler: Callable[[], bool | None], op: int) -> Callable[[], bool | None]:
        """The handler, noting in the audit an opcode that torch's weights-only unpickler does not know."""
        if op in WEIGHTS_ONLY_OPCODES:
            return handler

        def noted() -> bool | None:
            self.audit.refuse()
            return handler()

        return noted

    # -- reading -------------------------------------------------------------------------------------

    def _byte(self) -> int:
        pos = self.pos
        if pos >= self.end:
            raise PickleTruncatedError(f"the pickle ends inside {self.op_name()} at byte {self.op_pos}")
        self.pos = pos + 1
        return self.data[pos]

    def _take(self, n: int) -> bytes:
        pos = self.pos
        if n > self.end - pos:
            raise PickleTruncatedError(
                f"the pickle ends inside {self.op_name()} at byte {self.op_pos} (it claims {n} more bytes)"
            )
        self.pos = pos + n
        return self.data[pos : pos + n]

    def _uint32(self) -> int:
        pos = self.pos
        if pos + 4 > self.end:
            raise PickleTruncatedError(f"the pickle ends inside {self.op_name()} at byte {self.op_pos}")
        self.pos = pos + 4
        return int.from_bytes(self.data[pos : pos + 4], "little")

    def _unpack(self, fmt: str, size: int) -> Any:
        return struct.unpack(fmt, self._take(size))[0]

    def _count(self, fmt: str, size: int) -> int:
        n = int(self._unpack(fmt, size))
        if n < 0:
            raise MalformedError(f"negative length in {self.op_name()} at byte {self.op_pos}")
        return n

    def _line(self) -> bytes:
        i = self.data.find(b"\n", self.pos, self.end)
        if i < 0:
            raise PickleTruncatedError(f"the pickle ends inside {self.op_name()} at byte {self.op_pos}")
        line = self.data[self.pos : i]
        self.pos = i + 1
        return line

    def _text(self, n: int) -> str:
        return str(self._take(n), "utf-8", "surrogatepass")

    @staticmethod
    def _py2_string(raw: bytes) -> str:
        # Python 2's str, read as torch.load reads it (encoding="utf-8")
        return raw.decode("utf-8")

    # -- the stack -----------------------------------------------------------------------------------

    def _pop(self) -> Any:
        if not self.stack:
            raise MalformedError(f"pickle stack underflow at {self.op_name()} (byte {self.op_pos})")
        return self.stack.pop()

    def _top(self) -> Any:
        if not self.stack:
            raise MalformedError(f"pickle stack underflow at {self.op_name()} (byte {self.op_pos})")
        return self.stack[-1]

    def _pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise MalformedError(f"{self.op_name()} without a MARK at byte {self.op_pos}")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def _shape(self, obj: Any) -> tuple[int, int]:
        """The nesting depth of a tuple or frozenset, and the items hashing it visits (shared ones again)."""
        shape = self.shapes.get(id(obj))
        return (shape[0], shape[1]) if shape is not None else (1, 1 + len(obj))

    def _note_depth(self, obj: tuple[Any, ...] | frozenset[Any]) -> None:
        # A tuple of memoized tuples (T(k+1) = (Tk, Tk)) is 2 bytes a level but 2**k items to hash or
        # render: its expanded size is bounded like any other work, before anything hashes it.
        depth, size = 1, 1
        for x in obj:
            t = type(x)
            if t in _NESTABLE:
                d, n = self._shape(x)
                depth, size = max(depth, d + 1), size + n
            else:
                size += 1 + (x.bit_length() >> 10 if t is int else 0)  # hashing an integer reads all its digits
        if depth > MAX_DEPTH:
            raise MalformedError(f"the pickle nests tuples deeper than {MAX_DEPTH} levels")
        if size > self.work_limit:
            raise MalformedError(
                f"the pickle builds {a_kind(obj)} of more than {self.work_limit} items once its shared members "
                f"are expanded (at byte {self.op_pos})"
            )
        if depth > 1 or size > 1 + len(obj):
            self.shapes[id(obj)] = (depth, size, obj)

    def _tuple(self, items: list[Any]) -> tuple[Any, ...]:
        t = tuple(items)
        self._note_depth(t)
        return t

    def _tuple_mark(self) -> None:
        items = self._pop_mark()  # replaces self.stack: append only after it
        self.stack.append(self._tuple(items))

    def _list_mark(self) -> None:
        items = self._pop_mark()
        self.stack.append(items)

    def _tuple_n(self, n: int) -> None:
        stack = self.stack
        if len(stack) < n:
            raise MalformedError(f"pickle stack underflow at {self.op_name()} (byte {self.op_pos})")
        t = tuple(stack[-n:])
        del stack[-n:]
        self._note_depth(t)
        stack.append(t)

    def _hash_error(self, obj: Any) -> MalformedError:
        return MalformedError(
            f"{a_kind(obj)} cannot be a dict key or set member ({self.op_name()} at byte {self.op_pos})"
        )

    # -- opcodes -------------------------------------------------------------------------------------

    def _proto(self) -> None:
        version = self._take(1)[0]
        if version > 5:
            raise MalformedError(f"unsupported pickle protocol {version}")
        self.proto = version

    def _frame(self) -> None:
        n = self._count("<Q", 8)
        if n > self.end - self.pos:
            raise PickleTruncatedError(f"the pickle ends inside a frame of {n} bytes (at byte {self.op_pos})")

    def _stop(self) -> bool:
        self.result = self._pop()
        return True

    def _mark(self) -> None:
        self.metastack.append(self.stack)
        self.stack = []

    def _pop_op(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self._pop_mark()

    def _pop_mark_op(self) -> None:
        self._pop_mark()

    def _dup(self) -> None:
        self.stack.append(self._top())

    def _binunicode(self) -> None:
        self.stack.append(self._text(self._uint32()))

    def _tuple1(self) -> None:
        self._tuple_n(1)

    def _tuple2(self) -> None:
        self._tuple_n(2)

    def _tuple3(self) -> None:
        self._tuple_n(3)

    def _long_binget(self) -> None:
        self._get(self._uint32())

    def _long_binput(self) -> None:
        self._put(self._uint32())

    def _binpersid(self) -> None:
        self._persistent(self._pop())

    def _binint1(self) -> None:
        self.stack.append(self._byte())

    def _binget(self) -> None:
        self._get(self._byte())

    def _binput(self) -> None:
        index = self._byte()
        if not self.stack:
            raise MalformedError(f"pickle stack underflow at BINPUT (byte {self.op_pos})")
        self.memo[index] = self.stack[-1]

    def _int(self) -> None:
        line = self._line()
        if line == b"00":
            self.stack.append(False)
        elif line == b"01":
            self.stack.append(True)
        else:
            self.stack.append(int(line, 0))

    def _long(self) -> None:
        line = self._line()
        if line.endswith(b"L"):
            line = line[:-1]
        self.stack.append(int(line, 0))

    def _long_bytes(self, n: int) -> None:
        self.stack.append(int.from_bytes(self._take(n), "little", signed=True))

    def _string(self) -> None:
        line = self._line()
        if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b'"', b"'"):
            raise MalformedError(f"the STRING at byte {self.op_pos} is not quoted")
        self.stack.append(self._py2_string(codecs.escape_decode(line[1:-1])[0]))

    def _buffer(self) -> None:
        raise MalformedError(f"the pickle refers to an out-of-band buffer (at byte {self.op_pos})")

    def _list_target(self) -> list[Any]:
        target = self._top()
        if type(target) is list:
            return target
        if isinstance(target, Placeholder) and target.args is not None:
            return target.list_items
        raise MalformedError(f"{self.op_name()} to {a_kind(target)} at byte {self.op_pos}")

    def _append(self) -> None:
        value = self._pop()
        self._list_target().append(value)

    def _appends(self) -> None:
        items = self._pop_mark()
        self._list_target().extend(items)

    def _charge_keys(self, keys: Any) -> None:
        colliding = [k for k in keys if type(k) in _MAY_COLLIDE and _may_collide(k)]
        n = len(colliding)
        if n:
            self._charge(sum(self._shape(k)[1] for k in colliding if type(k) in _NESTABLE), "its dicts and sets")
            self.colliding_keys_left -= n
            if self.colliding_keys_left < 0:
                raise MalformedError(
                    f"the pickle uses more than {MAX_COLLIDING_KEYS} tuples, frozensets, complex numbers or huge "
                    "integers as keys (their hashes can be made to collide)"
                )

    def _charge_work(self, args: Any, what: str) -> None:
        self._charge(1 + sum(len(a) for a in args if isinstance(a, _SIZED)), what)

    def _charge(self, units: int, what: str) -> None:
        self.work_left -= units
        if self.work_left < 0:
            raise MalformedError(f"the pickle hands {what} more data than it holds (a memoized object again and again)")

    def _set_pairs(self, target: dict[Any, Any], items: list[Any]) -> None:
        if len(items) % 2:
            raise MalformedError(f"{self.op_name()} with a key but no value at byte {self.op_pos}")
        self._charge_keys(items[0::2])
        for i in range(0, len(items), 2):
            try:
                target[items[i]] = items[i + 1]
            except TypeError as e:
                raise self._hash_error(items[i]) from e

    def _dict(self) -> None:
        items = self._pop_mark()
        d: dict[Any, Any] = {}
        self._set_pairs(d, items)
        self.stack.append(d)

    def _dict_target(self) -> dict[Any, Any]:
        target = self._top()
        if isinstance(target, Placeholder) and target.args is not None:
            return target.items
        if not isinstance(target, dict):
            raise MalformedError(f"{self.op_name()} on {a_kind(target)} at byte {self.op_pos}")
        return target

    def _setitem(self) -> None:
        value = self._pop()
        key = self._pop()
        self._set_pairs(self._dict_target(), [key, value])

    def _setitems(self) -> None:
        items = self._pop_mark()
        self._set_pairs(self._dict_target(), items)

    def _additems(self) -> None:
        items = self._pop_mark()
        target = self._top()
        if type(target) is not set:
            raise MalformedError(f"ADDITEMS to {a_kind(target)} at byte {self.op_pos}")
        self._charge_keys(items)
        for item in items:
            try:
                target.add(item)
            except TypeError as e:
                raise self._hash_error(item) from e

    def _frozenset(self) -> None:
        items = self._pop_mark()
        self._charge_keys(items)
        for item in items:
            try:
                hash(item)
            except TypeError as e:
                raise self._hash_error(item) from e
        fs = frozenset(items)
        self._note_depth(fs)
        self.stack.append(fs)

    def _get(self, index: int) -> None:
        try:
            self.stack.append(self.memo[index])
        except KeyError:
            raise MalformedError(f"the pickle reads memo entry {index}, which it never stored") from None

    def _put(self, index: int) -> None:
        if not 0 <= index < _HASH_MODULUS:
            raise MalformedError(f"memo index out of range at byte {self.op_pos}")
        if not self.stack:
            raise MalformedError(f"pickle stack underflow at {self.op_name()} (byte {self.op_pos})")
        self.memo[index] = self.stack[-1]

    def _resolved(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name, self.proto)
        dotted = f"{module}.{name}"
        self.audit.named(dotted)
        obj = self.resolve(module, name)
        if obj is None:
            if not self.placeholders:
                raise unsafe_global(module, name)
            return Placeholder(dotted)
        return obj

    def _global(self) -> None:
        module = self._line().decode("utf-8")
        name = self._line().decode("utf-8")
        self.stack.append(self._resolved(module, name))

    def _stack_global(self) -> None:
        name = self._pop()
        module = self._pop()
        if type(module) is not str or type(name) is not str:
            raise MalformedError(f"STACK_GLOBAL with {a_kind(module)} and {a_kind(name)} at byte {self.op_pos}")
        self.stack.append(self._resolved(module, name))

    def _made(self, p: Placeholder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An object made from a placeholder: recorded, never made."""
        self._charge_work((*args, *kwargs.values()), p.name)
        self.audit.called(p.name, inert=True)
        self.stack.append(Placeholder(p.name, args, kwargs))

    def _call(self, f: Constructor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._charge_work((*args, *kwargs.values()), f.name)
        self.audit.called(f.name)
        if f.hashes:
            for arg in args:
                if type(arg) in (list, tuple, set, frozenset):
                    self._charge_keys(arg)
                    self._charge_keys(p[0] for p in arg if type(p) in (list, tuple) and p)
        try:
            result = f.func(*args, **kwargs)
        except ClipcliError:
            raise
        except (TypeError, ValueError) as e:  # arity and argument types of clipcli's own constructors
            raise MalformedError(f"the pickle calls {f.name} with arguments it does not take") from e
        if type(result) in (tuple, frozenset):
            self._note_depth(result)
        self.stack.append(result)

    def _reduce(self) -> None:
        args = self._pop()
        f = self._pop()
        if not isinstance(f, (Constructor, Placeholder)):
            raise UnsafePickleError(f"the pickle calls {a_kind(f)} (REDUCE), which clipcli never runs")
        if type(args) is not tuple:
            raise MalformedError(f"the pickle calls {f.name} with {a_kind(args)} of arguments, not a tuple")
        if isinstance(f, Placeholder):
            self._made(f, args, {})
        else:
            self._call(f, args, {})

    def _newobj(self, with_kwargs: bool) -> None:
        kwargs = self._pop() if with_kwargs else {}
        args = self._pop()
        cls = self._pop()
        op = "NEWOBJ_EX" if with_kwargs else "NEWOBJ"
        placeholder = isinstance(cls, Placeholder) and cls.args is None
        if not placeholder and not (isinstance(cls, Constructor) and cls.newobj):
            raise UnsafePickleError(f"the pickle creates {a_kind(cls)} ({op}), which clipcli never runs")
        if type(args) is not tuple or type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise MalformedError(f"the pickle creates {cls.name} with malformed arguments")
        if placeholder:
            self._made(cls, args, kwargs)
        else:
            self._call(cls, args, kwargs)

    def _build(self) -> None:
        state = self._pop()
        target = self._top()
        self._charge_work((state,), "BUILD")
        if isinstance(target, PickledDict):
            _build_attributes(target, state)
        elif isinstance(target, Placeholder):
            if target.args is None:  # an object's own BUILD is part of making it, already counted
                self.audit.called(target.name, inert=True)
            target.build(state)
        elif isinstance(target, Record):
            target.build(state)
        else:
            raise UnsafePickleError(f"the pickle sets the state of {a_kind(target)} (BUILD), which clipcli never runs")

    def _inst(self) -> None:
        module = self._line().decode("utf-8")
        name = self._line().decode("utf-8")
        cls = self._resolved(module, name)
        self._instantiate(cls, self._pop_mark(), "INST")

    def _obj(self) -> None:
        items = self._pop_mark()
        if not items:
            raise MalformedError(f"OBJ without a class at byte {self.op_pos}")
        self._instantiate(items[0], items[1:], "OBJ")

    def _instantiate(self, cls: Any, args: list[Any], op: str) -> None:
        if not (isinstance(cls, Placeholder) and cls.args is None):
            raise UnsafePickleError(f"the pickle calls {a_kind(cls)} ({op}), which clipcli never runs")
        self._made(cls, self._tuple(args), {})

    def _ext(self, code: int, op: str) -> None:
        raise UnsafePickleError(f"the pickle asks for extension code {code} ({op}), which clipcli never runs")

    def _persistent(self, pid: Any) -> None:
        self.stack.append(self.persistent_load(pid))


_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_MAY_COLLIDE = (int, tuple, frozenset, complex)


def _may_collide(key: Any) -> bool:
    """Whether a file could pick many keys of this kind with one hash (str and bytes hashes are salted)."""
    t = type(key)
    if t is int:
        return not -_HASH_MODULUS < key < _HASH_MODULUS
    return t is tuple or t is frozenset or t is complex


def _build_attributes(target: PickledDict, state: Any) -> None:
    """BUILD on an OrderedDict: Python would set its attributes; clipcli keeps them in `attributes`."""
    parts = state if type(state) is tuple and len(state) == 2 else (state, None)
    for part in parts:
        if part is None:
            continue
        if not isinstance(part, dict) or not all(type(k) is str for k in part):
            raise MalformedError(f"the pickle sets a dict's attributes from {a_kind(part)}")
        target.attributes.update(part)


def _opcode_names() -> dict[bytes, str]:
    names = {
        name: getattr(pickle, name)
        for name in dir(pickle)
        if name.isupper() and isinstance(getattr(pickle, name), bytes) and len(getattr(pickle, name)) == 1
    }
    return {code: name for name, code in names.items()}


_OPCODE_NAMES = _opcode_names()


# -- plain data that protocol 2 writes through globals ---------------------------------------------


def _set(items: Any = ()) -> set[Any]:
    return set(_iterable(items, "builtins.set"))


def _frozenset(items: Any = ()) -> frozenset[Any]:
    return frozenset(_iterable(items, "builtins.frozenset"))


def _iterable(items: Any, name: str) -> Any:
    if type(items) not in (list, tuple, set, frozenset):
        raise MalformedError(f"the pickle calls {name} with {a_kind(items)}")
    return items


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(x) in (int, float) for x in (real, imag)):
        raise MalformedError("the pickle calls builtins.complex with arguments that are not numbers")
    return complex(real, imag)


def _bytes(data: Any = b"") -> bytes:
    if type(data) is not bytes:
        raise MalformedError(f"the pickle calls builtins.bytes with {a_kind(data)}")
    return data


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # how protocol 2 writes bytes: _codecs.encode(str(b, "latin1"), "latin1")
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise MalformedError("the pickle calls _codecs.encode with anything but a str and 'latin1'")
    return text.encode("latin1")


def _counter(counts: Any = None) -> Any:
    """collections.Counter on a dict of counts, as torch.save pickles it (in torch's weights-only allowlist); on
    anything else (which Python would count), an inert placeholder of the call."""
    if counts is None or type(counts) in (dict, PickledDict):
        return PickledCounter(counts or {})
    return Placeholder("collections.Counter", (counts,))


def _ordered_dict(items: Any = ()) -> PickledDict:
    d = PickledDict()
    for pair in _iterable(items, "collections.OrderedDict"):
        if type(pair) not in (list, tuple) or len(pair) != 2:
            raise MalformedError("the pickle builds an OrderedDict from something other than pairs")
        try:
            d[pair[0]] = pair[1]
        except TypeError as e:
            raise MalformedError(f"{a_kind(pair[0])} cannot be a dict key") from e
    return d


PLAIN_GLOBALS: dict[tuple[str, str], Constructor] = {
    (module, name): Constructor(f"{module}.{name}", func, hashes=func in (_ordered_dict, _set, _frozenset))
    for module, name, func in [
        ("collections", "OrderedDict", _ordered_dict),
        ("collections", "Counter", _counter),
        ("builtins", "set", _set),
        ("builtins", "frozenset", _frozenset),
        ("builtins", "complex", _complex),
        ("builtins", "bytes", _bytes),
        ("builtins", "bytearray", _bytes),  # kept as bytes: nothing here mutates it
        ("_codecs", "encode", _codecs_encode),
    ]
}


def resolve_plain(module: str, name: str) -> Constructor | None:
    """The resolver for pickles of plain data: the constructors of containers, sets, bytes and complex."""
    return PLAIN_GLOBALS.get((module, name))
