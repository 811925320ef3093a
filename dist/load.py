"""`load`: fill a running job's tensors, in place, from a checkpoint of any format and layout.

Each rank asks for the boxes it holds (`dist.shards`) and reads, with ranged reads, only their
overlaps with the saved chunks (`core.io.read.read_box`). The boxes several ranks want (HSDP
replicas, replicated tensors) are found from one gather (`core.geometry.load_sharing`): of the
digest of every rank's table of layouts where the ranks' tensors have the same layouts (nothing
else travels, at any scale), else of every rank's wanted boxes. Per set of
ranks sharing boxes, either every holder reads them, or one holder reads each (chosen to balance
bytes: largest first, the least-loaded holder) and broadcasts it to the others in batches, so the
job reads it once (`LoadResult.read_amplification` 1.0 where every shared box is broadcast).
`broadcast_shared=True/False` forces one way; `"auto"` weighs the storage's and the network's
bandwidth (`dist.read_or_broadcast`, figures from `dist.bandwidths`), decided from rank 0's
figures, which the first gather carries, so every rank decides alike.
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
from hpckpt.core.errors import EntryMismatchError, GeometryError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import Mesh, Replicate, TensorLayout
from hpckpt.core.geometry.layout_plan import LayoutTable
from hpckpt.core.geometry.load_sharing import LayoutWants, ListedWants
from hpckpt.core.io.read import OpenFiles, read_box
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import as_path
from hpckpt.dist import bandwidths, frameworks
from hpckpt.dist.call_forms import checkpoint_path, refuse_torch_only
from hpckpt.dist.flatten import flatten, set_path
from hpckpt.dist.job import this_job
from hpckpt.dist.read_or_broadcast import BROADCAST, READ, choose, overall
from hpckpt.dist.results import LoadResult, SharedGroup
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
         broadcast_shared: bool | str = "auto", storage_bandwidth: str | float | None = None,
         network_bandwidth: str | float | None = None, strict: bool = True, progress: Any = None,
         no_dist: bool = False, storage_reader: Any = None, planner: Any = None) -> LoadResult:
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

    A box several ranks want is read by one of them and broadcast to the others
    (`broadcast_shared=True`), read by each (`False`), or, with `"auto"`, whichever costs less
    for each set of ranks sharing boxes, from the storage's read rate and a broadcast's rate over
    the group (`storage_bandwidth`, `network_bandwidth`: bytes per second, or sizes such as "2GiB";
    else `HPCKPT_STORAGE_BANDWIDTH` / `HPCKPT_NETWORK_BANDWIDTH`; else measured: the file system's
    read probe, remembered per file system, and a few timed broadcasts of 4 MiB, remembered in
    this process). Rank 0's mode and figures decide for every rank. `LoadResult.broadcast` says
    what was chosen, with the figures and where they came from.

    Raises:
        EntryMismatchError: an entry the state dict has is missing from the checkpoint (`strict`),
            or has another global shape.
        ValueError: `broadcast_shared` is not True, False or "auto"; a bandwidth is not a rate.
    """
    refuse_torch_only("load", storage_reader=storage_reader, planner=planner)
    if broadcast_shared is not True and broadcast_shared is not False and broadcast_shared != "auto":
        raise ValueError(f"broadcast_shared must be True, False or 'auto', not {broadcast_shared!r}")
    for given, variable in ((storage_bandwidth, bandwidths.STORAGE_VARIABLE), (network_bandwidth, bandwidths.NETWORK_VARIABLE)):
        bandwidths.configured(given, variable)  # a bad figure fails on every rank, before any exchange
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
        missing, values, described = [], [], []
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
                described.append((fqn, entry, shards))
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
        proposal = _proposal(broadcast_shared, storage_bandwidth, network_bandwidth, path, fw, job) \
            if job.rank == 0 and job.world_size > 1 else None
        wants, wants_from, gathered = _wants(targets, described, proposal, job)
        route = _route(gathered[0][1], wants.shared, job, path, index, [g[2] for g in gathered])
        sent = {ranks for ranks, choice in route.choice.items() if choice == BROADCAST}
        readers, shared = _assign(wants.mine(sent), targets)
        converted = []
        if progress is not None:
            progress.start(sum(t.nbytes for t in targets))
        mine = [t for i, t in enumerate(targets) if readers.get(i, job.rank) == job.rank]
        pending = sum(t.nbytes for t in targets) - sum(t.nbytes for t in mine)
        bytes_read = _fill_all(mine, index, fw, progress, converted, FILLS_IN_FLIGHT if is_object(path) else 1)
        received = _broadcast(shared, sorted(sent), targets, job) if sent else 0
        if progress is not None and pending:
            progress.advance(pending)
        for fqn in values:
            value = index.decode_value(fqn)
            if isinstance(flat[fqn], io.BytesIO) and isinstance(value, (bytes, bytearray)):
                value = io.BytesIO(value)  # hpckpt's readers give a saved BytesIO's content
            set_path(resolved.view if resolved.owner(paths[fqn]) else state_dict, paths[fqn], value)
    job_read = bytes_read if job.world_size == 1 else sum(job.collectives().all_gather("load-read", bytes_read))
    job_wanted = wants.wanted_bytes
    resolved.restore()
    return LoadResult(path=path, rank=job.rank, world_size=job.world_size, format=index.format,
                      tensors=len({t.fqn for t in targets}), values=len(values), bytes_read=bytes_read,
                      bytes_broadcast=received, job_bytes_read=job_read, job_bytes_wanted=job_wanted,
                      read_amplification=(job_read / job_wanted) if job_wanted else 1.0, missing=tuple(missing),
                      unused=unused, converted=tuple(converted), seconds=time.perf_counter() - started,
                      broadcast=overall(g.choice for g in route.groups), broadcast_reason=route.reason,
                      shared_groups=route.groups, wants_from=wants_from, **route.figures())


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


def _layout_rows(described: list, job) -> list | None:
    """This rank's wanted tensors as `(fqn, shape, layout, itemsize)` over the job's ranks, each
    layout checked to give exactly this rank's boxes; None when one has none (HyperParallel
    `chunk_info`, a strided shard, a mesh in global ranks of a job that is a subgroup). A plain
    tensor is wanted whole by every rank."""
    ranks_are_global = job.comm is None or bool(getattr(job.comm, "is_world", False))
    me, rows, everyone = job.global_rank(job.rank), [], None
    for fqn, entry, shards in described:
        layout = shards.layout
        if shards.replicated:
            layout = everyone = everyone or TensorLayout(Mesh((job.world_size,)), (Replicate(),))
        elif layout is None or not ranks_are_global or max(layout.mesh.ranks) >= job.world_size:
            return None
        try:
            if layout.boxes(shards.shape, me) != [box for box, _t in shards.pieces]:
                return None
        except GeometryError:
            return None
        rows.append((fqn, tuple(shards.shape), layout, entry.dtype.itemsize))
    return rows


def _wants(targets: list[_Target], described: list, proposal: dict | None, job):
    """Which boxes every rank wants, learnt in the first gather (which also carries rank 0's
    `proposal` and each rank's machine): when every rank's tensors have layouts and the same
    table of them, its digest (`LayoutWants`); else every rank's boxes (`ListedWants`), in a
    second gather when only some ranks sent theirs. Returns `(wants, wants_from, gathered)`."""
    if job.world_size == 1:
        return ListedWants([_wanted(targets)], 0), "", [[None, None, ""]]
    rows = _layout_rows(described, job)
    table = None if rows is None else \
        LayoutTable([(f, e.dtype.name, s, lay) for (f, s, lay, _i), (_f, e, _s) in zip(rows, described)]).digest()
    part = {"table": table} if table is not None else {"boxes": _wanted(targets)}
    gathered = job.collectives().all_gather("load-wanted", [part, proposal, bandwidths.machine()])
    parts = [g[0] for g in gathered]
    if table is not None and all(p.get("table") == table for p in parts):
        return LayoutWants(rows, job.world_size, job.rank), "layouts", gathered
    if any("boxes" not in p for p in parts):
        everyone = job.collectives().all_gather("load-boxes", _wanted(targets))
    else:
        everyone = [p["boxes"] for p in parts]
    return ListedWants(everyone, job.rank), "boxes", gathered


class _Route:
    """How the boxes several ranks want are had: a choice per set of holders, and why."""

    def __init__(self, reason: str, groups: tuple[SharedGroup, ...] = (), storage=None, network=None, memory=None):
        self.reason, self.groups, self.storage, self.network, self.memory = reason, groups, storage, network, memory
        self.choice = {g.ranks: g.choice for g in groups}

    def figures(self) -> dict:
        s, n = self.storage, self.network
        return {"storage_bandwidth": s.bytes_per_s if s else None, "storage_bandwidth_from": s.source if s else "",
                "network_bandwidth": n.bytes_per_s if n else None, "network_bandwidth_from": n.source if n else "",
                "memory_bandwidth": self.memory}


def _proposal(mode, storage_bandwidth, network_bandwidth, path: Path, fw, job) -> dict:
    """Rank 0's part of the first gather: its mode, and in `"auto"` the figures it has without
    measuring (None where one is still to be measured, once the gather shows a shared box)."""
    if mode != "auto":
        return {"mode": BROADCAST if mode else READ}
    storage = bandwidths.storage_known(storage_bandwidth, path)
    network = bandwidths.network_known(network_bandwidth, bandwidths.network_key(fw.NAME, job.comm))
    return {"mode": "auto", "storage": storage and storage.to_json(), "network": network and network.to_json(),
            "memory": bandwidths.memory_rate()}


def _route(proposal: dict | None, shared: dict[tuple[int, ...], tuple[int, int]], job, path: Path,
           index, hosts: list[str]) -> _Route:
    """Read or broadcast, per set of ranks sharing boxes (`shared`: their boxes and bytes), as
    rank 0's `proposal` says: forced, or (`"auto"`) by `choose` from rank 0's figures; those it
    lacked are measured now (the network by every rank, the storage by rank 0) and agreed on in
    one more gather."""
    if not shared or proposal is None:
        return _Route("nothing shared")
    if proposal["mode"] != "auto":
        return _Route("forced", tuple(SharedGroup(r, n, b, proposal["mode"]) for r, (n, b) in sorted(shared.items())))
    storage, network = (bandwidths.Figure.from_json(proposal[k]) for k in ("storage", "network"))
    if storage is None or network is None:
        seconds = bandwidths.probe_network(job.comm) if network is None else None
        found = bandwidths.probe_storage(path, index).to_json() if storage is None and job.rank == 0 else None
        answers = job.collectives().all_gather("load-route", [seconds, found])
        if network is None:
            key = bandwidths.network_key(job.framework.NAME, job.comm)
            network = bandwidths.network_from_probes([s for s, _found in answers], key)
        if storage is None:
            storage = bandwidths.Figure.from_json(answers[0][1])
    groups = []
    for ranks, (boxes, size) in sorted(shared.items()):
        machines = len({hosts[r] for r in ranks})
        choice, read_s, broadcast_s = choose(len(ranks), size, storage.bytes_per_s, network.bytes_per_s,
                                             machines, proposal["memory"])
        groups.append(SharedGroup(ranks, boxes, size, choice, read_s, broadcast_s, machines))
    return _Route("auto", tuple(groups), storage, network, proposal["memory"])


def _assign(mine: dict[tuple, tuple[tuple[int, ...], int]], targets: list[_Target]) -> tuple[dict[int, int], list]:
    """This rank's shared boxes to broadcast (`mine`: per box its holders and reader, from the
    job's wants) as a reader per target position, and the batches that carry them: per (holders,
    reader), the boxes in key order, cut at `BATCH_BYTES`. Every holder of a set holds the same
    boxes of it, so each computes the same batches of the sets it is in."""
    readers, groups = {}, defaultdict(dict)
    for i, t in enumerate(targets):
        key = (t.fqn, t.box.offsets, t.box.sizes)
        if key in mine:
            holders, reader = mine[key]
            readers[i] = reader
            groups[(holders, reader)][key] = t.nbytes
    batches = []
    for (ranks, src), boxes in sorted(groups.items()):
        batch, size = [], 0
        for key in sorted(boxes):
            if batch and size + boxes[key] > BATCH_BYTES:
                batches.append((ranks, src, batch))
                batch, size = [], 0
            batch.append(key)
            size += boxes[key]
        if batch:
            batches.append((ranks, src, batch))
    return readers, batches


def _broadcast(batches, sets: list[tuple[int, ...]], targets: list[_Target], job) -> int:
    """Send each shared box from its reader to the other holders (`batches`: this rank's; `sets`:
    every set of holders that broadcasts, whose groups every rank creates in this order);
    returns the bytes received."""
    fw, comm = job.framework, job.comm
    by_key = defaultdict(list)
    for t in targets:
        by_key[(t.fqn, t.box.offsets, t.box.sizes)].append(t)
    groups = comm.groups(sets)
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
