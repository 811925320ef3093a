"""What a shard map shows, from a checkpoint's metadata alone: every tensor's stored boxes with
the rank that holds each, the gaps and overlaps among them, and the bytes each rank stores. The
boxes travel as columns of numbers (offsets, sizes, ranks), not an object per chunk, so a page of
a thousand ranks' checkpoint stays small (`cli.html` compresses them)."""

from __future__ import annotations

import numpy as np

from hpckpt.api.inspect import rank_of
from hpckpt.core.geometry.layout import inferred_layouts
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.safety.validate import coverage


def shard_map(index: CheckpointIndex, names: list[str]) -> dict:
    """The shard map of the tensors `names`: per tensor `[name, dtype, shape, layout, bytes,
    first chunk, chunks]` (its chunks' rows in the columns), the columns `offsets` and `sizes`
    (float64, ndim values per chunk, tensors one after another) and `ranks` (int32, -1 where a
    file names no rank), the `problems` (name -> `gaps`, `overlaps`: regions as `[0:2, 4:8]`;
    `notes`: what could not be located) and the bytes per rank (`rank_bytes`, index = rank)."""
    layouts = inferred_layouts(index)
    rows, offsets, sizes, ranks = [], [], [], []
    problems: dict[str, dict[str, list[str]]] = {}
    per_rank: dict[int, int] = {}
    first = 0
    for name in names:
        entry = index.tensors[name]
        if entry.n_chunks:
            o, s = entry.chunk_arrays()
            r = np.array([-1 if (k := rank_of(f)) is None else k for f in entry.chunk_files()], np.int32)
            offsets.append(o.astype(np.float64).reshape(-1))
            sizes.append(s.astype(np.float64).reshape(-1))
            ranks.append(r)
            volumes = np.prod(s, axis=1) if s.shape[1] else np.ones(len(s), np.int64)
            for rank, nbytes in zip(r.tolist(), (volumes * entry.dtype.itemsize).tolist()):
                per_rank[rank] = per_rank.get(rank, 0) + int(nbytes)
        for finding in coverage(entry):  # regions as `[0:2, 4:8]`; a finding without regions as its text
            kind = "gaps" if "no chunk covers" in finding.message else "overlaps" if "overlap" in finding.message \
                else "notes"
            problems.setdefault(name, {}).setdefault(kind, []).extend(finding.boxes or [finding.message])
        rows.append([name, entry.dtype.name, list(entry.shape), layouts[name], entry.nbytes, first, entry.n_chunks])
        first += entry.n_chunks
    world = max(per_rank, default=-1) + 1
    return {
        "tensors": rows,
        "offsets": np.concatenate(offsets) if offsets else np.zeros(0),
        "sizes": np.concatenate(sizes) if sizes else np.zeros(0),
        "ranks": np.concatenate(ranks) if ranks else np.zeros(0, np.int32),
        "problems": problems,
        "rank_bytes": [per_rank.get(r, 0) for r in range(world)],
        "unranked_bytes": per_rank.get(-1, 0),
    }


def planned_map(plan: Plan) -> dict:
    """The shard map of a plan's target (what `shard_map` gives of a checkpoint): every planned
    box with the rank that will store it. A plan tiles each tensor, so it has no problems."""
    rows, offsets, sizes, ranks = [], [], [], []
    per_rank: dict[int, int] = {}
    first = 0
    for tensor in plan.tensors:
        n, ndim = len(tensor.boxes), len(tensor.shape)
        if n:
            offsets.append(np.array([b.box.offsets for b in tensor.boxes], np.float64).reshape(-1))
            sizes.append(np.array([b.box.sizes for b in tensor.boxes], np.float64).reshape(-1))
            ranks.append(np.array([b.rank for b in tensor.boxes], np.int32))
            for b in tensor.boxes:
                per_rank[b.rank] = per_rank.get(b.rank, 0) + tensor.box_nbytes(b)
        nbytes = int(np.prod(tensor.shape, dtype=np.int64)) * tensor.dtype.itemsize if ndim else tensor.dtype.itemsize
        rows.append([tensor.fqn, tensor.dtype.name, list(tensor.shape), "", nbytes, first, n])
        first += n
    return {
        "tensors": rows,
        "offsets": np.concatenate(offsets) if offsets else np.zeros(0),
        "sizes": np.concatenate(sizes) if sizes else np.zeros(0),
        "ranks": np.concatenate(ranks) if ranks else np.zeros(0, np.int32),
        "problems": {},
        "rank_bytes": [per_rank.get(r, 0) for r in range(plan.world_size)],
        "unranked_bytes": 0,
    }
