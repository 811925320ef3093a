"""`load`: fill a running job's tensors, in place, from a checkpoint of any format and layout.

Each rank asks for the boxes it holds (`dist.shards`) and reads, with ranged reads, only their
overlaps with the saved chunks (`core.io.read.read_box`). With `broadcast_shared`, the boxes several
ranks want (HSDP replicas, replicated tensors) are found from one gather of every rank's wanted
boxes; each is read from storage by one of its holders, chosen to balance bytes (largest first,
the least-loaded holder), and sent to the others in batches. So the job reads every distinct box
once: `LoadResult.read_amplification` is 1.0 for row-sharded targets.
"""

from __future__ import annotations

import io
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.converters import open_index
from hpckpt.core.commit.lock import reading
from hpckpt.core.errors import EntryMismatchError
from hpckpt.core.geometry.assign import least_loaded
from hpckpt.core.geometry.box import Box
from hpckpt.core.io.read import OpenFiles, read_box
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import as_path
from hpckpt.dist import frameworks
from hpckpt.dist.call_forms import checkpoint_path, refuse_torch_only
from hpckpt.dist.flatten import flatten, set_path
from hpckpt.dist.job import this_job
from hpckpt.dist.results import LoadResult
from hpckpt.dist.shards import shards_of
from hpckpt.dist.stateful import resolve

BATCH_BYTES = 64 * 1024 * 1024  # one broadcast carries boxes up to this many bytes (one box may be larger)
TILE_BYTES = 64 * 1024 * 1024  # the buffer of a box read for a conversion or an accelerator


class _Target:
    """One box this rank wants: the checkpoint entry, the local tensor to fill and its box."""

    __slots__ = ("fqn", "entry", "box", "tensor", "nbytes")

    def __init__(self, fqn, entry, box: Box, tensor: Any):
        self.fqn, self.entry, self.box, self.tensor = fqn, entry, box, tensor
        self.nbytes = box.volume * entry.dtype.itemsize


def _fill(target: _Target, index, files: OpenFiles, fw) -> tuple[str, str] | None:
    """Read the target's box from storage into its tensor; returns a dtype conversion made.

    Straight into the tensor's memory when the framework allows it (a contiguous host tensor of
    the saved dtype); otherwise (another dtype, an accelerator, strides) through a buffer of at
    most `TILE_BYTES`, a block of rows at a time."""
    t, entry, box = target.tensor, target.entry, target.box
    view = fw.direct_view(t, entry.dtype)
    if view is not None:
        read_box(index, entry, box, files, out=view)
        return None
    if box.ndim == 0:
        fw.fill(t, read_box(index, entry, box, files), entry.dtype)
    else:
        row = box.volume // max(box.sizes[0], 1) * entry.dtype.itemsize
        step = max(1, TILE_BYTES // max(row, 1))
        for start in range(0, box.sizes[0], step):
            n = min(step, box.sizes[0] - start)
            rows = Box((box.offsets[0] + start, *box.offsets[1:]), (n, *box.sizes[1:]))
            fw.fill(t, read_box(index, entry, rows, files), entry.dtype, rows=(start, start + n))
    held = fw.dtype_of(t, target.fqn)
    return None if held.name == entry.dtype.name else (target.fqn, f"{entry.dtype.name} -> {held.name}")


def _as_bytes(t: Any, fw) -> np.ndarray:
    flat = np.ascontiguousarray(fw.to_numpy(t, copy=False)).reshape(-1)
    return flat.view(np.uint8)


def load(state_dict: Any, checkpoint_id: str | Path | None = None, *, process_group: Any = None,
         broadcast_shared: bool = True, strict: bool = True, progress: Any = None, no_dist: bool = False,
         storage_reader: Any = None, planner: Any = None) -> LoadResult:
    """Fill the tensors of `state_dict` (DTensors, plain tensors, tensors with `chunk_info`, in
    nested dicts and lists) in place from `checkpoint_id`, and replace its non-tensor values.

    A Stateful object in it (anything with `state_dict()` and `load_state_dict()`) is loaded as
    torch DCP loads one: its `state_dict()` gives the targets, they are filled in place (values
    replaced in that tree), then its `load_state_dict()` is called with the tree; the object
    itself stays in `state_dict`. An `io.BytesIO` target gets an `io.BytesIO` of the saved bytes.
    Any format hpckpt reads and any saved layout and world size; dtypes are converted on the
    copy where they differ (reported in `converted`). Every rank calls it. `progress`: an object
    with `start(total_bytes)` and `advance(n)`, told about this rank's boxes as they are filled.
    `no_dist`: this process loads alone, whatever the process group. `storage_reader`: hpckpt's
    own HpckptReader gives the path; torch's other readers and a `planner` are refused with a
    TypeError saying what to use instead.

    Raises:
        EntryMismatchError: an entry the state dict has is missing from the checkpoint (`strict`),
            or has another global shape.
    """
    refuse_torch_only("load", storage_reader=storage_reader, planner=planner)
    checkpoint_id = checkpoint_path("load", checkpoint_id, storage_reader)
    started = time.perf_counter()
    resolved = resolve(state_dict, frameworks.is_any_tensor)
    flat, paths = flatten(resolved.view, frameworks.is_any_tensor)
    fw = frameworks.of_state(flat)
    job = this_job(fw, process_group, need_collectives=True, no_dist=no_dist)
    me = job.global_rank(job.rank)
    path = as_path(checkpoint_id)
    with reading(path):
        index = open_index(path)
        targets: list[_Target] = []
        missing, values = [], []
        for fqn, obj in flat.items():
            if frameworks.is_any_tensor(obj):
                entry = index.tensors.get(fqn)
                if entry is None:
                    missing.append(fqn)
                    continue
                shards = shards_of(fqn, obj, fw, me)
                if tuple(shards.shape) != tuple(entry.shape):
                    raise EntryMismatchError(f"{fqn}: the checkpoint holds it as {list(entry.shape)}, the state dict "
                                             f"as {list(shards.shape)}")
                targets += [_Target(fqn, entry, box, t) for box, t in shards.pieces if not box.is_empty]
            elif fqn in index.values:
                values.append(fqn)
            else:
                missing.append(fqn)
        if missing and strict:
            shown = ", ".join(repr(m) for m in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise EntryMismatchError(f"{path}: the checkpoint has no {shown}",
                                     hint="load(..., strict=False) loads the rest and reports them in `missing`")
        wanted = set(flat)
        unused = tuple(n for n in (*index.tensors, *index.values) if n not in wanted)
        everyone = job.collectives().all_gather("load-wanted", _wanted(targets)) if job.world_size > 1 \
            else [_wanted(targets)]
        readers, shared = _assign(everyone, targets, job) if broadcast_shared and job.world_size > 1 else ({}, [])
        converted = []
        if progress is not None:
            progress.start(sum(t.nbytes for t in targets))
        mine = [t for i, t in enumerate(targets) if readers.get(i, job.rank) == job.rank]
        pending = sum(t.nbytes for t in targets) - sum(t.nbytes for t in mine)
        bytes_read = _fill_all(mine, index, fw, progress, converted, FILLS_IN_FLIGHT if is_object(path) else 1)
        received = _broadcast(shared, targets, job) if shared else 0
        if progress is not None and pending:
            progress.advance(pending)
        for fqn in values:
            value = index.decode_value(fqn)
            if isinstance(flat[fqn], io.BytesIO) and isinstance(value, (bytes, bytearray)):
                value = io.BytesIO(value)  # hpckpt's readers give a saved BytesIO's content
            set_path(resolved.view if resolved.owner(paths[fqn]) else state_dict, paths[fqn], value)
    job_read = bytes_read if job.world_size == 1 else sum(job.collectives().all_gather("load-read", bytes_read))
    job_wanted = sum({(f, tuple(o), tuple(z)): n for boxes in everyone for f, o, z, n in boxes}.values())
    resolved.restore()
    return LoadResult(path=path, rank=job.rank, world_size=job.world_size, format=index.format,
                      tensors=len({t.fqn for t in targets}), values=len(values), bytes_read=bytes_read,
                      bytes_broadcast=received, job_bytes_read=job_read, job_bytes_wanted=job_wanted,
                      read_amplification=(job_read / job_wanted) if job_wanted else 1.0, missing=tuple(missing),
                      unused=unused, converted=tuple(converted), seconds=time.perf_counter() - started)


#: Boxes filled at once from an object store: each is its own ranged GETs, and a store answers
#: many requests in parallel far better than one after another.
FILLS_IN_FLIGHT = 4


def _fill_all(targets: list[_Target], index, fw, progress, converted: list, in_flight: int) -> int:
    """Fill `targets` from the checkpoint, `in_flight` at a time (each worker with its own open
    files); progress and conversions are reported from this thread. Returns the bytes read."""
    if in_flight <= 1:
        with OpenFiles() as files:  # one set of open files for every box
            for target in targets:
                made = _fill(target, index, files, fw)
                if made:
                    converted.append(made)
                if progress is not None:
                    progress.advance(target.nbytes)
            return files.bytes_read

    def fill(target: _Target):
        with OpenFiles() as files:
            made = _fill(target, index, files, fw)
            return made, files.bytes_read

    total = 0
    with ThreadPoolExecutor(in_flight, thread_name_prefix="hpckpt-load") as pool:
        for target, (made, nbytes) in zip(targets, pool.map(fill, targets)):
            total += nbytes
            if made:
                converted.append(made)
            if progress is not None:
                progress.advance(target.nbytes)
    return total


def _wanted(targets: list[_Target]) -> list[list]:
    return [[t.fqn, list(t.box.offsets), list(t.box.sizes), t.nbytes] for t in targets]


def _assign(everyone: list[list], targets: list[_Target], job) -> tuple[dict[int, int], list]:
    """Who reads each box several ranks want (`everyone`: each rank's `_wanted`), and the
    broadcasts that carry it to the others.

    Returns this rank's reader per target position, and the shared boxes as
    `(holders, reader, [(fqn, offsets, sizes)])` batches in one order every rank agrees on."""
    holders: dict[tuple, list[int]] = defaultdict(list)
    nbytes: dict[tuple, int] = {}
    for rank, boxes in enumerate(everyone):
        for fqn, offsets, sizes, n in boxes:
            key = (fqn, tuple(offsets), tuple(sizes))
            holders[key].append(rank)
            nbytes[key] = n
    load = [0] * job.world_size
    for key, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += nbytes[key]
    shared = sorted((k for k, r in holders.items() if len(r) > 1), key=lambda k: (-nbytes[k], k))
    reader = dict(zip(shared, least_loaded(load, ((holders[k], nbytes[k]) for k in shared))))
    mine = {}
    for i, t in enumerate(targets):
        key = (t.fqn, t.box.offsets, t.box.sizes)
        if key in reader:
            mine[i] = reader[key]
    groups: dict[tuple[tuple[int, ...], int], list] = defaultdict(list)
    for key in sorted(reader):
        groups[(tuple(holders[key]), reader[key])].append(key)
    batches = []
    for (ranks, src), keys in sorted(groups.items()):
        batch, size = [], 0
        for key in keys:
            if batch and size + nbytes[key] > BATCH_BYTES:
                batches.append((ranks, src, batch))
                batch, size = [], 0
            batch.append(key)
            size += nbytes[key]
        if batch:
            batches.append((ranks, src, batch))
    return mine, batches


def _broadcast(batches, targets: list[_Target], job) -> int:
    """Send each shared box from its reader to the other holders; returns the bytes received."""
    fw, comm = job.framework, job.comm
    by_key = defaultdict(list)
    for t in targets:
        by_key[(t.fqn, t.box.offsets, t.box.sizes)].append(t)
    groups = comm.groups(sorted({ranks for ranks, _src, _keys in batches}))  # every rank, same order
    received = 0
    try:
        for ranks, src, keys in batches:
            if job.rank not in ranks:
                continue
            mine = [by_key[k][0] for k in keys]
            held = [fw.dtype_of(t.tensor, t.fqn) for t in mine]  # the holders' dtype: the reader's, converted
            sizes = [t.box.volume * d.itemsize for t, d in zip(mine, held)]
            if job.rank == src:
                parts = [_as_bytes(t.tensor, fw) for t in mine]
                buffer = np.concatenate(parts) if parts else np.empty(0, np.uint8)
            else:
                buffer = np.empty(sum(sizes), np.uint8)
            buffer = comm.broadcast(buffer, src, groups[ranks])
            if job.rank != src:
                at = 0
                for t, d, n in zip(mine, held, sizes):
                    values = buffer[at:at + n].view(d.np).reshape(t.box.sizes)
                    for same in by_key[(t.fqn, t.box.offsets, t.box.sizes)]:
                        fw.fill(same.tensor, values, d)
                    at += n
                received += buffer.size
    finally:
        comm.release(groups)
    return received
