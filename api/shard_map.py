"""What a shard map shows, from a checkpoint's metadata alone: every tensor's stored boxes with
the rank that holds each, the gaps and overlaps among them, and the bytes each rank stores. The
boxes travel as columns of numbers (offsets, sizes, ranks), not an object per chunk, so a page of
a thousand ranks' checkpoint stays small (`cli.html` compresses them)."""

from __future__ import annotations

import numpy as np

from hpckpt.api.inspect import chunk_ranks
from hpckpt.core.geometry.layout import inferred_layouts
from hpckpt.core.geometry.overlap import volumes
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.safety.validate import coverage


def shard_map(index: CheckpointIndex, names: list[str]) -> dict:
    """The shard map of the tensors `names`: per tensor `[name, dtype, shape, layout, bytes,
    first chunk, chunks]` (its chunks' rows in the columns), the columns `offsets` and `sizes`
    (float64, ndim values per chunk, tensors one after another) and `ranks` (int32, -1 where a
    file names no rank), the `problems` (name -> `core.safety.validate.coverage`: gaps, overlaps,
    notes) and the bytes per rank (`rank_bytes`, index = rank)."""
    layouts = inferred_layouts(index)
    columns = _Columns()
    problems: dict[str, dict[str, list[str]]] = {}
    for name in names:
        entry = index.tensors[name]
        if entry.n_chunks:
            offsets, sizes = entry.chunk_arrays()
            columns.add(offsets, sizes, chunk_ranks(entry), entry.dtype.itemsize)
        found = coverage(entry)
        if found:
            problems[name] = found
        columns.row(name, entry.dtype.name, entry.shape, layouts[name], entry.nbytes, entry.n_chunks)
    return columns.document(problems)


def planned_map(plan: Plan) -> dict:
    """The shard map of a plan's target (what `shard_map` gives of a checkpoint): every planned
    box with the rank that will store it. A plan tiles each tensor, so it has no problems."""
    columns = _Columns(plan.world_size)
    for tensor in plan.tensors:
        boxes = tensor.columns
        if len(boxes):
            columns.add(boxes.offsets, boxes.sizes, boxes.ranks.astype(np.int32), tensor.dtype.itemsize)
        nbytes = int(np.prod(tensor.shape, dtype=np.int64)) * tensor.dtype.itemsize
        columns.row(tensor.fqn, tensor.dtype.name, tensor.shape, "", nbytes, len(boxes))
    return columns.document({})


class _Columns:
    """The columns a shard map is made of, filled tensor by tensor, and the bytes of each rank."""

    def __init__(self, world_size: int = 0):
        self.rows: list[list] = []
        self.offsets: list[np.ndarray] = []
        self.sizes: list[np.ndarray] = []
        self.ranks: list[np.ndarray] = []
        self.rank_bytes = np.zeros(world_size + 1, np.int64)  # index 0: chunks of no rank (-1)
        self.first = 0

    def add(self, offsets: np.ndarray, sizes: np.ndarray, ranks: np.ndarray, itemsize: int) -> None:
        """One tensor's chunks: `[n, ndim]` offsets and sizes, their ranks."""
        self.offsets.append(offsets.astype(np.float64).reshape(-1))
        self.sizes.append(sizes.astype(np.float64).reshape(-1))
        self.ranks.append(ranks)
        counted = np.bincount(ranks.astype(np.int64) + 1, weights=volumes(sizes) * itemsize)
        if len(counted) > len(self.rank_bytes):
            self.rank_bytes = np.pad(self.rank_bytes, (0, len(counted) - len(self.rank_bytes)))
        self.rank_bytes[:len(counted)] += counted.astype(np.int64)

    def row(self, name: str, dtype: str, shape, layout: str, nbytes: int, chunks: int) -> None:
        self.rows.append([name, dtype, list(shape), layout, nbytes, self.first, chunks])
        self.first += chunks

    def document(self, problems: dict) -> dict:
        def joined(parts: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        return {"tensors": self.rows, "offsets": joined(self.offsets, np.float64),
                "sizes": joined(self.sizes, np.float64), "ranks": joined(self.ranks, np.int32),
                "problems": problems, "rank_bytes": self.rank_bytes[1:].tolist(),
                "unranked_bytes": int(self.rank_bytes[0])}
