"""What each target rank of a plan writes and reads: the numbers `reshard --plan` prints.

Reads are found for all of a tensor's boxes at once (`core.geometry.overlap`), so the figures for a plan
onto thousands of ranks cost one pass over the source chunks and the target boxes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpckpt.core.geometry.overlap import ChunkIndex, check_covered, check_inside
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

    Works on the plan's columns (`PlannedTensor.columns`): per tensor a few array operations, the
    sums over ranks once at the end, no object per box.

    Raises:
        GeometryError: the source does not cover a planned box.
    """
    world = plan.world_size
    everyone = len(plan.producing) == world
    producing = np.zeros(world, bool)
    producing[list(plan.producing)] = True
    written = np.zeros(world, np.int64)
    read = np.zeros(world, np.int64)
    file_ids: dict[str, int] = {}
    pairs: list[np.ndarray] = []  # (rank << 32 | file id) of every box and source file it reads
    seen: dict[tuple, tuple] = {}  # a model's layers repeat: the same chunks and boxes, intersected once
    for tensor in plan.tensors:
        columns = tensor.columns
        mine = slice(None) if everyone else producing[columns.ranks]
        offsets, sizes, ranks = columns.offsets[mine], columns.sizes[mine], columns.ranks[mine]
        if not len(ranks):
            continue
        entry = index.tensors[tensor.fqn]
        ndim = len(tensor.shape)
        chunk_offsets, chunk_sizes = entry.chunk_arrays()
        key = (tuple(entry.shape), ndim, chunk_offsets.tobytes(), chunk_sizes.tobytes(), offsets.tobytes(),
               sizes.tobytes())
        found = seen.get(key)
        if found is None:
            check_inside(tensor.fqn, tuple(entry.shape), chunk_offsets, chunk_sizes)
            finder = ChunkIndex(ndim, chunk_offsets, chunk_sizes)
            pieces = finder.pieces(offsets, sizes)
            check_covered(tensor.fqn, pieces, offsets, sizes, finder)
            hit, chunk_at = np.unique(pieces.chunk, return_inverse=True)
            found = seen[key] = (pieces.box, pieces.volumes().astype(np.int64), hit, chunk_at.reshape(-1),
                                 columns.volumes()[mine])
        piece_box, piece_volumes, hit, chunk_at, volumes = found
        np.add.at(written, ranks, volumes * tensor.dtype.itemsize)
        piece_ranks = ranks[piece_box]
        np.add.at(read, piece_ranks, piece_volumes * tensor.source_dtype.itemsize)
        names = entry.chunk_files(hit.tolist())
        ids = np.array([file_ids.setdefault(name, len(file_ids)) for name in names], np.int64)
        pairs.append((piece_ranks << 32) | ids[chunk_at])
    files: dict[int, list[str]] = {}
    if pairs:
        names = list(file_ids)
        both = np.unique(np.concatenate(pairs))
        for rank, file_id in zip((both >> 32).tolist(), (both & 0xFFFFFFFF).tolist()):
            files.setdefault(rank, []).append(names[file_id])
    return [RankStats(rank, int(written[rank]), int(read[rank]), len(files.get(rank, ())),
                      tuple(sorted(files.get(rank, ()))))
            for rank in plan.storing_ranks if producing[rank]]
