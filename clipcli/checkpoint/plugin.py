"""What a format module provides: its `FORMAT` record, read by the registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from clipcli.checkpoint.source import Store
from clipcli.checkpoint.tensor import TensorInfo
from clipcli.errors import ClipcliError, MalformedError

Chunks = Callable[[TensorInfo], Iterable[np.ndarray]]
Expect = Callable[[TensorInfo, int], None]


class Finding(NamedTuple):
    """A defect `verify` found in a checkpoint: the file it is in, the tensor it concerns (None: the file's),
    a stable short code of its kind (`gap`, `missing-shard`, `crc`, ...) and what is wrong, in words."""

    file: str
    tensor: str | None
    kind: str
    problem: str

    @classmethod
    def of(cls, error: ClipcliError, kind: str = "malformed", file: str | Path | None = None) -> Finding:
        """The finding an error states: its kind the error's own (see `defect`) or `kind`, its file the error's
        or `file`."""
        where = error.path if error.path is not None else file
        return cls(str(where or ""), error.tensor, getattr(error, "kind", kind), error.message)


def defect(kind: str, message: str, path: str | Path | None = None, tensor: str | None = None) -> MalformedError:
    """A MalformedError that names its kind of defect (its `kind`, as a `Finding`'s): `open` raises the first one
    it meets, a format's `findings` lists each."""
    error = MalformedError(message, path, tensor)
    error.kind = kind  # type: ignore[attr-defined]  # kept across processes (ClipcliError.__reduce__)
    return error


def refusals(open_: Callable[[Path, Store], Any], path: Path, store: Store) -> list[Finding]:
    """What opening `path` with `open_` (a format's `open_file` or `open`) refuses as malformed, as findings: the
    one finding of a format whose reader stops at the first defect; [] when it opens."""
    try:
        open_(path, store)
    except MalformedError as e:
        return [Finding.of(e, file=path)]
    return []


class Plan(NamedTuple):
    """What writing a checkpoint makes: data files, each with its tensors in order, then an index of shards.

    `index_base` is the source's own index (kept, with its weight map and total size redone);
    `directory`, the directory of shards, is made if missing.
    """

    files: list[tuple[Path, list[TensorInfo]]]
    index: Path | None = None
    index_base: dict[str, Any] | None = None
    directory: Path | None = None


DIRECTORY = "directory"  # the kind of an output path that names no file (no format's suffix): a directory


class Target(NamedTuple):
    """An output path as given (`raw`), its path, what it names (`write.output_kind`), whether clipcli writes that,
    the hint its error messages end with, and the option that named it."""

    raw: str
    path: Path
    kind: str
    writable: bool
    hint: str
    param: str = "-o"


class DirectoryWriter(NamedTuple):
    """How a format writes a directory of files (or an index of them), as `write.plan` and `write.save` ask.

    `kind_of(name)` says which of the format's own file names a name is ('index': written; another word:
    read only), if any; `plan(source, out, kind, tensors, max_shard)` lays out the files of a directory or
    index output; `check(plan, source)` refuses a directory that holds other files of the format;
    `finish(plan)` writes what goes after the data files (an index), and returns the files it wrote;
    `check_target(target, source, resharding, command)` refuses an output that this source cannot be written to
    (its own place, for a checkpoint clipcli does not write back; a directory, for one that is not sharded).
    `written` holds the kinds `kind_of` names that it writes; `names` says, in a message, what to name instead.
    """

    kind_of: Callable[[str], str | None]
    plan: Callable[[Any, Path, str, list[TensorInfo], int | None], Plan]
    check: Callable[[Plan, Any], None]
    finish: Callable[[Plan], list[Path]]
    check_target: Callable[[Target, Any, bool, str], None]
    written: frozenset[str] = frozenset()
    names: str = "a directory"


class Opened(NamedTuple):
    """What opening a checkpoint found, from its headers alone.

    `files` are the files holding its data (None: the path opened); `format` is the name reports show (None:
    the format's own); `index` and `index_path` are the index of shards it was opened through, if any;
    `layout_keys` are the metadata keys that say how the files were written, not what they hold; `sharded`
    says whether it is a checkpoint of several files by its kind (a directory or an index), however many;
    `audits` are the pickle audits of the pickles it was read from (`formats/_pickle_audit.PickleAudit`).
    """

    metadata: dict[str, str]
    tensors: list[TensorInfo]
    files: list[Path] | None = None
    format: str | None = None
    index: dict[str, Any] | None = None
    index_path: Path | None = None
    layout_keys: frozenset[str] = frozenset()
    sharded: bool = False
    audits: tuple[Any, ...] = ()


@dataclass(frozen=True, eq=False)  # one record per format: two are the same format when they are one object
class Format:
    """A checkpoint format, as its module's `FORMAT` describes it to the registry.

    Every file is read through the `Store` given (`source.py`), never opened by name. A file format has
    `open_file` (a file's metadata and tensors, from its header); a directory format has `recognises` (whether
    a directory is one of its checkpoints) and `open` (a directory or one of its own files, such as an index,
    into `Opened`). `sniff` says whether a file's first bytes are the format's (the open file given: it may
    look further), `describe` names what such bytes are in a message about
    a file that is not what its name says. A writable format has `write` (the tensors, in order, from their
    chunks), and where its data can be written in any order once its header is, `header`; `check_tensor` and
    `check_file` refuse, before anything is written, what it cannot hold (raising UnsupportedError); `write` and
    `check_file` are given the store the source is read from (`torch_write` reads its structure there).
    `c_order` says it holds values in C order only; `layout_keys`, the metadata keys that say how a file was
    written, not what it holds; `directory_writer`, how it writes a directory of files, where it does;
    `plural`, what messages call its files. `findings` (for `verify`) lists every defect it sees in a file or
    directory from headers and sizes (zip members' CRCs aside), where `open` raises on the first; a format
    without it is checked by opening it (`refusals`). `scan`, where a format has one, is the part of `findings`
    that opening does not see (a PyTorch zip's CRCs): what `defects` runs for a checkpoint already opened, so
    that `verify` parses a pickle once. `markers`, the files that show a directory of the format where the store
    cannot list one (plain HTTP): a distributed checkpoint's `.metadata` (the directory is read), a sharded
    checkpoint's usual index names (the index is read, as if named).
    """

    name: str
    suffixes: tuple[str, ...] = ()
    sniff: Callable[[bytes, BinaryIO | None], bool] | None = None
    describe: Callable[[bytes], str | None] | None = None
    open_file: Callable[[Path, Store], tuple[dict[str, str], list[TensorInfo]]] | None = None
    recognises: Callable[[Path, Store], bool] | None = None
    open: Callable[[Path, Store], Opened] | None = None
    write: Callable[[BinaryIO, list[TensorInfo], dict[str, str], Chunks, Expect, Store], None] | None = None
    header: Callable[[list[TensorInfo], dict[str, str]], bytes] | None = None
    check_tensor: Callable[[TensorInfo], None] | None = None
    check_file: Callable[[Path, list[TensorInfo], str, dict[str, str], Store], None] | None = None
    c_order: bool = False
    layout_keys: frozenset[str] = frozenset()
    directory_writer: DirectoryWriter | None = None
    plural: str = ""  # what messages call its files ("PyTorch files"); "" is "<name> files"
    findings: Callable[[Path, Store], list[Finding]] | None = None
    scan: Callable[[Path, Store], list[Finding]] | None = None
    markers: tuple[str, ...] = ()  # files that show a directory of the format where a store cannot list one

    def defects(self, path: Path, store: Store, opened: bool = False) -> list[Finding]:
        """Every defect `findings` sees in a file or directory of this format or, without it, what opening it
        refuses (its first defect); [] for none. `opened`: the caller opened it (nothing refused), so `scan`
        is enough where the format has one."""
        if opened and self.scan is not None:
            return self.scan(path, store)
        if self.findings is not None:
            return self.findings(path, store)
        opener = self.open if self.open is not None else self.open_file
        assert opener is not None
        return refusals(opener, path, store)
