"""What each target rank of a plan writes and reads: the numbers `reshard --plan` prints.

Reads are found for all of a tensor's boxes at once (`core.geometry.overlap`), so the figures for a plan
onto thousands of ranks cost one pass over the source chunks and the target boxes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from hpckpt.core.geometry.overlap import ChunkIndex, boxes_to_arrays, check_covered, check_inside
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex


@dataclass(frozen=True)
class RankStats:
    """One target rank's share: bytes it writes, bytes it reads, how many source files (and
    which: `files`)."""

    rank: int
    bytes_written: int
    bytes_read: int
    source_files: int
    files: tuple[str, ...] = ()


def rank_stats(plan: Plan, index: CheckpointIndex) -> list[RankStats]:
    """The producing ranks that store something, in rank order.

    Raises:
        GeometryError: the source does not cover a planned box.
    """
    producing = set(plan.producing)
    written: dict[int, int] = defaultdict(int)
    read: dict[int, int] = defaultdict(int)
    files: dict[int, set[str]] = defaultdict(set)
    for tensor in plan.tensors:
        boxes = [b for b in tensor.boxes if b.rank in producing]
        if not boxes:
            continue
        entry = index.tensors[tensor.fqn]
        ndim = len(tensor.shape)
        chunk_offsets, chunk_sizes = entry.chunk_arrays()
        check_inside(tensor.fqn, tuple(entry.shape), chunk_offsets, chunk_sizes)
        finder = ChunkIndex(ndim, chunk_offsets, chunk_sizes)
        offsets, sizes = boxes_to_arrays([b.box for b in boxes], ndim)
        pieces = finder.pieces(offsets, sizes)
        check_covered(tensor.fqn, pieces, offsets, sizes, finder)
        ranks = np.array([b.rank for b in boxes], np.int64)
        for b in boxes:
            written[b.rank] += tensor.box_nbytes(b)
        piece_ranks = ranks[pieces.box]
        volumes = pieces.volumes() * tensor.source_dtype.itemsize
        if len(piece_ranks):
            per_rank = np.bincount(piece_ranks, weights=volumes, minlength=plan.world_size)
            for rank in np.flatnonzero(per_rank).tolist():
                read[rank] += int(per_rank[rank])
        hit = np.unique(pieces.chunk)
        file_of = dict(zip(hit.tolist(), entry.chunk_files(hit.tolist())))
        for rank, chunk in set(zip(piece_ranks.tolist(), pieces.chunk.tolist())):
            files[rank].add(file_of[chunk])
    return [RankStats(rank, written[rank], read[rank], len(files[rank]), tuple(sorted(files[rank])))
            for rank in sorted(plan.by_rank) if rank in producing]
