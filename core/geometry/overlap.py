"""Which stored chunks of a tensor hold which part of each wanted box, for many boxes at once.

Every copy and every read estimate starts here. The chunks are sorted by their start along the
dimension with the most distinct starts; a box can only meet the chunks whose start lies in
`(box.start - longest chunk, box.end)` on that dimension, found by binary search for all boxes in
one numpy call, so the cost grows with chunks + boxes + pieces, never with chunks x boxes (the
all-pairs scan PyTorch DCP once did). Identical replicas (rank-local metadata saved without
de-duplication) are indexed once: the first copy is the one read.

Coverage is checked exactly: summing the volumes of a box's pieces proves it filled only when no
two stored chunks overlap, so chunks that partly overlap another are found once per tensor, and
each box they reach is checked cell by cell; an overlap cannot hide a hole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import Box
from hpckpt.core.index import int_rows


def boxes_to_arrays(boxes: list[Box], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """`(offsets, sizes)` as int64 arrays of shape `[len(boxes), ndim]`."""
    return int_rows([b.offsets for b in boxes], ndim), int_rows([b.sizes for b in boxes], ndim)


def volumes(sizes: np.ndarray) -> np.ndarray:
    """The elements in each box of `sizes` (int64 `[n, ndim]`); a 0-d box holds one."""
    return np.prod(sizes, axis=1, dtype=np.int64) if sizes.shape[1] else np.ones(len(sizes), np.int64)


@dataclass(frozen=True)
class Pieces:
    """The non-empty intersections of wanted boxes with stored chunks, as parallel arrays.

    Piece `p` is the part `[offsets[p], offsets[p] + sizes[p])` (global coordinates) of wanted
    box `box[p]` that stored chunk `chunk[p]` (an index into the tensor's chunk list) holds.
    """

    box: np.ndarray
    chunk: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    def volumes(self) -> np.ndarray:
        return volumes(self.sizes)

    def of_box(self) -> list[list[tuple[int, Box]]]:
        """Per wanted box, its pieces as `(chunk index, region)` in chunk order."""
        out: list[list[tuple[int, Box]]] = [[] for _ in range(int(self.box.max()) + 1 if len(self.box) else 0)]
        for b, c, o, s in zip(self.box.tolist(), self.chunk.tolist(), self.offsets.tolist(), self.sizes.tolist()):
            out[b].append((c, Box(tuple(o), tuple(s))))
        return out


class ChunkIndex:
    """The stored chunks of one tensor, ready to be intersected with any number of boxes."""

    def __init__(self, ndim: int, offsets: np.ndarray, sizes: np.ndarray):
        self.ndim = ndim
        nonempty = np.all(sizes > 0, axis=1) if self.ndim else np.ones(len(offsets), bool)
        keep = np.flatnonzero(nonempty)
        if self.ndim and len(keep):
            rows = np.concatenate([offsets[keep], sizes[keep]], axis=1)
            _, first = np.unique(rows, axis=0, return_index=True)
            keep = keep[np.sort(first)]  # the first copy of each replica, in chunk order
        elif not self.ndim:
            keep = keep[:1]  # a 0-d tensor: its one stored value covers any box
        self.ids = keep
        self.offsets, self.sizes = offsets[keep], sizes[keep]
        if self.ndim == 0 or not len(keep):
            self.dim = None
            return
        starts = self.offsets
        self.dim = max(range(self.ndim), key=lambda d: len(np.unique(starts[:, d])))
        order = np.argsort(starts[:, self.dim], kind="stable")
        self.ids, self.offsets, self.sizes = self.ids[order], self.offsets[order], self.sizes[order]
        self.starts = self.offsets[:, self.dim]
        self.longest = int(self.sizes[:, self.dim].max())

    def pieces(self, offsets: np.ndarray, sizes: np.ndarray) -> Pieces:
        """Intersect the wanted boxes `[offsets, offsets + sizes)` with the chunks."""
        n = len(offsets)
        empty = np.zeros(0, np.int64)
        if self.ndim == 0:
            count = len(self.ids)
            box = np.arange(n, dtype=np.int64) if count else empty
            chunk = np.full(len(box), self.ids[0] if count else 0, np.int64)
            return Pieces(box, chunk, np.zeros((len(box), 0), np.int64), np.zeros((len(box), 0), np.int64))
        if self.dim is None or n == 0:
            return Pieces(empty, empty, np.zeros((0, self.ndim), np.int64), np.zeros((0, self.ndim), np.int64))
        d = self.dim
        lo = np.searchsorted(self.starts, offsets[:, d] - self.longest, side="right")
        hi = np.searchsorted(self.starts, offsets[:, d] + sizes[:, d], side="left")
        counts = np.maximum(hi - lo, 0)
        box = np.repeat(np.arange(n, dtype=np.int64), counts)
        first = np.repeat(lo - np.cumsum(counts) + counts, counts)
        candidate = np.arange(len(box), dtype=np.int64) + first
        start = np.maximum(offsets[box], self.offsets[candidate])
        end = np.minimum(offsets[box] + sizes[box], self.offsets[candidate] + self.sizes[candidate])
        hit = np.all(end > start, axis=1) & np.all(sizes[box] > 0, axis=1)
        return Pieces(box[hit], self.ids[candidate[hit]], start[hit], (end - start)[hit])

    @cached_property
    def overlapping(self) -> np.ndarray:
        """The ids of the (distinct) stored chunks that share elements with another chunk."""
        if self.dim is None:
            return np.zeros(0, np.int64)
        met = self.pieces(self.offsets, self.sizes)
        other = self.ids[met.box] != met.chunk
        return np.unique(met.chunk[other])


#: Cells of the grid an overlapped box is checked on; beyond it the check gives up (and says so).
MAX_CHECK_CELLS = 1 << 22


def check_inside(fqn: str, shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> None:
    """Every stored chunk lies inside its tensor: one that sticks out means the metadata's shape
    is wrong, and a copy of the tensor's shape would drop the part outside without a word.

    Raises:
        GeometryError: naming the first chunk outside.
    """
    if not len(offsets) or not len(shape):
        return
    outside = np.flatnonzero(np.any((offsets < 0) | (sizes < 0) | (offsets + sizes > np.asarray(shape)), axis=1))
    if len(outside):
        i = int(outside[0])
        box = Box(tuple(offsets[i].tolist()), tuple(sizes[i].tolist()))
        raise GeometryError(f"{fqn}: chunk {i} {box} lies outside the tensor's shape {list(shape)}"
                            + (f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""))


def check_covered(fqn: str, pieces: Pieces, offsets: np.ndarray, sizes: np.ndarray,
                  finder: ChunkIndex | None = None) -> None:
    """Every wanted box must be filled by the chunks, every element of it (`finder`: the chunk
    index the pieces came from, which knows the overlapping chunks).

    Raises:
        GeometryError: some elements of a box are in no stored chunk, or overlapping chunks are
            too fragmented to prove they are not.
    """
    volume = volumes(sizes)
    covered = np.bincount(pieces.box, weights=pieces.volumes(), minlength=len(sizes)) if len(sizes) else volume
    suspect = covered != volume
    if finder is not None and len(finder.overlapping) and len(pieces.box):
        suspect[pieces.box[np.isin(pieces.chunk, finder.overlapping)]] = True
    for i in np.flatnonzero(suspect).tolist():
        box = Box(tuple(offsets[i].tolist()), tuple(sizes[i].tolist()))
        mine = pieces.box == i
        counted = f"the chunks hold {int(covered[i])} of its {int(volume[i])} elements, counting overlaps twice"
        try:
            hole = _first_hole(box, pieces.offsets[mine], pieces.sizes[mine])
        except GeometryError as exc:
            raise GeometryError(f"{fqn}: {exc.message} ({counted})") from None
        if hole is not None:
            raise GeometryError(f"{fqn}: no stored chunk holds {hole}, part of {box} ({counted})")


def _first_hole(box: Box, offsets: np.ndarray, sizes: np.ndarray) -> Box | None:
    """A cell of `box` that none of the regions `[offsets, offsets + sizes)` covers, or None."""
    ends = offsets + sizes
    cuts = [np.unique(np.concatenate([[o], offsets[:, d], ends[:, d], [o + n]]))
            for d, (o, n) in enumerate(zip(box.offsets, box.sizes))]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > MAX_CHECK_CELLS:
        raise GeometryError(f"{box}: overlapping chunks cut it into {math.prod(grid)} cells, too many to "
                            "prove every element is stored")
    counts = np.zeros(grid, dtype=np.int32)
    for o, e in zip(offsets.tolist(), ends.tolist()):
        counts[tuple(slice(int(np.searchsorted(c, a)), int(np.searchsorted(c, b)))
                     for c, a, b in zip(cuts, o, e))] += 1
    empty = np.argwhere(counts == 0)
    if not len(empty):
        return None
    cell = empty[0].tolist()
    return Box(tuple(int(cuts[d][k]) for d, k in enumerate(cell)),
               tuple(int(cuts[d][k + 1] - cuts[d][k]) for d, k in enumerate(cell)))
