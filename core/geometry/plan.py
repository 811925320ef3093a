"""The plan: which box of which tensor each target rank stores, in a form no format owns.

A plan is frozen plain data (boxes, ranks, dtypes, names), the same on every machine for the same
inputs: that is what lets `reshard --rank` fan one job out over many machines and still produce
byte-identical output, and what lets every writer (HyperParallel, PyTorch DCP, safetensors, ...)
lay out the same plan in its own files. It holds no file name, no metadata class, no pickle.

Planning a tensor: its target layout is validated once; every rank's boxes come at once from
`core.geometry.rank_boxes`; a box held by one rank is stored by it, a replicated box (several holders)
by the least-loaded holder, largest boxes first, as HyperParallel's own de-dup does; each
tensor's boxes are then listed rank-major (the order HyperParallel's metadata uses, `index` =
position), as arrays (`BoxColumns`): a box becomes an object only when a writer asks for it. The
cost grows with tensors + target boxes, not with tensors x ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from hpckpt.core.dtypes import DType
from hpckpt.core.geometry.assign import least_loaded
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import Mesh, Replicate, TensorLayout
from hpckpt.core.geometry.overlap import boxes_to_arrays, volumes
from hpckpt.core.geometry.rank_boxes import RankBoxes, rank_boxes
from hpckpt.core.index import CheckpointIndex, TensorEntry
from hpckpt.core.io.cast import CASTABLE


class TargetLayouts(Protocol):
    """What the planner needs of a target: each tensor's layout (`core.geometry.layout.LayoutSpec`)."""

    def resolve(self, fqn: str, shape: tuple[int, ...]): ...


@dataclass(frozen=True, slots=True)
class PlannedBox:
    """One stored box: its region (global coordinates), the rank that stores it and its position
    in the tensor's chunk list."""

    box: Box
    rank: int
    index: int


@dataclass(frozen=True, slots=True)
class PlannedValue:
    """A non-tensor value carried over, stored by `rank`."""

    fqn: str
    rank: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class BoxColumns:
    """A tensor's stored boxes as arrays, in listing order: `offsets`, `sizes` (int64 [n, ndim]),
    the storing `ranks` and each box's position in the tensor's chunk list, `index` (int64 [n];
    None: the listing order, as for a whole plan)."""

    offsets: np.ndarray
    sizes: np.ndarray
    ranks: np.ndarray
    index: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ranks)

    def positions(self) -> np.ndarray:
        return np.arange(len(self.ranks), dtype=np.int64) if self.index is None else self.index

    def volumes(self) -> np.ndarray:
        """Elements in each box."""
        return volumes(self.sizes)

    @staticmethod
    def of(boxes: tuple[PlannedBox, ...], ndim: int) -> BoxColumns:
        index = np.array([b.index for b in boxes], np.int64)
        return BoxColumns(*boxes_to_arrays([b.box for b in boxes], ndim), np.array([b.rank for b in boxes], np.int64),
                          None if np.array_equal(index, np.arange(len(boxes))) else index)


class PlannedTensor:
    """A tensor of the target: dtype as written (`source_dtype` when read: the engine casts where
    they differ) and its stored boxes, rank-major.

    The boxes exist in two forms, each made from the other when first asked for: `boxes`, one
    `PlannedBox` per box (what the writers and the engine walk), and `columns` (arrays: what
    the figures of a plan onto thousands of ranks are computed from, with no object per box).
    The planner gives the columns, so a dry run never builds a box object.
    """

    __slots__ = ("fqn", "shape", "dtype", "source_dtype", "_boxes", "_columns")

    def __init__(self, fqn: str, shape: tuple[int, ...], dtype: DType, source_dtype: DType,
                 boxes: tuple[PlannedBox, ...] | None = None, *, columns: BoxColumns | None = None):
        if (boxes is None) == (columns is None):
            raise TypeError("give the boxes or their columns")
        self.fqn, self.shape, self.dtype, self.source_dtype = fqn, shape, dtype, source_dtype
        self._boxes, self._columns = (None if boxes is None else tuple(boxes)), columns

    @property
    def boxes(self) -> tuple[PlannedBox, ...]:
        if self._boxes is None:  # (two threads may both build it: equal tuples, either is kept)
            c = self._columns
            self._boxes = tuple(PlannedBox(Box(tuple(o), tuple(s)), r, i) for o, s, r, i in zip(
                c.offsets.tolist(), c.sizes.tolist(), c.ranks.tolist(), c.positions().tolist()))
        return self._boxes

    @property
    def columns(self) -> BoxColumns:
        if self._columns is None:
            self._columns = BoxColumns.of(self._boxes, len(self.shape))
        return self._columns

    def box_nbytes(self, planned: PlannedBox) -> int:
        return planned.box.volume * self.dtype.itemsize

    def _key(self) -> tuple:
        return self.fqn, self.shape, self.dtype, self.source_dtype, self.boxes

    def __eq__(self, other: object) -> bool:
        return other._key() == self._key() if isinstance(other, PlannedTensor) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        count = len(self._columns if self._boxes is None else self._boxes)
        return (f"PlannedTensor(fqn={self.fqn!r}, shape={self.shape!r}, dtype={self.dtype!r}, "
                f"source_dtype={self.source_dtype!r}, boxes={count})")

    def __getstate__(self) -> tuple:
        return self.fqn, self.shape, self.dtype, self.source_dtype, self._boxes, self._columns

    def __setstate__(self, state: tuple) -> None:
        self.fqn, self.shape, self.dtype, self.source_dtype, self._boxes, self._columns = state


@dataclass(frozen=True)
class Plan:
    """Every tensor box and value of a target checkpoint of `world_size` ranks.

    `producing` are the ranks whose files this run writes (all of them, unless fanned out); the
    plan always describes every rank, since the metadata does. `nesting` maps a flat name to its
    key path in the nested state dict, where the source knew it.
    """

    world_size: int
    tensors: tuple[PlannedTensor, ...]
    values: tuple[PlannedValue, ...]
    producing: tuple[int, ...]
    nesting: Mapping[str, tuple] = field(default_factory=dict)

    @cached_property
    def by_rank(self) -> dict[int, list[tuple[PlannedTensor, PlannedBox]]]:
        """Each rank's stored boxes in the order its file lists them: tensor order, then offsets."""
        out: dict[int, list[tuple[PlannedTensor, PlannedBox]]] = {}
        for tensor in self.tensors:
            for planned in tensor.boxes:
                out.setdefault(planned.rank, []).append((tensor, planned))
        return {rank: out[rank] for rank in sorted(out)}

    @cached_property
    def storing_ranks(self) -> tuple[int, ...]:
        """The ranks that store a box, in order (`by_rank`'s keys, without building a box)."""
        ranks = [t.columns.ranks for t in self.tensors if len(t.columns)]
        return tuple(np.unique(np.concatenate(ranks)).tolist()) if ranks else ()

    def values_of(self, rank: int) -> list[PlannedValue]:
        return [v for v in self.values if v.rank == rank]

    def nbytes(self, rank: int | None = None) -> int:
        """Bytes of tensor data stored by `rank` (all ranks when None)."""
        total = 0
        for t in self.tensors:
            volumes = t.columns.volumes()
            mine = volumes if rank is None else volumes[t.columns.ranks == rank]
            total += int(mine.sum()) * t.dtype.itemsize
        return total


def out_dtype(source: DType, cast_to: DType | None) -> DType:
    """The dtype a tensor is written in: `cast_to` for floating tensors, else its own."""
    return cast_to if cast_to is not None and source.name in CASTABLE else source


def _owners(boxes: list[RankBoxes], itemsizes: list[int], world_size: int) -> list[np.ndarray]:
    """The storing rank of every box: its holder when it has one, else `least_loaded`'s choice,
    largest boxes first (ties: tensor order, then first appearance)."""
    load = np.zeros(world_size, np.int64)
    owners: list[np.ndarray] = []
    shared: list[tuple[int, int, int]] = []
    for t, (grid, itemsize) in enumerate(zip(boxes, itemsizes)):
        nbytes = volumes(grid.sizes) * itemsize
        single = grid.counts == 1
        owner = np.where(single, grid.ranks[grid.starts] if len(grid) else 0, -1)
        np.add.at(load, owner[single], nbytes[single])
        owners.append(owner)
        shared += [(-int(nbytes[i]), t, i) for i in np.flatnonzero(~single).tolist()]
    shared.sort()
    chosen = least_loaded(load.tolist(), ((boxes[t].holders(i), -neg_bytes) for neg_bytes, t, i in shared))
    for (_, t, i), best in zip(shared, chosen):
        owners[t][i] = best
    return owners


def _every_holder(grid: RankBoxes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(offsets, sizes, ranks)` with each box once per rank holding it (replicas stored by each)."""
    total = int(grid.counts.sum())
    box = np.repeat(np.arange(len(grid)), grid.counts)
    within = np.arange(total) - np.repeat(np.cumsum(grid.counts) - grid.counts, grid.counts)
    return grid.offsets[box], grid.sizes[box], grid.ranks[np.repeat(grid.starts, grid.counts) + within]


def _listed_rank_major(offsets: np.ndarray, sizes: np.ndarray, owner: np.ndarray) -> BoxColumns:
    ndim = offsets.shape[1]
    order = np.lexsort(tuple(offsets[:, d] for d in reversed(range(ndim))) + (owner,))
    columns = BoxColumns(offsets[order], sizes[order], owner[order].astype(np.int64))
    for array in (columns.offsets, columns.sizes, columns.ranks):
        array.flags.writeable = False  # (a plan is frozen data)
    return columns


def _rank_boxes_once(layout: TensorLayout, shape: tuple[int, ...], known: dict) -> RankBoxes:
    """`rank_boxes`, once per (layout, shape): a model's layers repeat them (the arrays are
    only read afterwards, so tensors may share them)."""
    key = (layout, tuple(shape))
    try:
        found = known.get(key)
    except TypeError:  # a layout that cannot be hashed (a list in a placement): computed each time
        return rank_boxes(layout, shape)
    if found is None:
        found = known[key] = rank_boxes(layout, shape)
    return found


def make_plan(index: CheckpointIndex, layouts: TargetLayouts, world_size: int, *,
              names: Iterable[str] | None = None, ranks: Iterable[int] | None = None,
              cast_to: DType | None = None, casts: Mapping[str, DType] | None = None,
              every_replica: bool = False) -> Plan:
    """Plan `index` onto `world_size` target ranks laid out by `layouts`.

    `names` restricts the tensors and values carried over (default: all, in the index's order);
    `ranks` restricts the ranks this run writes (fan-out). `cast_to` casts floating tensors,
    `casts` (fqn -> dtype) single ones, over `cast_to`. `every_replica` stores a replicated box
    on every rank holding it instead of once (MindFormers without remove-redundancy).

    Raises:
        GeometryError: a target layout does not fit its tensor.
    """
    wanted = None if names is None else set(names)
    entries: list[TensorEntry] = [e for fqn, e in index.tensors.items() if wanted is None or fqn in wanted]
    known: dict = {}
    grids = [_rank_boxes_once(layouts.resolve(e.fqn, e.shape), e.shape, known) for e in entries]
    if every_replica:
        stored = [_every_holder(grid) for grid in grids]
    else:
        owners = _owners(grids, [e.dtype.itemsize for e in entries], world_size)
        stored = [(grid.offsets, grid.sizes, owner) for grid, owner in zip(grids, owners)]
    casts = casts or {}
    tensors = tuple(
        PlannedTensor(e.fqn, tuple(e.shape), out_dtype(e.dtype, casts.get(e.fqn, cast_to)), e.dtype,
                      columns=_listed_rank_major(*boxes))
        for e, boxes in zip(entries, stored))
    values = tuple(PlannedValue(fqn) for fqn in index.values if wanted is None or fqn in wanted)
    kept = {t.fqn for t in tensors} | {v.fqn for v in values}
    nesting = {fqn: path for fqn, path in (index.planner_data or {}).items() if fqn in kept}
    producing = tuple(range(world_size)) if ranks is None else tuple(sorted(set(ranks)))
    return Plan(world_size, tensors, values, producing, nesting)


class _Whole:
    """Every tensor whole on one rank: what consolidation writes."""

    def resolve(self, fqn: str, shape: tuple[int, ...]) -> TensorLayout:
        return TensorLayout(Mesh((1,)), (Replicate(),))


def whole_tensor_plan(index: CheckpointIndex, *, names: Iterable[str] | None = None,
                      cast_to: DType | None = None, casts: Mapping[str, DType] | None = None) -> Plan:
    """One rank holding every selected tensor whole, in the index's order."""
    return make_plan(index, _Whole(), 1, names=names, cast_to=cast_to, casts=casts)


def plan_as_given(tensors: Mapping[str, tuple[DType, tuple[int, ...], list[tuple[int, Box]]]], world_size: int, *,
                  values: Iterable[PlannedValue] = (), nesting: Mapping[str, tuple] | None = None,
                  producing: Iterable[int] | None = None) -> Plan:
    """A plan whose boxes are placed by the caller: `tensors[fqn] = (dtype, shape, [(rank, box)])`,
    as a running job holds them (each rank's own shards) or a test lays them out.

    Each rank's boxes keep the order given, empty ones included, as HyperParallel records them,
    except an empty box that starts where a non-empty one does (it would share its metadata key).
    """
    planned = []
    for fqn, (dtype, shape, placed) in tensors.items():
        starts = {box.offsets for _rank, box in placed if not box.is_empty}
        kept = [(rank, box) for rank, box in placed if not (box.is_empty and box.offsets in starts)]
        by_rank = sorted(range(len(kept)), key=lambda i: kept[i][0])  # stable: the given order within a rank
        boxes = tuple(PlannedBox(kept[i][1], kept[i][0], n) for n, i in enumerate(by_rank))
        planned.append(PlannedTensor(fqn, tuple(shape), dtype, dtype, boxes))
    ranks = tuple(range(world_size)) if producing is None else tuple(sorted(set(producing)))
    return Plan(world_size, tuple(planned), tuple(values), ranks, dict(nesting or {}))
