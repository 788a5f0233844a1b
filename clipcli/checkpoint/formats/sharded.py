"""Sharded checkpoints: a Hugging Face index (`*.safetensors.index.json`, or `pytorch_model.bin.index.json` for
PyTorch shards) and its `weight_map`, or a directory of shards."""

from __future__ import annotations

import functools
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from clipcli.checkpoint.atomic import atomic_write, resolve_target
from clipcli.checkpoint.formats import safetensors as _safetensors
from clipcli.checkpoint.plugin import DIRECTORY, DirectoryWriter, Finding, Format, Opened, Plan, Target, defect
from clipcli.checkpoint.source import LOCAL, Store
from clipcli.checkpoint.tensor import TensorInfo
from clipcli.errors import InputError, MalformedError, MissingFileError, UsageError, WriteError

INDEX_SUFFIX = ".safetensors.index.json"
# PyTorch shards' indexes, as transformers names them (pytorch_model.bin.index.json): read, never written
TORCH_INDEX_SUFFIXES = (".bin.index.json", ".pt.index.json", ".pth.index.json")

OpenFile = Callable[[Path], tuple[dict[str, str], list[TensorInfo]]]


def open_index(
    path: Path, open_file: OpenFile = _safetensors.open_file, store: Store = LOCAL
) -> tuple[dict[str, str], list[TensorInfo], list[Path], dict[str, Any]]:
    """The metadata, tensors, shard files and index of a sharded checkpoint, from the index and headers.

    `open_file` reads a shard's metadata and tensors (safetensors' by default).
    """
    index, names = _read_index(path, store)
    shards = list(names)
    tensors: list[TensorInfo] = []
    metadata: dict[str, str] = {}
    for shard in shards:
        shard_path = path.parent / shard
        kind = store.kind(shard_path)
        if kind != "file":
            missing = "is not a file" if kind is not None else "does not exist"
            raise MissingFileError(f"shard {shard} named by the index {missing}", path)
        shard_meta, shard_tensors = open_file(shard_path)
        _add_metadata(metadata, shard_meta)
        for t in shard_tensors:
            if index["weight_map"].get(t.name) != shard:
                raise defect("not-in-index", f"the index does not map this tensor to {shard}", shard_path, t.name)
        missing = sorted(set(names[shard]) - {t.name for t in shard_tensors})
        if missing:
            raise defect("not-in-shard", f"tensor {missing[0]} named by the index is not in {shard}", path)
        tensors.extend(shard_tensors)
    # the index's own metadata (huggingface_hub's `metadata=`; PyTorch shards have no other place for it),
    # but its total size, which is the index's bookkeeping: non-strings as JSON
    extra = index.get("metadata")
    for key, value in extra.items() if isinstance(extra, dict) else ():
        if key != "total_size":
            metadata.setdefault(key, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
    return metadata, tensors, [path.parent / s for s in shards], index


def _read_index(path: Path, store: Store) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """An index of shards and its shards' tensors, each shard's as the weight map lists them.

    Raises:
        MalformedError: for an index that is no JSON, has no weight map of names to shard files, or names a
            shard outside its directory.
    """
    try:
        with io.TextIOWrapper(store.open(path), encoding="utf-8") as f:  # as Path.read_text reads it
            text = f.read()
        index = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedError(f"the index is not valid JSON ({e})", path) from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise MalformedError("the index has no 'weight_map' of tensor names to shard files", path)
    if not weight_map:
        raise MalformedError("the index's 'weight_map' names no tensors", path)
    names: dict[str, list[str]] = {}  # each shard's tensors, grouped once (an index may name 10,000 shards)
    for name, shard in weight_map.items():
        names.setdefault(shard, []).append(name)
    for shard in names:
        if not shard.strip():
            raise MalformedError("the index maps a tensor to an empty shard name", path)
        if os.path.isabs(shard) or ".." in Path(shard).parts:
            raise MalformedError(f"shard path {shard!r} leaves the checkpoint's directory", path)
        if Path(shard).name != shard.rsplit("/", 1)[-1]:  # "x/", "x/.": Path drops them, a loader would not
            raise MalformedError(f"shard path {shard!r} names a directory, not a shard file", path)
    return index, names


def find_index(directory: Path, suffixes: tuple[str, ...] = (INDEX_SUFFIX,), store: Store = LOCAL) -> Path | None:
    """The one index file (a name ending in one of `suffixes`) of a directory of shards, if it has one.

    Raises:
        InputError: when it holds several.
    """
    indexes = sorted(p for p in store.list(directory) if p.name.endswith(suffixes) and store.kind(p) == "file")
    if len(indexes) > 1:
        raise InputError(f"the directory holds {len(indexes)} index files; name one", directory)
    return indexes[0] if indexes else None


def open_directory(directory: Path, store: Store = LOCAL) -> tuple[dict[str, str], list[TensorInfo], list[Path]]:
    """Every `*.safetensors` of a directory without an index, in name order, as one checkpoint."""
    shards = sorted(p for p in _safetensors_in(directory, store) if store.kind(p) != "directory")
    if not shards:
        files = sorted(p.name for p in store.list(directory) if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".npz"))
        hint = f" such as {', '.join(files[:3])}" if files else ""
        raise MissingFileError(
            "the directory holds no .safetensors files, no *.safetensors.index.json, no pytorch_model.bin.index.json "
            f"and no distributed checkpoint (.metadata); name a file in it{hint}",
            directory,
        )
    tensors: list[TensorInfo] = []
    metadata: dict[str, str] = {}
    seen: set[str] = set()
    for shard in shards:
        if store.kind(shard) != "file":
            raise MissingFileError("a .safetensors in the directory that is not a file (a broken link?)", shard)
        shard_meta, shard_tensors = _safetensors.open_file(shard, store)
        _add_metadata(metadata, shard_meta)
        for t in shard_tensors:
            if t.name in seen:
                raise MalformedError("two shards hold this tensor", shard, t.name)
            seen.add(t.name)
        tensors.extend(shard_tensors)
    return metadata, tensors, shards


def findings(path: Path, store: Store = LOCAL) -> list[Finding]:
    """Every defect of a sharded checkpoint, from its index, its shards' headers and sizes and its directory's
    listing: each shard's own (`Format.defects`), shards the index names that are missing, tensors the index
    names that their shard does not hold (`not-in-shard`), tensors a shard holds that the index does not name
    (`not-in-index`) or names in another shard (`wrong-shard`), a tensor in two shards (`duplicate`), and
    shard files in the index's directory that it leaves out (`stray-shard`, see `_stray`).

    Raises:
        InputError: for a directory with no shards or several indexes (as opening it does).
    """
    if store.kind(path) == "directory":
        index = find_index(path, store=store) or find_index(path, TORCH_INDEX_SUFFIXES, store)
        if index is None:
            return _directory_findings(path, store)
        path = index
    try:
        index, names = _read_index(path, store)
    except MalformedError as e:
        return [Finding.of(e, "index")]
    fmt = _shard_format(path)
    out: list[Finding] = []
    holders: dict[str, list[str]] = {}  # the shards whose headers hold each tensor
    for shard, listed in names.items():
        shard_path = path.parent / shard
        kind = store.kind(shard_path)
        if kind != "file":
            missing = "is not a file" if kind is not None else "does not exist"
            out.append(Finding(str(path), None, "missing-shard", f"shard {shard} named by the index {missing}"))
            continue
        found = _shard_defects(fmt, shard_path, store)
        out += found
        if found:  # its tensors are not known for sure: the index is not compared with it
            continue
        assert fmt.open_file is not None
        held = {t.name for t in fmt.open_file(shard_path, store)[1]}
        for name in held:
            holders.setdefault(name, []).append(shard)
        out += [
            Finding(str(path), name, "not-in-shard", f"the index names it in {shard}, which does not hold it")
            for name in listed
            if name not in held
        ]
    weight_map = index["weight_map"]
    for name, shards in holders.items():
        for shard in shards:
            mapped = weight_map.get(name)
            if mapped == shard:
                continue
            if mapped is None:
                kind, problem = "not-in-index", f"{shard} holds it but the index does not name it"
            elif len(shards) > 1:
                kind, problem = (
                    "duplicate",
                    f"held by {len(shards)} shards ({', '.join(shards)}); the index names {mapped}",
                )
            else:
                kind, problem = "wrong-shard", f"{shard} holds it but the index names {mapped}"
            out.append(Finding(str(path.parent / shard), name, kind, problem))
    try:
        around = sorted(store.list(path.parent))
    except OSError:  # a store that cannot list a directory (plain HTTP): no stray shard can be seen there
        around = []
    for p in around:
        if p.name not in names and _stray(p.name, fmt) and store.kind(p) == "file":
            out.append(Finding(str(p), None, "stray-shard", f"a shard file the index {path.name} does not name"))
    return out


def _directory_findings(directory: Path, store: Store) -> list[Finding]:
    """Every defect of a directory of .safetensors shards without an index: each shard's, and a tensor held by
    two shards."""
    shards = sorted(p for p in _safetensors_in(directory, store) if store.kind(p) == "file")
    if not shards:
        open_directory(directory, store)  # raises, naming what the directory holds
    out: list[Finding] = []
    holders: dict[str, list[str]] = {}
    for shard in shards:
        found = _shard_defects(_safetensors.FORMAT, shard, store)
        out += found
        if not found:
            for t in _safetensors.open_file(shard, store)[1]:
                holders.setdefault(t.name, []).append(shard.name)
    for name, held in holders.items():
        if len(held) > 1:
            out.append(Finding(str(directory), name, "duplicate", f"held by {len(held)} shards ({', '.join(held)})"))
    return out


def _stray(name: str, fmt: Format) -> bool:
    """Whether a file beside an index that does not name it looks like one of its shards: any .safetensors
    beside a safetensors index; beside PyTorch shards' index, only a numbered shard (`-00003-of-00008.bin`), since
    PyTorch files of other kinds (`training_args.bin`, `optimizer.pt`) often lie there."""
    if fmt is _safetensors.FORMAT:
        return name.endswith(".safetensors")
    return name.endswith(fmt.suffixes) and "-of-" in name


def _shard_format(index: Path) -> Format:
    """The format of the shards an index names: PyTorch's for a PyTorch shards' index, else safetensors."""
    if index.name.endswith(TORCH_INDEX_SUFFIXES):
        from clipcli.checkpoint import registry  # here: PyTorch's reader only for PyTorch shards

        return registry.get("torch")
    return _safetensors.FORMAT


def _shard_defects(fmt: Format, shard: Path, store: Store) -> list[Finding]:
    """A shard's defects; a shard that is no file of its format at all (a web page) is one (`bad-shard`)."""
    try:
        return fmt.defects(shard, store)
    except InputError as e:
        return [Finding.of(e, "bad-shard", shard)]


def _add_metadata(metadata: dict[str, str], shard: dict[str, str]) -> None:
    """A shard's metadata added to the checkpoint's: each key from the first shard that has it (shards
    written together repeat theirs, e.g. `{"format": "pt"}`)."""
    for key, value in shard.items():
        metadata.setdefault(key, value)


def write_index(f: BinaryIO, base: dict[str, Any] | None, weight_map: dict[str, str], total_size: int) -> None:
    """An index of shards: the source's own index (if any) with its total size and weight map redone."""
    out = dict(base or {})
    out["metadata"] = {**out.get("metadata", {}), "total_size": total_size}
    out["weight_map"] = weight_map
    f.write((json.dumps(out, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def _safetensors_in(directory: Path, store: Store) -> list[Path]:
    """The paths in a directory that `*.safetensors` matches."""
    return [p for p in store.list(directory) if p.name.endswith(".safetensors")]


def open_path(path: Path, store: Store = LOCAL) -> Opened:
    """A directory of shards (through its index, if it has one) or an index of shards.

    A safetensors index comes first (Hugging Face repositories often hold both kinds of the same weights),
    then PyTorch shards' index, then loose .safetensors shards; never loose files over an index.
    """
    if store.kind(path) != "directory":
        torch = path.name.endswith(TORCH_INDEX_SUFFIXES)
        audits: list[Any] = []  # each PyTorch shard's pickle audit
        if torch:
            from clipcli.checkpoint import registry  # here: PyTorch's reader only for PyTorch shards

            open_torch = registry.get("torch").open

            def open_shard(shard: Path, store: Store) -> tuple[dict[str, str], list[TensorInfo]]:
                assert open_torch is not None
                opened = open_torch(shard, store)
                audits.extend(opened.audits)
                return opened.metadata, opened.tensors

        else:
            open_shard = _safetensors.open_file
        metadata, tensors, files, index = open_index(path, functools.partial(open_shard, store=store), store)
        name, keys = ("sharded-torch", frozenset()) if torch else ("sharded", _safetensors.FORMAT.layout_keys)
        return Opened(metadata, tensors, files, name, index, path, keys, sharded=True, audits=tuple(audits))
    index = find_index(path, store=store) or find_index(path, TORCH_INDEX_SUFFIXES, store)
    if index is not None and index.name.endswith(TORCH_INDEX_SUFFIXES):
        loose = sorted(p.name for p in _safetensors_in(path, store))
        if loose:
            raise InputError(
                f"the directory holds {index.name} and {len(loose)} .safetensors file(s) without an index "
                f"({', '.join(loose[:3])}{', ...' if len(loose) > 3 else ''}); name the index or a file",
                path,
            )
    if index is None:
        metadata, tensors, files = open_directory(path, store)
        return Opened(metadata, tensors, files, "sharded", layout_keys=_safetensors.FORMAT.layout_keys, sharded=True)
    return open_path(index, store)


# -- writing ----------------------------------------------------------------------------------------------


def kind_of(name: str) -> str | None:
    """'index' for the name of an index of safetensors shards (written), 'torch-index' for PyTorch shards'
    (read only), else None."""
    if name.endswith(INDEX_SUFFIX):
        return "index"
    if name.endswith(TORCH_INDEX_SUFFIXES):
        return "torch-index"
    return None


def plan_output(source: Any, out: Path, kind: str, tensors: list[TensorInfo], max_shard: int | None) -> Plan:
    """The shards of a directory (`kind` 'directory') or index ('index') output: the source's own shards and
    index, or with `max_shard` (bytes) new shards of at most that size (see `write.plan`).

    Raises:
        UsageError: for a source that is not sharded, without `max_shard`.
    """
    directory = out.parent if kind == "index" else out
    if max_shard is not None:
        return _reshard(tensors, directory, out if kind == "index" else None, max_shard, source.index)
    if source.format == "sharded":
        groups: dict[str, list[TensorInfo]] = {}
        for t in tensors:
            groups.setdefault(t.file, []).append(t)
        files = [(directory / name, groups.get(str(f), [])) for f, name in _shard_names(source)]
        index = None
        if source.index_path is not None:
            index = out if kind == "index" else directory / source.index_path.name
        return Plan([(target, group) for target, group in files if group], index, source.index, directory)
    raise UsageError("a directory output needs a sharded input; name a .safetensors, .npz or .npy file", out)


def check_target(target: Target, source: Any, resharding: bool, command: str) -> None:
    """Refuses an output path that `source` cannot be written to, before any work (see `write.check_output`).

    Raises:
        UsageError: for a PyTorch file, PyTorch shards or a distributed checkpoint (never written back), an
            existing file that is no checkpoint file, or a directory output for a source that is not sharded
            safetensors.
    """
    raw, out, kind, hint, param = target.raw, target.path, target.kind, target.hint, target.param
    if not target.writable and kind_of(out.name) is None:  # a file format clipcli reads only
        from clipcli.checkpoint import registry  # here: only a refusal needs the format's record

        fmt = registry.get(kind)
        raise UsageError(f"clipcli reads {fmt.plural or f'{kind} files'} but does not write them; {hint}", raw, param)
    if not target.writable or (
        out == source.path and (source.format == "distcp" or (source.format == "sharded-torch" and not resharding))
    ):
        raise UsageError(f"clipcli reads PyTorch files but does not write them; {hint}", raw, param)
    if kind in ("index", DIRECTORY) and source.format == "sharded-torch" and not resharding:
        shards = "clipcli convert --max-shard-size writes them as .safetensors shards"
        raise UsageError(f"clipcli reads PyTorch shards but does not write them; {hint} ({shards})", raw, param)
    if kind == DIRECTORY and not (out == source.path and source.format == "sharded"):
        if out.suffix and not raw.endswith(("/", os.sep)) and not out.is_dir():
            raise UsageError(
                f"unknown output format {out.suffix!r}; {hint} (or a directory for a sharded input)", raw, param
            )
        if out.exists() and not out.is_dir():
            raise UsageError(f"exists and is not a directory; {hint}", raw, param)
        if source.format != "sharded" and not resharding:
            more = " (or --max-shard-size)" if command == "convert" else ""
            raise UsageError(f"a directory output needs a sharded input{more}; {hint}", raw, param)


def _check_output(layout: Plan, source: Any) -> None:
    _check_no_stale_shards(layout, source.index_path if source.format == "sharded-torch" else None)


def _shard_names(source: Any) -> list[tuple[Path, Path]]:
    """Each shard of a sharded source with its path relative to the index's directory (`a/model.safetensors`):
    shards of one name in different subdirectories stay apart in the output. The index reader refuses
    shard paths that leave its directory, so each is below it."""
    base = source.path if source.index_path is None else source.index_path.parent
    return [(f, f.relative_to(base)) for f in source.files]


def _check_no_stale_shards(layout: Plan, source_index: Path | None = None) -> None:
    """Refuses a directory output that holds other shards or indexes than those the write makes: left
    beside the new ones, they would make the directory a different (or an unreadable) checkpoint.

    Raises:
        WriteError: naming a few of them.
    """
    if layout.directory is None or not layout.directory.is_dir():
        return
    made = {resolve_target(f) for f, _ in layout.files} | ({resolve_target(layout.index)} if layout.index else set())
    if source_index is not None:  # PyTorch shards converted beside themselves: the new index is read first
        made.add(resolve_target(source_index))
    directories = dict.fromkeys([layout.directory, *(f.parent for f, _ in layout.files)])  # shards' subdirectories
    stale = sorted(
        p.relative_to(layout.directory).as_posix()
        for d in directories
        if d.is_dir()
        for p in d.iterdir()
        if p.name.endswith((".safetensors", INDEX_SUFFIX, *TORCH_INDEX_SUFFIXES)) and resolve_target(p) not in made
    )
    if stale:
        listed = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise WriteError(
            f"the directory holds {listed}, which this write would leave beside its own shards; "
            "remove them or name an empty directory",
            layout.directory,
        )


def _reshard(
    tensors: list[TensorInfo], directory: Path, index: Path | None, max_shard: int, base: dict[str, Any] | None
) -> Plan:
    """Tensors in order, a new shard started when the next would pass `max_shard` bytes."""
    groups: list[list[TensorInfo]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_shard:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    prefix = "model" if index is None else index.name[: -len(INDEX_SUFFIX)]
    n = len(groups)
    files = [(directory / f"{prefix}-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]
    return Plan(files, index or directory / f"{prefix}{INDEX_SUFFIX}", base, directory)


def _write_index(layout: Plan) -> list[Path]:
    """Writes the index of a plan's shards, if it has one; returns it."""
    if layout.index is None:
        return []
    where = layout.index.parent
    mapping = {t.name: target.relative_to(where).as_posix() for target, group in layout.files for t in group}
    total = sum(t.nbytes for _, group in layout.files for t in group)
    with atomic_write(layout.index) as f:
        write_index(f, layout.index_base, mapping, total)
    return [layout.index]


FORMAT = Format(
    "sharded",
    (INDEX_SUFFIX, *TORCH_INDEX_SUFFIXES),
    recognises=lambda directory, store: True,  # any directory: the last directory format asked
    markers=("model.safetensors.index.json", "pytorch_model.bin.index.json"),  # Hugging Face's index names
    open=open_path,
    findings=findings,
    directory_writer=DirectoryWriter(
        kind_of,
        plan_output,
        _check_output,
        _write_index,
        check_target,
        written=frozenset({"index"}),
        names=f"a directory (or a *{INDEX_SUFFIX})",
    ),
)
