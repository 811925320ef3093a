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
    seen: dict[tuple, tuple] = {}  # a model's layers repeat: the same chunks and boxes, intersected once
    for tensor in plan.tensors:
        boxes = [b for b in tensor.boxes if b.rank in producing]
        if not boxes:
            continue
        entry = index.tensors[tensor.fqn]
        ndim = len(tensor.shape)
        chunk_offsets, chunk_sizes = entry.chunk_arrays()
        offsets, sizes = boxes_to_arrays([b.box for b in boxes], ndim)
        key = (tuple(entry.shape), ndim, chunk_offsets.tobytes(), chunk_sizes.tobytes(), offsets.tobytes(),
               sizes.tobytes())
        found = seen.get(key)
        if found is None:
            check_inside(tensor.fqn, tuple(entry.shape), chunk_offsets, chunk_sizes)
            finder = ChunkIndex(ndim, chunk_offsets, chunk_sizes)
            pieces = finder.pieces(offsets, sizes)
            check_covered(tensor.fqn, pieces, offsets, sizes, finder)
            hit = np.unique(pieces.chunk)
            found = seen[key] = (pieces.box, pieces.chunk, pieces.volumes(), hit,
                                 sorted(set(zip(pieces.box.tolist(), pieces.chunk.tolist()))))
        piece_box, piece_chunk, piece_volumes, hit, box_chunks = found
        ranks = np.array([b.rank for b in boxes], np.int64)
        for b in boxes:
            written[b.rank] += tensor.box_nbytes(b)
        piece_ranks = ranks[piece_box]
        volumes = piece_volumes * tensor.source_dtype.itemsize
        if len(piece_ranks):
            per_rank = np.bincount(piece_ranks, weights=volumes, minlength=plan.world_size)
            for rank in np.flatnonzero(per_rank).tolist():
                read[rank] += int(per_rank[rank])
        file_of = dict(zip(hit.tolist(), entry.chunk_files(hit.tolist())))
        rank_of = ranks.tolist()
        for box, chunk in box_chunks:
            files[rank_of[box]].add(file_of[chunk])
    return [RankStats(rank, written[rank], read[rank], len(files[rank]), tuple(sorted(files[rank])))
            for rank in sorted(plan.by_rank) if rank in producing]
