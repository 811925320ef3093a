"""The global plan of a save whose tensors are described by layouts, worked out per tensor.

`build_global_plan` takes every rank's boxes: at 16,384 ranks x 1,000 tensors that is 16 million
rows to sort, tens of seconds. When the ranks' tensors are DTensor-like (a mesh, one placement
per mesh dim, the rank's place on the mesh), the boxes of every rank follow from the layout,
and so do the replicas: this module builds the same `GlobalPlan`, array for array, from one
`(name, dtype, shape, TensorLayout)` row per tensor, with work per distinct (shape, layout) and
per stored box, never a sort of the job's boxes:

- the boxes of every mesh position are computed at once (numpy), and grouped into distinct
  boxes with their holders once per distinct (shape, layout): a model's layers share them;
- replica de-dup is `least_loaded`'s greedy exactly (largest first, to the least-loaded
  holder, ties to the lowest rank), taken a tensor at a time: one rank holds one box of a
  tensor, so the boxes of one tensor have disjoint holders and each can take its holder's
  least load at once, which is what the one-by-one greedy does;
- a stored box's position in its tensor's chunk list (rank-major) comes from a count over
  ranks, as a rank stores at most one box of a tensor.

RaggedShard layouts (several boxes per rank) are not for this path: their ranks send boxes.

`LayoutTable` is what a save's ranks agree on to take this path: every tensor's name, dtype,
shape and layout, the same on every rank (one digest each), sent once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hpckpt.core.dtypes import DType, dtype as parse_dtype
from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.global_plan import DEDUP_MODES, GlobalPlan, check_cover, members, one_per_start
from hpckpt.core.geometry.layout import RaggedShard, TensorLayout
from hpckpt.core.geometry.plan import PlannedValue
from hpckpt.core.geometry.rank_boxes import grid


class LayoutTable:
    """Every tensor of a save as `(name, dtype name, shape, TensorLayout)`, in the ranks' order,
    and the key paths that are not the name split at its dots. Its JSON (each mesh once; a mesh
    of thousands of ranks in the usual order is its shape alone) is what its digest is taken of:
    ranks compare digests, the table itself never travels."""

    __slots__ = ("rows", "nesting", "_json")

    def __init__(self, rows: Sequence[tuple[str, str, tuple[int, ...], TensorLayout]],
                 nesting: dict[str, tuple] | None = None):
        self.rows = list(rows)
        self.nesting = dict(nesting or {})
        self._json: str | None = None

    def to_json(self) -> str:
        if self._json is None:
            meshes: dict[int, int] = {}
            listed, tensors = [], []
            for name, dt, shape, layout in self.rows:
                mesh = layout.mesh
                if id(mesh) not in meshes:
                    meshes[id(mesh)] = len(listed)
                    ranks = None if mesh.ranks == tuple(range(mesh.size)) else list(mesh.ranks)
                    listed.append([list(mesh.shape), ranks])
                order = None if layout.order is None else list(layout.order)
                tensors.append([name, dt, list(shape), meshes[id(mesh)], ",".join(map(str, layout.placements)), order])
            doc = {"meshes": listed, "tensors": tensors,
                   "nesting": {fqn: list(path) for fqn, path in self.nesting.items()}}
            self._json = json.dumps(doc, separators=(",", ":"))
        return self._json

    def digest(self) -> str:
        return hashlib.blake2b(self.to_json().encode(), digest_size=20).hexdigest()

    def plan(self, world_size: int, *, dedup: str, values: tuple[PlannedValue, ...], value_lengths: dict[str, int],
             nesting: dict[str, tuple], key: str) -> GlobalPlan:
        """`build_layout_plan` of this table; `nesting` adds the values' key paths."""
        return build_layout_plan([(n, parse_dtype(d), s, layout) for n, d, s, layout in self.rows], world_size,
                                 dedup=dedup, values=values, value_lengths=value_lengths,
                                 nesting={**self.nesting, **{k: v for k, v in nesting.items() if k not in self.nesting}},
                                 key=key)


@dataclass(frozen=True)
class DistinctBoxes:
    """The distinct boxes of one (shape, layout), in offset order, and who holds each.

    `holders` lists the global ranks holding each box, ascending, box after box (`starts`,
    `counts` delimit them)."""

    offsets: np.ndarray  # [boxes, ndim]
    sizes: np.ndarray
    volume: np.ndarray
    holders: np.ndarray
    starts: np.ndarray
    counts: np.ndarray


def mesh_boxes(layout: TensorLayout, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(ranks, offsets, sizes)`: the box each position of the layout's mesh holds, in mesh order.

    Raises:
        GeometryError: a RaggedShard layout (not one box per rank), or one that does not fit `shape`.
    """
    layout.validate(shape)
    if any(isinstance(p, RaggedShard) for p in layout.placements):
        raise GeometryError(f"{layout}: a ragged layout gives a rank several boxes; send them instead")
    return grid(layout, shape)


def distinct_boxes(layout: TensorLayout, shape: tuple[int, ...], name: str) -> DistinctBoxes:
    """Distinct boxes in (offsets, sizes) order with ascending holders; of boxes that start at one
    place (only empty ones can) the non-empty one, else the first, as `build_global_plan` keeps."""
    ranks, offsets, sizes = mesh_boxes(layout, shape)
    ndim = len(shape)
    rows = np.concatenate([offsets, sizes], axis=1)
    if ndim:
        distinct, inverse = np.unique(rows, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
    else:
        distinct, inverse = rows[:1], np.zeros(len(ranks), np.int64)
    order = np.lexsort((ranks, inverse))
    holders, counts = ranks[order], np.bincount(inverse, minlength=len(distinct))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    g_off, g_size = distinct[:, :ndim], distinct[:, ndim:]
    volume = np.prod(g_size, axis=1) if ndim else np.ones(len(distinct), np.int64)
    same_start = np.zeros(len(distinct), bool)
    same_start[1:] = np.all(g_off[1:] == g_off[:-1], axis=1)
    keep = one_per_start(same_start, volume)
    if keep is not None:
        g_off, g_size, volume, starts, counts = g_off[keep], g_size[keep], volume[keep], starts[keep], counts[keep]
    check_cover(np.zeros(len(g_off), np.int64), g_off, g_size, volume, np.array([ndim]), [shape], [name])
    return DistinctBoxes(g_off, g_size, volume, holders, starts, counts)


class HolderRun:
    """Boxes `which` of one tensor whose holders are disjoint (a rank holds one box of a tensor),
    each given at once to its least-loaded holder, the lowest rank of equals: the one-by-one
    greedy's choice. The holders are gathered once, so a run can be chosen again for other
    loads (the load's tensors that share a layout)."""

    def __init__(self, groups: DistinctBoxes, which: np.ndarray):
        counts = groups.counts[which]
        self.held = groups.holders[members(groups.starts[which], counts)]
        self.first = np.cumsum(counts) - counts

    def choose(self, load: np.ndarray) -> np.ndarray:
        loads = load[self.held]
        world = len(load)
        if int(loads.max()) < (1 << 62) // world:  # (load, rank) in one integer: one reduction
            return np.minimum.reduceat(loads * world + self.held, self.first) % world
        least = np.minimum.reduceat(loads, self.first)
        segment = np.repeat(np.arange(len(self.first)), np.diff(np.append(self.first, len(loads))))
        at = np.flatnonzero(loads == least[segment])
        keep = np.ones(len(at), bool)
        keep[1:] = segment[at][1:] != segment[at][:-1]
        return self.held[at[keep]]


def build_layout_plan(tensors: Sequence[tuple[str, DType, tuple[int, ...], TensorLayout]], world_size: int, *,
                      dedup: str = "balanced", values: tuple[PlannedValue, ...] = (),
                      value_lengths: dict[str, int] | None = None, nesting: dict[str, tuple] | None = None,
                      key: str = "") -> GlobalPlan:
    """The `GlobalPlan` that `build_global_plan` makes from the ranks' boxes of these layouts
    (every array equal), for a job of `world_size` ranks.

    Raises:
        GeometryError: a layout that does not fit its tensor, a ragged layout, or a mesh rank
            outside the job.
    """
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {', '.join(DEDUP_MODES)}, not {dedup!r}")
    names = [t[0] for t in tensors]
    dtypes = [t[1] for t in tensors]
    shapes = [tuple(int(s) for s in t[2]) for t in tensors]
    width = max((len(s) for s in shapes), default=0)
    patterns: dict[tuple, DistinctBoxes] = {}
    per_tensor: list[DistinctBoxes] = []
    for name, _dt, shape, layout in tensors:
        shape = tuple(int(s) for s in shape)
        mesh = layout.mesh
        found = (shape, layout.placements, layout.order, mesh.shape, id(mesh))
        groups = patterns.get(found)
        if groups is None:
            if max(mesh.ranks) >= world_size:
                raise GeometryError(f"{name}: layout {layout} places it on rank {max(mesh.ranks)} of a job of "
                                    f"{world_size}")
            groups = patterns[found] = distinct_boxes(layout, shape, name)
        per_tensor.append(groups)
    nbytes = [g.volume * dt.itemsize for g, dt in zip(per_tensor, dtypes)]
    owners = _owners(per_tensor, nbytes, dedup, world_size)
    return _assemble(names, dtypes, shapes, width, per_tensor, owners, world_size, values, value_lengths or {},
                     nesting or {}, key)


def _owners(per_tensor: list[DistinctBoxes], nbytes: list[np.ndarray], dedup: str, world_size: int) -> list[np.ndarray]:
    """Who stores each distinct box of each tensor (for "none": every holder, box after box)."""
    if dedup == "none":
        return [g.holders[members(g.starts, g.counts)].astype(np.int32) for g in per_tensor]
    owners = [g.holders[g.starts].astype(np.int32) for g in per_tensor]  # the lowest-ranked holder
    if dedup == "lowest-rank":
        return owners
    load = np.zeros(world_size, np.int64)
    shared_runs = []  # (-nbytes, tensor, first holder, boxes of the tensor of that size)
    for t, (g, size) in enumerate(zip(per_tensor, nbytes)):
        single = g.counts == 1
        np.add.at(load, owners[t][single], size[single])
        shared = np.flatnonzero(~single)
        if len(shared):
            # largest first, then tensor order, then the first holder: runs of one tensor and size
            order = shared[np.lexsort((g.holders[g.starts[shared]], -size[shared]))]
            cut = np.flatnonzero(np.diff(size[order])) + 1
            for run in np.split(order, cut):
                shared_runs.append((-int(size[run[0]]), t, int(g.holders[g.starts[run[0]]]), run))
    shared_runs.sort(key=lambda r: r[:3])
    for _neg, t, _first, run in shared_runs:
        chosen = HolderRun(per_tensor[t], run).choose(load)
        owners[t][run] = chosen
        load[chosen] += nbytes[t][run]  # (distinct holders: no two boxes add to one rank here)
    return owners


def _assemble(names, dtypes, shapes, width, per_tensor, owners, world_size, values, value_lengths, nesting,
              key) -> GlobalPlan:
    """The stored boxes in metadata order (tensor, then position: rank-major)."""
    n = sum(len(o) for o in owners)
    tid = np.empty(n, np.int32)  # (int32: a job's ranks and tensors fit; the plan of millions of boxes is half the size)
    owner = np.empty(n, np.int32)
    off = np.zeros((n, width), np.int64)
    size = np.zeros((n, width), np.int64)
    seen = np.zeros(world_size, bool)
    at = 0
    for t, (g, own) in enumerate(zip(per_tensor, owners)):
        box = np.arange(len(g.starts)) if len(own) == len(g.starts) else np.repeat(np.arange(len(g.starts)), g.counts)
        # a rank stores at most one box of a tensor, so ordering by owner is ordering by (owner, offsets)
        seen[own] = True
        rank_order = np.flatnonzero(seen)
        seen[own] = False
        position = np.empty(world_size, np.int64)
        position[rank_order] = np.arange(len(rank_order))
        slot = np.empty(len(own), np.int64)
        slot[position[own]] = np.arange(len(own))
        k, nd = len(own), len(shapes[t])
        tid[at:at + k] = t
        owner[at:at + k] = own[slot]
        off[at:at + k, :nd] = g.offsets[box[slot]]
        size[at:at + k, :nd] = g.sizes[box[slot]]
        at += k
    index = np.concatenate([np.arange(len(o), dtype=np.int32) for o in owners]) if owners else np.zeros(0, np.int32)
    return GlobalPlan(world_size, list(names), list(dtypes), list(shapes), tid, owner, index, off, size,
                      tuple(values), dict(value_lengths), dict(nesting), key)
