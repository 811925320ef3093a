"""`inspect`: what a checkpoint holds, from its metadata alone (data files are only stat'ed)."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.api.options import Selection
from hpckpt.api.reports import InspectReport
from hpckpt.converters import hpckpt_json, open_index
from hpckpt.core.errors import HpckptError
from hpckpt.core.geometry.layout import inferred_layouts
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.json_values import jsonable

_RANK = re.compile(r"_rank(\d+)[_.]|^__(\d+)_\d+\.distcp$|(?:^|-)(?:model|opt)-(\d{7})-\d{7}\.safetensors$")


@functools.lru_cache(maxsize=65536)
def rank_of(file: str) -> int | None:
    """The rank a data file's name says wrote it (`_rank3_.safetensors`, `__3_0.distcp`,
    MindFormers' `model-0000003-0000008.safetensors`)."""
    match = _RANK.search(os.path.basename(file))
    if not match:
        return None
    return int(next(g for g in match.groups() if g is not None))


def chunk_ranks(entry) -> np.ndarray:
    """The rank holding each stored chunk of a tensor, in chunk order (-1: its file names none)."""
    return np.array([-1 if (r := rank_of(f)) is None else r for f in entry.chunk_files()], np.int32)


def _file_sizes(index: CheckpointIndex) -> tuple[dict, ...]:
    out = []
    metadata = set(index.metadata_files)
    for name in index.metadata_files + index.data_files:
        try:
            size = index.data_path(name).stat().st_size
        except (OSError, ValueError):  # missing, or no possible file name (a NUL byte): verify says which
            size = None
        out.append({"path": name, "bytes": size, "kind": "metadata" if name in metadata else "data"})
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


def _summary(index: CheckpointIndex, names: list[str], layouts: dict[str, str], files: tuple[dict, ...]) -> dict:
    """The selected tensors counted by dtype and by layout, and the ranks grouped by what each
    stores (data files and their bytes on disk): a few lines whatever the checkpoint's size, and
    nothing read but the listing (`files`: `_file_sizes`)."""
    by_dtype: dict[str, list[int]] = {}
    by_layout: dict[str, list[int]] = {}
    for fqn in names:
        entry = index.tensors[fqn]
        for table, key in ((by_dtype, entry.dtype.name), (by_layout, layouts[fqn])):
            row = table.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += entry.nbytes
    per_rank: dict[int | None, list[int]] = {}  # rank -> [files, bytes]
    for f in files:
        if f["kind"] == "data":
            row = per_rank.setdefault(rank_of(f["path"]), [0, 0])
            row[0] += 1
            row[1] += f["bytes"] or 0
    groups: dict[tuple[int, int], list[int | None]] = {}
    for rank in sorted(per_rank, key=lambda r: -1 if r is None else r):
        groups.setdefault(tuple(per_rank[rank]), []).append(rank)
    return {
        "dtypes": [{"dtype": k, "tensors": n, "bytes": b} for k, (n, b) in sorted(by_dtype.items(), key=lambda i: -i[1][1])],
        "layouts": [{"layout": k, "tensors": n, "bytes": b} for k, (n, b) in sorted(by_layout.items(), key=lambda i: -i[1][1])],
        "rank_groups": [{"ranks": _ranges(ranks), "count": len(ranks), "files": f, "bytes": b}
                        for (f, b), ranks in groups.items()],
    }


def _ranges(ranks: list[int | None]) -> str:
    """`[0, 1, 2, 5]` as `0-2,5`; None (files that name no rank) as `-`."""
    if ranks == [None]:
        return "-"
    out, numbers = [], [r for r in ranks if r is not None]
    start = prev = numbers[0]
    for r in [*numbers[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def inspect(path: str | Path, select: Selection = Selection(), shards: Iterable[str] = (),
            decode_values: bool = True, use_cache: bool = True, summary_only: bool = False,
            index: CheckpointIndex | None = None) -> InspectReport:
    """Describe a checkpoint: format, world size, files, tensors (with their inferred layout)
    and values, and a summary (by dtype, by layout, ranks grouped by what they store). With
    `summary_only` the tensors and values are not listed one by one (nor values decoded).
    `shards` globs select tensors whose chunk boxes are listed per rank and file.
    Large HyperParallel indexes are cached after the first run (see converters.index_cache);
    `index` is the checkpoint's when the caller has opened it already."""
    index = index if index is not None else open_index(path, use_cache=use_cache)
    layouts = inferred_layouts(index)
    names = select.names(index.tensors)
    tensors = () if summary_only else tuple(
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
    files = _file_sizes(index)
    return InspectReport(
        path=str(path), format=index.format, format_version=index.format_version, framework=index.framework,
        world_size=index.world_size, world_size_exact=index.world_size_exact, files=files,
        counts={"tensors": len(index.tensors), "values": len(index.values),
                "chunks": sum(t.n_chunks for t in index.tensors.values()),
                "tensor_bytes": sum(t.nbytes for t in index.tensors.values())},
        tensors=tensors, values=() if summary_only else tuple(
            _value(index, fqn, decode_values) for fqn in select.names(index.values)),
        shards=listed, notes=(*index.warnings, *index.notes), based_on=tuple(index.baselines),
        summary=_summary(index, names, layouts, files), written_by=hpckpt_json.written_by(index))
