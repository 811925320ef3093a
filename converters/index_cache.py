"""A snapshot of a large checkpoint's index (all but the chunk lists), so a second `inspect` is instant.

Parsing a metadata pickle costs microseconds per chunk in CPython even when every object is
thrown away (docs/design-figures.md), so a 64-rank, 10,000-tensor checkpoint takes seconds to
list however the pickle is read. After the first parse, the tensor list, values and files are
stored as JSON (never a pickle) under the user's cache directory, keyed by the metadata files'
path, size, mtime, ctime and inode; any change to them misses the cache. Chunk lists are not
stored: a command that needs them parses the real metadata then. Only checkpoints whose
metadata exceeds `MIN_METADATA_BYTES` are cached. `HPCKPT_NO_CACHE=1` turns it off;
`HPCKPT_CACHE_DIR` moves it. `verify` never uses it: it always reads the real metadata.

The same snapshot is the listing a manifest carries (`core.commit.manifest`, its header's `index`), made
by the writer from its output: `from_manifest` takes it while every metadata file has the size
and digest the manifest records, so even the first `inspect` of a checkpoint hpckpt wrote (or
`hpckpt checksum` recorded) needs no pickle. It is checkpoint input, so it is type-checked first.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Callable

from hpckpt import __version__
from hpckpt.core import dtypes
from hpckpt.core.commit import manifest
from hpckpt.core.paths import cache_directory
from hpckpt.core.commit.replace import replace_file
from hpckpt.core.errors import HpckptError
from hpckpt.core.index import CheckpointIndex, Chunk, Locator, TensorEntry, ValueEntry
from hpckpt.core.safety import input_files

MIN_METADATA_BYTES = 4 * 1024 * 1024
_MAGIC = b"HPCKPT-INDEX-3\n"


def cache_dir() -> Path | None:
    return cache_directory("index")


def _cache_file(root: Path, metadata_files: list[str]) -> Path | None:
    directory = cache_dir()
    if directory is None or not isinstance(root, Path):  # objects in a store: no inode to key on
        return None
    identity = [__version__, str(root.resolve())]
    total = 0
    for name in metadata_files:
        st = os.stat(root / name)
        identity.append([name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        total += st.st_size
    if total < MIN_METADATA_BYTES:
        return None
    digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:32]
    return directory / f"{digest}.idx"


def load(root: Path, metadata_files: list[str], locator: Locator,
         parse: Callable[[], CheckpointIndex]) -> CheckpointIndex | None:
    """Return the cached index of `root`, or None (not cached, changed, or unreadable).

    The snapshot holds everything but the chunk lists; a command that needs chunks (`--shards`,
    reads) gets them from `parse()`, run once on first need.
    """
    try:
        path = _cache_file(root, metadata_files)
        if path is None or not path.is_file():
            return None
        raw = input_files.read_small(path, "index snapshot", input_files.metadata_limit())
        if not raw.startswith(_MAGIC):
            return None
        return _decode(input_files.load_json(raw[len(_MAGIC):], str(path)), root, locator, parse)
    except (OSError, ValueError, KeyError, TypeError, IndexError, HpckptError):
        return None  # a cache is never a reason to fail


def store(index: CheckpointIndex) -> None:
    """Write the snapshot of `index` (atomically); failures are ignored."""
    try:
        path = _cache_file(index.root, index.metadata_files)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _MAGIC + json.dumps(_encode(index), separators=(",", ":")).encode()
        # a cache: rebuilt if lost; a random name, as the cache may be shared by processes of the same pid
        replace_file(path, data, fsync=False, aside=path.with_name(f".tmp-{secrets.token_hex(8)}"), mode=0o600)
    except OSError:
        pass


def snapshot(index: CheckpointIndex) -> dict:
    """The listing of `index` a manifest carries: the snapshot, with each tensor's layout inferred."""
    from hpckpt.core.geometry.layout import inferred_layouts

    inferred_layouts(index)
    return _encode(index)


def from_manifest(root: Path, metadata_files: list[str], locator: Locator,
                  parse: Callable[[], CheckpointIndex]) -> CheckpointIndex | None:
    """The index from the listing in `root`'s manifest, or None (no manifest, no listing, a
    listing that does not type-check, or metadata files that changed since it was written)."""
    try:
        found = manifest.read(root / manifest.NAME)
        listing = found.header.get("index") if found is not None else None
        if not isinstance(listing, dict) or not _sound(listing):
            return None
        if found.mismatch(root, metadata_files) is not None:
            return None
        return _decode(listing, root, locator, parse)
    except (OSError, ValueError, KeyError, TypeError, IndexError, HpckptError):
        return None  # the metadata is read instead


def _sound(doc: dict) -> bool:
    """A listing from a checkpoint file has the snapshot's types and names no path outside it."""
    def name(v) -> bool:
        return isinstance(v, str) and not v.startswith("/") and ".." not in Path(v).parts

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    tensors, values = doc.get("tensors"), doc.get("values")
    return (isinstance(tensors, list) and isinstance(values, list)
            and all(isinstance(t, list) and len(t) == 6 and isinstance(t[0], str) and t[1] in dtypes.BY_NAME
                    and isinstance(t[2], str) and isinstance(t[3], list) and all(map(count, t[3]))
                    and count(t[4]) and (t[5] is None or isinstance(t[5], str)) for t in tensors)
            and all(isinstance(v, list) and len(v) == 5 and isinstance(v[0], str) and name(v[1]) and count(v[2])
                    and count(v[3]) and v[4] in ("pickle", "torch_save", "json") for v in values)
            and all(isinstance(doc.get(k), list) and all(map(name, doc[k])) for k in ("metadata_files", "data_files"))
            and isinstance(doc.get("format"), str) and isinstance(doc.get("notes", []), list)
            and all(isinstance(n, str) for n in doc.get("notes", []))
            and isinstance(doc.get("planner_data", []), list))


def _encode(index: CheckpointIndex) -> dict:
    return {
        "format": index.format,
        "format_version": index.format_version,
        "framework": index.framework,
        "world_size": index.world_size,
        "metadata_files": index.metadata_files,
        "data_files": index.data_files,
        "planner_data": [[k, list(v) if isinstance(v, (list, tuple)) else v] for k, v in (index.planner_data or {}).items()],
        "values": [[v.fqn, v.file, v.offset, v.length, v.encoding] for v in index.values.values()],
        "tensors": [[e.fqn, e.dtype.name, e.dtype_spelling, list(e.shape), e.n_chunks, e.layout_hint]
                    for e in index.tensors.values()],
        "notes": index.notes,
    }


def _decode(header: dict, root: Path, locator: Locator, parse: Callable[[], CheckpointIndex]) -> CheckpointIndex:
    full: list[CheckpointIndex] = []

    def chunks_of(fqn: str) -> Callable[[], list[Chunk]]:
        def build() -> list[Chunk]:
            if not full:
                full.append(parse())
            return full[0].tensors[fqn].chunks
        return build

    tensors = {}
    for fqn, name, spelling, shape, n_chunks, layout in header["tensors"]:
        entry = TensorEntry(fqn, dtypes.BY_NAME[name], tuple(shape), None, spelling,
                            build=chunks_of(fqn), n_chunks=n_chunks)
        entry.layout_hint = layout
        tensors[fqn] = entry
    values = {v[0]: ValueEntry(*v) for v in header["values"]}
    planner = {k: tuple(v) if isinstance(v, list) else v for k, v in header["planner_data"]}
    return CheckpointIndex(
        root=root,
        format=header["format"],
        format_version=header["format_version"],
        framework=header["framework"],
        tensors=tensors,
        values=values,
        metadata_files=header["metadata_files"],
        data_files=header["data_files"],
        locator=locator,
        world_size=header["world_size"],
        planner_data=planner or None,
        notes=header["notes"],
    )
