"""The formats clipcli reads and writes: names and suffixes, each format's module imported when needed."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import BinaryIO

from clipcli.checkpoint import source
from clipcli.checkpoint.plugin import DirectoryWriter, Format, Opened
from clipcli.checkpoint.source import LOCAL, Store
from clipcli.errors import FileTypeError, shown_path

# A format is a module under formats/ and a line here: its name, module and the suffixes that name it. In
# this order first bytes are sniffed (torch's zips before other zips) and directories recognised (a
# distributed checkpoint before a directory of shards). Modules are imported when a file needs them (PyTorch's
# reader and its unpickler would be a tenth of the start-up of every other command).
_BUILTIN: list[tuple[str, str, tuple[str, ...], bool]] = [  # name, module, suffixes, whether a directory format
    ("torch", "torch", (".pt", ".pth", ".bin", ".ckpt"), False),
    ("npz", "npz", (".npz",), False),
    ("npy", "npy", (".npy",), False),
    ("safetensors", "safetensors", (".safetensors",), False),
    ("distcp", "dcp", (), True),
    ("sharded", "sharded", (".safetensors.index.json", ".bin.index.json", ".pt.index.json", ".pth.index.json"), True),
]
_DIRECTORY_WRITER = "sharded"  # the format a directory output is written in
# What to name instead of an output clipcli cannot write (in place: what the input could be converted to)
_OUTPUT_HINTS = ("name a .safetensors, .npz, .npy or .pt file", "give -o OUT.safetensors (or .npz, .pt) instead")
_MODULES = {name: module for name, module, _, _ in _BUILTIN}
_SUFFIXES = {name: suffixes for name, _, suffixes, _ in _BUILTIN}
_DIRECTORIES = [name for name, _, _, directory in _BUILTIN if directory]
_LOADED: dict[str, Format] = {}

UNKNOWN = "not a known checkpoint format"
HEAD_BYTES = 512  # enough to see a tar header's magic at 257


def register(fmt: Format) -> None:
    """Adds a format (or replaces one of the same name): sniffed after those known before it."""
    _MODULES.setdefault(fmt.name, "")
    _SUFFIXES[fmt.name] = fmt.suffixes
    if fmt.recognises is not None and fmt.name not in _DIRECTORIES:
        _DIRECTORIES.insert(0, fmt.name)  # before the directory of shards, which takes any directory
    _LOADED[fmt.name] = fmt


def unregister(name: str) -> None:
    """Removes a format `register` added."""
    _MODULES.pop(name, None)
    _SUFFIXES.pop(name, None)
    _LOADED.pop(name, None)
    if name in _DIRECTORIES:
        _DIRECTORIES.remove(name)


def get(name: str) -> Format:
    """The format of a name, its module imported if it was not."""
    fmt = _LOADED.get(name)
    if fmt is None:
        fmt = _LOADED[name] = importlib.import_module(f"clipcli.checkpoint.formats.{_MODULES[name]}").FORMAT
    return fmt


def named_by(filename: str) -> str | None:
    """The format whose suffix a file name ends with, if any."""
    for name, suffixes in _SUFFIXES.items():
        if suffixes and filename.endswith(suffixes):
            return name
    return None


def sniff(head: bytes, f: BinaryIO | None = None) -> str | None:
    """The format the first bytes of a file show, if any (the file `f` given: the format may look further)."""
    for name in _MODULES:
        fmt = get(name)
        if fmt.sniff is not None and fmt.sniff(head, f):
            return name
    return None


def read_head(path: Path, store: Store = LOCAL) -> bytes:
    """The first bytes of a file, enough to tell its format."""
    return source.read_head(store, path, HEAD_BYTES)


def file_format(path: Path, store: Store = LOCAL) -> str | None:
    """The format of a file by what it holds, whatever its name."""
    with store.open(path) as f:
        return sniff(f.read(HEAD_BYTES), f)


def describe(head: bytes) -> str:
    """What the first bytes of a file say it is, as a phrase for an error message."""
    text = head.lstrip().lower()
    if not head:
        return "an empty file"
    if head.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer, not the checkpoint itself (run `git lfs pull`)"
    if text.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml")):
        return "an HTML page, not a checkpoint (a download that returned a web page?)"
    for name in _MODULES:
        fmt = get(name)
        what = fmt.describe(head) if fmt.describe is not None else None
        if what is not None:
            return what
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 file (a Keras .h5?)"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file"
    if head[257:262] == b"ustar":
        return "a tar archive (torch.save's format until early 2017, torch 0.1.x, which clipcli does not read)"
    if text.startswith((b"{", b"[")) and _json_start(head):
        return "a JSON file"
    if _is_text(head):
        return "a text file"
    return UNKNOWN


def _json_start(head: bytes) -> bool:
    """Whether the first bytes of a file (all of it, or its first HEAD_BYTES) are JSON, or JSON cut short: not a
    TOML or INI file's `[section]`."""
    import json  # (an error's message alone needs it)

    text = head.decode("utf-8", "ignore").rstrip()
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg.startswith("Extra data"):  # JSON, then more (JSON lines)
            return True
        # cut short: in a string the cut left open, or in the last value (`tru`, `-`, `1.`)
        cut = len(head) >= HEAD_BYTES and (e.pos >= len(text) - 6 or e.msg.startswith("Unterminated string"))
        return cut
    except RecursionError:
        return True
    return True


def _is_text(head: bytes) -> bool:
    if b"\x00" in head:
        return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not just a character cut at the end of the head
            return False
        text = head[: e.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\n\r\f" for c in text)


def open_path(path: Path, store: Store = LOCAL) -> Opened:
    """The checkpoint at an existing path, opened by its format (`format_of`).

    Raises:
        FileTypeError: for a file of no known format; what the format's reader raises.
    """
    fmt = format_of(path, store)
    if fmt.open is not None:
        return fmt.open(path, store)
    assert fmt.open_file is not None
    metadata, tensors = fmt.open_file(path, store)
    return Opened(metadata, tensors, [path], fmt.name, layout_keys=fmt.layout_keys)


def format_of(path: Path, store: Store = LOCAL) -> Format:
    """The format of an existing path: of a directory, the first directory format that recognises it; of a
    file, the format its suffix names or, without one clipcli knows, its first bytes show.

    Raises:
        FileTypeError: for a file of no known format.
    """
    if store.kind(path) == "directory":
        for name in _DIRECTORIES:
            fmt = get(name)
            if fmt.recognises is not None and fmt.open is not None and fmt.recognises(path, store):
                return fmt
    name = named_by(path.name)
    if name is None:  # no suffix clipcli knows: the first bytes tell
        name = file_format(path, store)
        if name is None and path.name == ".metadata":  # torch.distributed.checkpoint's: the directory reads
            raise FileTypeError(
                "the metadata of a distributed checkpoint, which reads only as a whole: name its directory "
                f"({shown_path(str(path.parent))}) instead",
                path,
            )
        if name is None or get(name).open_file is None:
            raise FileTypeError(
                "unknown checkpoint suffix (expected .safetensors, .safetensors.index.json, .npz, .npy, .pt, "
                f".pth, .bin, .ckpt or pytorch_model.bin.index.json, or a directory); the file is "
                f"{describe(read_head(path, store))}",
                path,
            )
    return get(name)


def directory_markers() -> list[str]:
    """The files that show a directory of a directory format where a store cannot list one (`Format.markers`), in
    the order the formats are asked."""
    return [m for name in _DIRECTORIES for m in get(name).markers]


def directory_writer() -> DirectoryWriter:
    """How a directory output is written (a directory of safetensors shards and its index)."""
    writer = get(_DIRECTORY_WRITER).directory_writer
    assert writer is not None
    return writer


def output_hint(in_place: bool = False) -> str:
    """What a message about an output clipcli cannot write tells to name instead."""
    return _OUTPUT_HINTS[in_place]


def writable(name: str | None) -> bool:
    """Whether clipcli writes a format."""
    return name is not None and get(name).write is not None
