"""The library entry points, one per command; the CLI is a thin layer over these.

Each returns plain data (the documented JSON documents), so scripts get exactly what
`hpckpt ... --json` prints.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Any, Iterable

from hpckpt import __version__
from hpckpt.converters import open_index
from hpckpt.core.errors import HpckptError
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.validate import Finding, exit_code, validate

SCHEMA_VERSION = 1
_RANK = re.compile(r"_rank(\d+)[_.]|^__(\d+)_\d+\.distcp$")


def select(names: Iterable[str], include: Iterable[str] = (), exclude: Iterable[str] = ()) -> list[str]:
    """Keep names matching any `include` glob (all when none) and no `exclude` glob."""
    include, exclude = list(include), list(exclude)
    return [
        n for n in names
        if (not include or any(fnmatch.fnmatchcase(n, g) for g in include))
        and not any(fnmatch.fnmatchcase(n, g) for g in exclude)
    ]


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    return repr(value)


def rank_of(file: str) -> int | None:
    match = _RANK.search(os.path.basename(file))
    if not match:
        return None
    return int(match.group(1) or match.group(2))


def _file_sizes(index: CheckpointIndex) -> list[dict]:
    out = []
    for name in index.metadata_files + index.data_files:
        try:
            size = os.stat(index.root / name).st_size
        except OSError:
            size = None
        out.append({"path": name, "bytes": size})
    return out


def inspect(path: str | Path, include: Iterable[str] = (), exclude: Iterable[str] = (),
            shards: Iterable[str] = (), decode_values: bool = True, use_cache: bool = True) -> dict:
    """Describe a checkpoint from its metadata (data files are only stat'ed, values decoded).

    `shards` globs select tensors whose chunk boxes are listed per rank and file. Large
    HyperParallel indexes are cached after the first run (see converters.index_cache).
    """
    index = open_index(path, use_cache=use_cache)
    files = _file_sizes(index)
    names = select(index.tensors, include, exclude)
    tensors = []
    for fqn in names:
        entry = index.tensors[fqn]
        tensors.append({
            "fqn": fqn,
            "dtype": entry.dtype.name,
            "dtype_as_written": entry.dtype_spelling,
            "shape": list(entry.shape),
            "chunks": entry.n_chunks,
            "bytes": entry.nbytes,
        })
    values = []
    for fqn in select(index.values, include, exclude):
        value = index.values[fqn]
        item: dict[str, Any] = {"fqn": fqn, "file": value.file, "offset": value.offset, "length": value.length}
        if decode_values:
            try:
                decoded = index.decode_value(fqn)
                item.update(type=type(decoded).__name__, value=_jsonable(decoded))
            except HpckptError as exc:
                item.update(type=None, error=exc.message)
        values.append(item)
    document: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "hpckpt_version": __version__,
        "path": str(path),
        "format": index.format,
        "format_version": index.format_version,
        "framework": index.framework,
        "world_size": index.world_size,
        "files": files,
        "total_bytes": sum(f["bytes"] or 0 for f in files),
        "counts": {
            "tensors": len(index.tensors),
            "values": len(index.values),
            "chunks": sum(t.n_chunks for t in index.tensors.values()),
            "tensor_bytes": sum(t.nbytes for t in index.tensors.values()),
        },
        "tensors": tensors,
        "values": values,
    }
    shard_globs = list(shards)
    if shard_globs:
        document["shards"] = [
            {
                "fqn": fqn,
                "chunks": [
                    {
                        "offsets": list(c.box.offsets),
                        "sizes": list(c.box.sizes),
                        "file": c.file,
                        "key": c.key,
                        "rank": rank_of(c.file),
                    }
                    for c in index.tensors[fqn].chunks
                ],
            }
            for fqn in select(names, shard_globs)
        ]
    return document


def verify(path: str | Path, strict: bool = False) -> dict:
    """Check a checkpoint's structure; the document's `exit_code` is what `hpckpt verify` exits with."""
    index = open_index(path)
    findings: list[Finding] = validate(index)
    return {
        "schema": SCHEMA_VERSION,
        "hpckpt_version": __version__,
        "path": str(path),
        "format": index.format,
        "ok": exit_code(findings, strict) == 0,
        "exit_code": exit_code(findings, strict),
        "checked": {
            "tensors": len(index.tensors),
            "chunks": sum(t.n_chunks for t in index.tensors.values()),
            "values": len(index.values),
            "files": len(index.data_files),
        },
        "findings": [f.to_json() for f in findings],
    }
