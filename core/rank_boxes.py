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

from hpckpt.core.box import Box, one_per_start
from hpckpt.core.errors import GeometryError
from hpckpt.core.layout import RaggedShard, Shard, TensorLayout


@dataclass(frozen=True)
class RankBoxes:
    """The distinct boxes of a tensor, in order of first appearance (by rank, then by position
    in that rank's list), and the ranks (ascending) that hold each."""

    offsets: np.ndarray  # [n, ndim] int64
    sizes: np.ndarray  # [n, ndim] int64
    holders: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.offsets)


def _split(length: np.ndarray, parts: int, index: np.ndarray, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """`core.layout.split` over arrays: (start, size) of part `index` of `length`."""
    if rule == "balanced":
        q, r = np.divmod(length, parts)
        return index * q + np.minimum(index, r), q + (index < r)
    chunk = -(-length // parts)
    start = np.minimum(index * chunk, length)
    return start, np.minimum(start + chunk, length) - start


def _grid(layout: TensorLayout, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ranks, offsets, sizes) of every mesh position of a Shard/Replicate layout: one box each."""
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

    Of the boxes that start at the same offsets (only empty ones do), one is kept
    (`core.box.one_per_start`): they would share a metadata key (fqn + offsets).

    Raises:
        GeometryError: the layout cannot apply to `shape`, or gives a box outside the tensor.
    """
    shape = tuple(int(s) for s in shape)
    layout.validate(shape)
    if not shape:
        ranks = np.sort(np.array(layout.mesh.ranks, np.int64))
        return RankBoxes(np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64), [ranks])
    if any(isinstance(p, RaggedShard) for p in layout.placements):
        ranks, offsets, sizes, slots = _listed(layout, shape)
    else:
        ranks, offsets, sizes = _grid(layout, shape)
        slots = np.zeros(len(ranks), np.int64)
    if len(ranks) == 0:
        return RankBoxes(offsets, sizes, [])
    outside = np.any((offsets < 0) | (sizes < 0) | (offsets + sizes > np.array(shape)), axis=1)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise GeometryError(f"target box {offsets[i].tolist()}+{sizes[i].tolist()} of rank {int(ranks[i])} "
                            f"lies outside {list(shape)}")
    appearance = np.lexsort((slots, ranks))  # rank order, then the order within a rank's list
    rows = np.concatenate([offsets, sizes], axis=1)[appearance]
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    by_appearance = np.argsort(first, kind="stable")  # unique id -> position in appearance order
    rank_of_row = ranks[appearance]
    grouped = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(first)))
    holders_by_unique = np.split(rank_of_row[grouped], bounds[:-1])
    unique_rows = rows[first[by_appearance]]
    holders = [np.unique(holders_by_unique[u]) for u in by_appearance]
    ndim = len(shape)
    out_offsets, out_sizes = unique_rows[:, :ndim], unique_rows[:, ndim:]
    if np.any(out_sizes == 0):
        boxes = [Box(tuple(o), tuple(z)) for o, z in zip(out_offsets.tolist(), out_sizes.tolist())]
        keep = one_per_start(boxes)
        out_offsets, out_sizes = out_offsets[keep], out_sizes[keep]
        holders = [holders[i] for i in keep]
    return RankBoxes(out_offsets, out_sizes, holders)
