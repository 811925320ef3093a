"""Every rank's boxes of one tensor at once, as arrays, with the ranks that hold each box.

A plan onto thousands of ranks needs, per tensor, the boxes of every rank. Asking the layout rank
by rank costs a Python call per (tensor, rank) pair: 4 million for 1,000 tensors on 4,096 ranks.
Here the split rules run on numpy arrays over all mesh positions at once, identical boxes
(replicas, and the empty parts an uneven split leaves) are merged, and each distinct box comes
with its holders. RaggedShard layouts, which are rare and small, are asked rank by rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.layout import RaggedShard, Shard, TensorLayout


@dataclass(frozen=True)
class RankBoxes:
    """The distinct boxes of a tensor, in order of first appearance (by rank, then by position
    in that rank's list), and the ranks that hold each: box `i`'s holders are
    `ranks[starts[i]:starts[i] + counts[i]]`, ascending."""

    offsets: np.ndarray  # [n, ndim] int64
    sizes: np.ndarray  # [n, ndim] int64
    ranks: np.ndarray
    starts: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def holders(self, i: int) -> np.ndarray:
        return self.ranks[self.starts[i]:self.starts[i] + self.counts[i]]


def _split(length: np.ndarray, parts: int, index: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """`core.geometry.layout.split` over arrays: (start, size) of part `index` of `length`."""
    if rule == "balanced":
        q, r = np.divmod(length, parts)
        return index * q + np.minimum(index, r), q + (index < r)
    chunk = -(-length // parts)
    start = np.minimum(index * chunk, length)
    return start, np.minimum(start + chunk, length) - start


def grid(layout: TensorLayout, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, offsets, sizes) of every mesh position of a Shard/Replicate layout, in mesh order:
    one box each (what `TensorLayout.boxes` gives rank by rank)."""
    mesh = layout.mesh
    position = np.arange(mesh.size, dtype=np.int64)
    coords, stride = [], mesh.size
    for n in mesh.shape:
        stride //= n
        coords.append((position // stride) % n)
    starts = np.zeros((mesh.size, len(shape)), np.int64)
    sizes = np.tile(np.array(shape, np.int64), (mesh.size, 1))
    for k in layout.order or range(mesh.ndim):
        p = layout.placements[k]
        if isinstance(p, Shard):
            offset, sizes[:, p.dim] = _split(sizes[:, p.dim], mesh.shape[k], coords[k], p.rule)
            starts[:, p.dim] += offset
    return np.array(mesh.ranks, np.int64), starts, sizes


def _listed(layout: TensorLayout, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, offsets, sizes, position in the rank's list) asked rank by rank (RaggedShard)."""
    ranks, offsets, sizes, slots = [], [], [], []
    for rank, boxes in layout.all_boxes(shape).items():
        for slot, box in enumerate(boxes):
            ranks.append(rank)
            offsets.append(box.offsets)
            sizes.append(box.sizes)
            slots.append(slot)
    ndim = len(shape)
    as_rows = lambda rows: np.array(rows, np.int64).reshape(len(rows), ndim)  # noqa: E731
    return np.array(ranks, np.int64), as_rows(offsets), as_rows(sizes), np.array(slots, np.int64)


def rank_boxes(layout: TensorLayout, shape: tuple[int, ...]) -> RankBoxes:
    """The distinct boxes every rank of `layout` holds of a tensor of global `shape`.

    Of the boxes that start at the same offsets (only empty ones do), one is kept: they would share
    a metadata key (fqn + offsets); see `_one_per_start`.

    Raises:
        GeometryError: the layout cannot apply to `shape`, or gives a box outside the tensor.
    """
    shape = tuple(int(s) for s in shape)
    layout.validate(shape)
    if not shape:
        ranks = np.sort(np.array(layout.mesh.ranks, np.int64))
        return RankBoxes(np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64), ranks,
                         np.zeros(1, np.int64), np.array([len(ranks)], np.int64))
    if any(isinstance(p, RaggedShard) for p in layout.placements):
        ranks, offsets, sizes, slots = _listed(layout, shape)
    else:
        ranks, offsets, sizes = grid(layout, shape)
        slots = np.zeros(len(ranks), np.int64)
    ndim = len(shape)
    if len(ranks) == 0:
        empty = np.zeros(0, np.int64)
        return RankBoxes(offsets, sizes, empty, empty, empty)
    outside = np.any((offsets < 0) | (sizes < 0) | (offsets + sizes > np.array(shape)), axis=1)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise GeometryError(f"target box {offsets[i].tolist()}+{sizes[i].tolist()} of rank {int(ranks[i])} "
                            f"lies outside {list(shape)}")
    appearance = np.lexsort((slots, ranks))  # rank order, then the order within a rank's list
    rows, ranks = np.concatenate([offsets, sizes], axis=1)[appearance], ranks[appearance]
    as_bytes = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel()
    _, first, inverse, counts = np.unique(as_bytes, return_index=True, return_inverse=True, return_counts=True)
    order = np.argsort(first, kind="stable")  # the distinct boxes in order of first appearance
    rank_of = np.empty(len(order), np.int64)
    rank_of[order] = np.arange(len(order))  # unique id -> its place in that order
    grouped = ranks[np.argsort(rank_of[inverse], kind="stable")]  # holders, box by box, ascending
    counts = counts[order]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    rows = rows[first[order]]
    keep = _one_per_start(rows[:, :ndim], rows[:, ndim:])
    if keep is not None:
        rows, starts, counts = rows[keep], starts[keep], counts[keep]
    return RankBoxes(rows[:, :ndim], rows[:, ndim:], grouped, starts, counts)


def _one_per_start(offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
    """The boxes to record when several start at the same offsets (None: all of them).

    HyperParallel keys a stored chunk by its tensor and offsets, so two chunks of a tensor may not
    start at the same place. Only empty boxes ever do (the parts an uneven split leaves): such a
    box holds nothing, so the non-empty box at that start is kept, else the first empty one."""
    empty = np.any(sizes == 0, axis=1)
    if not empty.any():
        return None
    n = len(offsets)
    order = np.lexsort((np.arange(n), empty) + tuple(offsets[:, d] for d in reversed(range(offsets.shape[1]))))
    ordered = offsets[order]
    first = np.ones(n, bool)
    first[1:] = np.any(ordered[1:] != ordered[:-1], axis=1)
    return np.sort(order[first])
