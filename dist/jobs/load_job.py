"""`hpckpt run load`: load a checkpoint into the job's layout with `hpckpt.dist.load` and, with
`--check`, prove every loaded box equal to an independent read of it.

The check opens the checkpoint a second time and reads each box of this rank with the offline
reader (`core.io.read.read_box`), a block of rows at a time, not through `load`'s planning,
broadcasts or in-place fills, and compares raw bits; values are compared by type and value.
"""

from __future__ import annotations

import numpy as np

from hpckpt.converters import open_index
from hpckpt.core.errors import CheckFailedError
from hpckpt.core.geometry.box import Box
from hpckpt.core.io.read import OpenFiles, read_box
from hpckpt.dist import frameworks
from hpckpt.dist.flatten import flatten
from hpckpt.dist.jobs import states
from hpckpt.dist.jobs.save_job import peak_rss


CHECK_TILE_BYTES = 64 * 1024 * 1024  # the second read of a box, a block of rows at a time


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _row_blocks(box: Box, itemsize: int):
    """(rows, sub-box) blocks of `box` of at most `CHECK_TILE_BYTES` (one block for a 0-d box)."""
    if box.ndim == 0:
        yield (0, 1), box
        return
    row = max(1, box.volume // max(box.sizes[0], 1) * itemsize)
    step = max(1, CHECK_TILE_BYTES // row)
    for start in range(0, box.sizes[0], step):
        n = min(step, box.sizes[0] - start)
        yield (start, start + n), Box((box.offsets[0] + start, *box.offsets[1:]), (n, *box.sizes[1:]))


def check(ckpt, state: dict, pieces: list, fw, rank: int) -> dict:
    """Compare every box this rank loaded, and every value, with a fresh read of `ckpt`.

    Raises:
        CheckFailedError: the first box or value that differs, named.
    """
    index = open_index(ckpt)
    boxes = nbytes = 0
    with OpenFiles() as files:
        for fqn, s in pieces:
            box = s.box(fqn, rank, fw.shape_of(s.local))
            if box is None or box.is_empty:
                continue
            entry = index.tensors[fqn]
            held = fw.to_numpy(s.local, copy=False)
            for rows, part in _row_blocks(box, entry.dtype.itemsize):  # the box a block of rows at a time
                expected = read_box(index, entry, part, files)
                mine = held[rows[0]:rows[1]] if box.ndim else held
                if mine.dtype.itemsize != expected.dtype.itemsize or not np.array_equal(_bytes(mine), _bytes(expected)):
                    raise CheckFailedError(f"rank {rank}: {fqn} box {list(box.sizes)} at {list(box.offsets)} "
                                           "differs from the checkpoint")
                nbytes += expected.nbytes
            boxes += 1
    flat, _paths = flatten(state, frameworks.is_any_tensor)
    values = 0
    for fqn in index.values:
        want, got = index.decode_value(fqn), flat.get(fqn)
        if type(want) is not type(got) or want != got:
            raise CheckFailedError(f"rank {rank}: value {fqn} is {got!r}, the checkpoint holds {want!r}")
        values += 1
    return {"checked_boxes": boxes, "checked_bytes": nbytes, "checked_values": values}


def run(spec: dict, ctx) -> dict:
    import hpckpt.dist as hdist

    ckpt = spec["ckpt"]
    fw = frameworks.named(ctx.framework)
    layout = states.layout_spec(spec, ctx.world_size)
    ctx.phase(f"reading the metadata of {ckpt}")
    index = open_index(ckpt)
    state, pieces = states.empty_state(index, layout, ctx.rank, ctx.framework)
    ctx.phase(f"loading {ckpt}")
    result = hdist.load(state, ckpt, strict=spec.get("strict", True), progress=ctx.progress,
                        broadcast_shared=spec.get("broadcast_shared", "auto"),
                        storage_bandwidth=spec.get("storage_bandwidth"), network_bandwidth=spec.get("network_bandwidth"))
    job_seconds = max(ctx.comm.all_gather_json(result.seconds))  # the job's load ends with its slowest rank
    figures = {"rank": ctx.rank, "format": result.format, "tensors": result.tensors, "values": result.values,
               "bytes_read": result.bytes_read, "bytes_broadcast": result.bytes_broadcast,
               "job_bytes_read": result.job_bytes_read, "job_bytes_wanted": result.job_bytes_wanted,
               "job_read_amplification": round(result.read_amplification, 4), "seconds": round(result.seconds, 4),
               "job_seconds": round(job_seconds, 4),
               "job_gib_per_s": round(result.job_bytes_wanted / job_seconds / 2**30, 3) if job_seconds else None,
               "missing": list(result.missing), "converted": [list(c) for c in result.converted],
               # boxes several ranks want: read by each or broadcast, and the figures behind the choice
               "wants_from": result.wants_from, "broadcast": result.broadcast, "broadcast_reason": result.broadcast_reason,
               "storage_bandwidth": result.storage_bandwidth, "storage_bandwidth_from": result.storage_bandwidth_from,
               "network_bandwidth": result.network_bandwidth, "network_bandwidth_from": result.network_bandwidth_from}
    if spec.get("check"):
        ctx.phase("checking every loaded box")
        figures.update(check(ckpt, state, pieces, fw, ctx.rank))
    figures["peak_rss"] = peak_rss()
    return figures
