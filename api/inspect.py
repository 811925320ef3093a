"""`inspect`: what a checkpoint holds, from its metadata alone (data files are only stat'ed)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpckpt.api.options import Selection
from hpckpt.api.reports import InspectReport
from hpckpt.converters import open_index
from hpckpt.core.errors import HpckptError
from hpckpt.core.geometry.layout import inferred_layouts
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.json_values import jsonable

_RANK = re.compile(r"_rank(\d+)[_.]|^__(\d+)_\d+\.distcp$")


def rank_of(file: str) -> int | None:
    """The rank a data file's name says wrote it (`_rank3_.safetensors`, `__3_0.distcp`)."""
    match = _RANK.search(os.path.basename(file))
    if not match:
        return None
    return int(match.group(1) or match.group(2))


def _file_sizes(index: CheckpointIndex) -> tuple[dict, ...]:
    out = []
    for name in index.metadata_files + index.data_files:
        try:
            size = index.data_path(name).stat().st_size
        except (OSError, ValueError):  # missing, or no possible file name (a NUL byte): verify says which
            size = None
        out.append({"path": name, "bytes": size})
    return tuple(out)


def _value(index: CheckpointIndex, fqn: str, decode: bool) -> dict:
    value = index.values[fqn]
    item: dict[str, Any] = {"fqn": fqn, "file": value.file, "offset": value.offset, "length": value.length}
    if decode:
        try:
            decoded = index.decode_value(fqn)
            item.update(type=type(decoded).__name__, value=jsonable(decoded))
        except HpckptError as exc:
            item.update(type=None, error=exc.message)
    return item


def inspect(path: str | Path, select: Selection = Selection(), shards: Iterable[str] = (),
            decode_values: bool = True, use_cache: bool = True) -> InspectReport:
    """Describe a checkpoint: format, world size, files, tensors (with their inferred layout)
    and values. `shards` globs select tensors whose chunk boxes are listed per rank and file.
    Large HyperParallel indexes are cached after the first run (see converters.index_cache)."""
    index = open_index(path, use_cache=use_cache)
    layouts = inferred_layouts(index)
    names = select.names(index.tensors)
    tensors = tuple(
        {"fqn": fqn, "dtype": e.dtype.name, "dtype_as_written": e.dtype_spelling, "shape": list(e.shape),
         "layout": layouts[fqn], "chunks": e.n_chunks, "bytes": e.nbytes}
        for fqn in names for e in [index.tensors[fqn]])
    shard_globs = Selection.of(shards)
    listed = None
    if not shard_globs.everything:
        listed = tuple(
            {"fqn": fqn, "chunks": [{"offsets": list(c.box.offsets), "sizes": list(c.box.sizes), "file": c.file,
                                     "key": c.key, "rank": rank_of(c.file)} for c in index.tensors[fqn].chunks]}
            for fqn in shard_globs.names(names))
    return InspectReport(
        path=str(path), format=index.format, format_version=index.format_version, framework=index.framework,
        world_size=index.world_size, world_size_exact=index.world_size_exact, files=_file_sizes(index),
        counts={"tensors": len(index.tensors), "values": len(index.values),
                "chunks": sum(t.n_chunks for t in index.tensors.values()),
                "tensor_bytes": sum(t.nbytes for t in index.tensors.values())},
        tensors=tensors, values=tuple(_value(index, fqn, decode_values) for fqn in select.names(index.values)),
        shards=listed, notes=(*index.warnings, *index.notes), based_on=tuple(index.baselines))
