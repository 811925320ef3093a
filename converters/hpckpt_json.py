"""The world size and layout hpckpt's writers record: the manifest's header, or `.hpckpt.json`.

hpckpt now writes this record as part of the manifest (`core.commit.manifest`, `.hpckpt-manifest.jsonl`,
whose header has the same `format`, `world_size`, `mesh`, `placements` and `metadata` sizes);
checkpoints written before it have `.hpckpt.json`, described below, which is still read. A
manifest, when there is one, is the record; `.hpckpt.json` is then not consulted.

A rank that holds no data writes no file, so file names only give a lower bound of the world size
(a 64-rank reshard of a small model may leave ranks 10..63 without a file). The HyperParallel and
PyTorch DCP writers therefore add this small JSON file, written just before `.metadata` (so
`.metadata` stays the last file, the one that marks the checkpoint complete):

    {"hpckpt": 1, "written_by": "hpckpt 0.1.0", "format": "hyperparallel", "world_size": 64,
     "mesh": [64], "placements": "S0", "metadata": {".metadata": {"bytes": 2154, "sha256": "..."}}}

`mesh` and `placements` (the layout's text, only when one placement list applies to every
tensor) are there when the write had a target layout. `metadata` ties the record to the metadata
files written with it, so a directory saved into again later is not described by a stale record.
Neither loader reads it: HyperParallel's reads `.metadata` (or `{r}.metadata`) and the files
its `storage_data` names, PyTorch's `FileSystemReader` `.metadata` and the files it names. The
later manifest (issue 10) is meant to absorb it.

Reading: it is checkpoint input, so it is read only up to `MAX_BYTES` (a regular file, JSON of
limited depth: `core.safety.input_files`), its fields are type-checked, and it is used
only when it agrees with the checkpoint (its format, the sizes of the metadata files it names,
every rank in a file name below its world size); otherwise a warning says why and the world size
stays the one inferred from file names. It never fails a command.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from hpckpt import __version__
from hpckpt.core.commit import manifest
from hpckpt.core.errors import HpckptError
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.safety.input_files import load_json, read_small
from hpckpt.core.storage.urls import lexists

NAME = ".hpckpt.json"
RECORDED = ("hyperparallel", "torch-dcp")  # the formats whose world size file names cannot tell
SCHEMA = 1
MAX_BYTES = 64 << 10  # what hpckpt writes is a few hundred bytes
MAX_WORLD_SIZE = 1 << 20  # more is no real job; layout inference splits tensors into that many parts
# A record is believed up to this many ranks, or this many times the ranks that hold files: a forged
# world size would otherwise make `convert` keep a layout of 10^6 ranks (gigabytes of plan).
PLAUSIBLE_WORLD, PLAUSIBLE_FACTOR = 4096, 64


def record(format_name: str, world_size: int, metadata: Sequence[tuple[str, bytes]],
           mesh: Sequence[int] = (), placements: str = "") -> tuple[str, bytes]:
    """The `(name, bytes)` of the record of a checkpoint whose metadata files are `metadata`;
    the same bytes for every job of one fan-out plan."""
    doc: dict[str, Any] = {"hpckpt": SCHEMA, "written_by": f"hpckpt {__version__}", "format": format_name,
                           "world_size": world_size}
    if mesh:
        doc["mesh"] = list(mesh)
    if placements:
        doc["placements"] = placements
    doc["metadata"] = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                       for name, data in metadata}
    return NAME, (json.dumps(doc, indent=1) + "\n").encode()


def _read(index: CheckpointIndex) -> dict:
    """The parsed record. Raises HpckptError (too big, not a file, not JSON) or ValueError (not a record)."""
    path = index.root / NAME
    doc = load_json(read_small(path, "record of hpckpt's writer", MAX_BYTES), str(path))
    if not isinstance(doc, dict) or not _positive_int(doc.get("hpckpt")):
        raise ValueError("not an hpckpt record")
    if not _positive_int(doc.get("world_size")) or doc["world_size"] > MAX_WORLD_SIZE:
        raise ValueError(f"world_size {doc.get('world_size')!r} is not an integer from 1 to {MAX_WORLD_SIZE}")
    files = doc.get("metadata")
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        raise ValueError("its 'metadata' is not a map of file names to sizes")
    return doc


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _disagreement(doc: dict, index: CheckpointIndex, inferred: int | None) -> str | None:
    """Why the record does not describe this checkpoint, or None when it does."""
    if doc.get("format") != index.format:
        return f"it describes a {doc.get('format')!r} checkpoint, this one is {index.format!r}"
    if inferred is not None and inferred > doc["world_size"]:
        return f"it says world size {doc['world_size']}, but a file name names rank {inferred - 1}"
    if doc["world_size"] > max(PLAUSIBLE_WORLD, PLAUSIBLE_FACTOR * (inferred or 1)):
        return (f"it says world size {doc['world_size']}, but files name only {inferred or 0} rank(s): more than "
                f"{PLAUSIBLE_FACTOR} ranks without data per rank with data is not trusted (layouts would follow it)")
    named = set(doc["metadata"])
    present = set(index.metadata_files) - {NAME, manifest.NAME}
    if named != present:
        return f"it names metadata files {sorted(named)}, the checkpoint has {sorted(present)}"
    for name, info in doc["metadata"].items():
        try:
            size = (index.root / name).stat().st_size
        except OSError:
            return f"{name} cannot be stat'ed"
        if info.get("bytes") != size:
            return f"it was written with another {name} ({info.get('bytes')!r} bytes, now {size}; saved into since?)"
    return None


def written_by(index: CheckpointIndex) -> str | None:
    """`hpckpt VERSION` when hpckpt's record (its manifest) describes this checkpoint: hpckpt
    wrote it, whatever framework's dtype strings it used; else None."""
    if not index.root.is_dir() or record_name(index) is None:
        return None
    doc, problem = _problem(index, None)
    if doc is None or problem is not None:
        return None
    return str(doc.get("written_by") or "hpckpt")


def record_name(index: CheckpointIndex) -> str | None:
    """The file that records the checkpoint: its manifest, else a legacy `.hpckpt.json`, else None."""
    for name in (manifest.NAME, NAME):
        if lexists(index.root / name):
            return name
    return None


def _problem(index: CheckpointIndex, inferred: int | None) -> tuple[dict | None, str | None]:
    """The record and None, or None and what is wrong with it (a message naming the file)."""
    if record_name(index) == manifest.NAME:
        try:
            found = manifest.read(index.root / manifest.NAME)
        except HpckptError as exc:
            return None, exc.message
        doc = found.header
        if doc.get("world_size") is None:
            return None, f"{manifest.NAME}: it records no world size"
        problem = _disagreement(doc, index, inferred)
        return doc, None if problem is None else f"{manifest.NAME}: {problem}"
    try:
        doc = _read(index)
    except HpckptError as exc:
        return None, exc.message  # names the path already
    except ValueError as exc:
        return None, f"{NAME}: {exc}"
    problem = _disagreement(doc, index, inferred)
    return doc, None if problem is None else f"{NAME}: {problem}"


def apply(index: CheckpointIndex) -> None:
    """Take the exact world size from the checkpoint's record when it has a sound one; list the
    record among the metadata files (idempotent: a cached index may have it already)."""
    name = record_name(index)
    if name is None:
        return
    if name not in index.metadata_files:
        index.metadata_files.append(name)
    doc, problem = _problem(index, index.world_size)
    if problem is not None and name == manifest.NAME and "records no world size" in problem:
        return  # `hpckpt checksum` of a checkpoint whose world size nobody recorded
    if problem is not None:
        index.warnings.append(f"{problem} (ignored: the world size is inferred from file names)")
        return
    index.world_size, index.world_size_exact = doc["world_size"], True


def _lines_problem(found: manifest.Manifest) -> str | None:
    """What is wrong with the manifest's box lines (all read, one at a time), or None."""
    try:
        for _entry in found.file_digests():
            pass
    except HpckptError as exc:
        return exc.message
    return None


def problems(index: CheckpointIndex, inferred: int | None) -> list[str]:
    """What `verify` reports about the record (none when absent or sound): everything `apply`
    checks, and the sha256 of each metadata file it names. `inferred` is the world size from
    file names (a record cannot be checked against its own world size)."""
    name = record_name(index)
    if name is None:
        return []
    if name == manifest.NAME and index.format not in RECORDED:  # a manifest that records no world size
        try:
            found = manifest.read(index.root / name)
        except HpckptError as exc:
            return [exc.message]
        why = found.mismatch(index.root)
        problem = f"{manifest.NAME}: {why}" if why is not None else _lines_problem(found)
        return [] if problem is None else [problem]
    doc, problem = _problem(index, inferred)
    if name == manifest.NAME:
        if problem is not None and "records no world size" in problem:
            problem = None
        if problem is None and doc is not None:
            found = manifest.Manifest(index.root / manifest.NAME, doc)
            why = found.mismatch(index.root, [n for n in index.metadata_files if n != NAME])
            problem = None if why is None else f"{manifest.NAME}: {why}"
            problem = problem or _lines_problem(found)
        return [] if problem is None else [problem]
    if problem is None:
        for name, info in doc["metadata"].items():
            try:
                with open(index.root / name, "rb") as f:  # a metadata file the reader has just read
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as exc:
                problem = f"{NAME}: {name} cannot be read ({exc.strerror})"
                break
            if info.get("sha256") != digest:
                problem = f"{NAME}: {name} is not the one it was written with (sha256 differs)"
                break
    return [] if problem is None else [problem]
