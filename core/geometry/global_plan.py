"""The global plan of a save from a running job: every rank builds the same one from the local plans.

Each rank of a job describes what it holds (`LocalPlan`: per tensor its dtype, global shape and
the boxes of its local shards; per value the length and digest of its pickle). The plans are
gathered (collectives or files, `hpckpt.dist`), and every rank turns the same list into the same
`core.geometry.plan.Plan`, so no plan is ever broadcast. Replicated boxes (a box several ranks hold) are
stored once: by the least-loaded holder, largest first, exactly as the offline planner and
HyperParallel's own de-dup place them (`dedup="balanced"`), by their lowest rank
(`"lowest-rank"`), or by every holder (`"none"`). All boxes of the job are grouped with one sort
(numpy, no object per box), so the cost is O(n log n) in the number of chunks.

Nothing here knows torch or MindSpore: the plans are plain data, JSON in and out, and the result
goes through the one HyperParallel writer, engine and commit (`core.io.write`).
"""

from __future__ import annotations

import base64
import math
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hpckpt.core.dtypes import DType, dtype as parse_dtype
from hpckpt.core.errors import EntryMismatchError, GeometryError
from hpckpt.core.geometry.assign import least_loaded
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.plan import BoxColumns, Plan, PlannedTensor, PlannedValue

DEDUP_MODES = ("balanced", "lowest-rank", "none")


@dataclass(frozen=True)
class LocalValue:
    """A non-tensor value a rank holds: its pickle's length and SHA-256 (replicas must agree)."""

    fqn: str
    nbytes: int
    digest: str


class LocalPlan:
    """Everything one rank contributes to the global plan, column-wise (a rank of a large model
    holds tens of thousands of boxes: no object per box).

    `names`, `dtypes` (canonical names), `shapes`: the tensors in the rank's order; `boxes`: int64
    rows `(tensor position, slot, offsets..., sizes...)` padded to the widest tensor; `nesting`: the
    key paths that are not simply the name split at its dots.
    """

    __slots__ = ("rank", "names", "dtypes", "shapes", "boxes", "values", "nesting")

    def __init__(self, rank: int, names: list[str], dtypes: list[str], shapes: list[list[int]], boxes: np.ndarray,
                 values: Sequence[LocalValue] = (), nesting: dict[str, tuple] | None = None):
        self.rank, self.names, self.dtypes, self.shapes = int(rank), names, dtypes, shapes
        self.boxes, self.values, self.nesting = boxes, tuple(values), dict(nesting or {})

    @classmethod
    def build(cls, rank: int, tensors: Sequence[tuple[str, str, tuple[int, ...], Sequence[Box]]],
              values: Sequence[LocalValue] = (), nesting: dict[str, tuple] | None = None) -> "LocalPlan":
        """From `(fqn, dtype name, global shape, boxes)` per tensor."""
        width = max((len(shape) for _f, _d, shape, _b in tensors), default=0)
        rows = []
        for position, (_fqn, _dt, shape, boxes) in enumerate(tensors):
            pad = (0,) * (width - len(shape))
            rows += [(position, slot, *box.offsets, *pad, *box.sizes, *pad) for slot, box in enumerate(boxes)]
        array = np.array(rows, np.int64).reshape(len(rows), 2 + 2 * width)
        explicit = {fqn: tuple(path) for fqn, path in (nesting or {}).items() if tuple(path) != tuple(fqn.split("."))}
        return cls(rank, [t[0] for t in tensors], [t[1] for t in tensors], [list(t[2]) for t in tensors], array,
                   values, explicit)

    def to_json(self) -> dict:
        return {"rank": self.rank, "names": self.names, "dtypes": self.dtypes, "shapes": self.shapes,
                "width": (self.boxes.shape[1] - 2) // 2,
                "boxes": base64.b64encode(np.ascontiguousarray(self.boxes, "<i8").tobytes()).decode(),
                "values": [[v.fqn, v.nbytes, v.digest] for v in self.values],
                "nesting": {fqn: list(path) for fqn, path in self.nesting.items()}}

    @classmethod
    def from_json(cls, doc: dict) -> "LocalPlan":
        width = int(doc["width"])
        boxes = np.frombuffer(base64.b64decode(doc["boxes"]), "<i8").astype(np.int64).reshape(-1, 2 + 2 * width)
        values = [LocalValue(str(f), int(n), str(d)) for f, n, d in doc["values"]]
        nesting = {str(f): tuple(p) for f, p in doc.get("nesting", {}).items()}
        return cls(int(doc["rank"]), list(doc["names"]), list(doc["dtypes"]), [list(s) for s in doc["shapes"]],
                   boxes, values, nesting)

    def digest(self) -> str:
        """What decides this rank's part of the plan, hashed (the plan cache's key part)."""
        h = hashlib.blake2b(digest_size=20)
        h.update(json.dumps([self.rank, self.names, self.dtypes, self.shapes, [[v.fqn, v.nbytes, v.digest]
                             for v in self.values], self.nesting], separators=(",", ":")).encode())
        h.update(np.ascontiguousarray(self.boxes).tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class GlobalPlan:
    """The job's plan as arrays (one row per stored box): `plan(ranks)` makes the `core.geometry.plan.Plan`
    of the boxes some ranks store, `plan()` of all of them (what the metadata lists)."""

    world_size: int
    names: list[str]
    dtypes: list[DType]
    shapes: list[tuple[int, ...]]
    tid: np.ndarray  # per stored box, in metadata order: tensor, owner, position, offsets, sizes
    owner: np.ndarray
    index: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    values: tuple[PlannedValue, ...]
    value_lengths: dict[str, int]
    nesting: dict[str, tuple]
    key: str

    def plan(self, ranks: Sequence[int] | None = None) -> Plan:
        keep = np.ones(len(self.tid), bool) if ranks is None else np.isin(self.owner, np.array(list(ranks), np.int64))
        rows = np.flatnonzero(keep)
        tids = self.tid[rows]
        if len(tids) and not np.all(tids[1:] >= tids[:-1]):  # (metadata order is by tensor already)
            rows = rows[np.argsort(tids, kind="stable")]
            tids = self.tid[rows]
        ends = np.searchsorted(tids, np.arange(1, len(self.names) + 1)).tolist()
        tensors, start = [], 0
        for fqn, shape, dt, end in zip(self.names, self.shapes, self.dtypes, ends):
            mine, n = rows[start:end], len(shape)
            start = end
            columns = BoxColumns(self.offsets[mine, :n], self.sizes[mine, :n], self.owner[mine].astype(np.int64),
                                 self.index[mine].astype(np.int64))
            tensors.append(PlannedTensor(fqn, shape, dt, dt, columns=columns))
        tensors = tuple(tensors)
        nesting = self.key_paths() if ranks is None else {}
        producing = tuple(range(self.world_size)) if ranks is None else tuple(sorted(set(ranks)))
        return Plan(self.world_size, tensors, self.values, producing, nesting)

    def key_paths(self) -> dict[str, tuple]:
        """Every tensor's and value's key path (the name split at its dots unless given), in
        metadata order: what `.metadata` keeps as planner data."""
        paths = {fqn: self.nesting.get(fqn) or tuple(fqn.split(".")) for fqn in self.names}
        paths.update((v.fqn, self.nesting.get(v.fqn) or tuple(v.fqn.split("."))) for v in self.values)
        return paths


def plan_key(digests: Sequence[str], options: dict) -> str:
    """The plan cache's key: every rank's `LocalPlan.digest` (names, dtypes, shapes, boxes, so
    layouts and the world size; values) and the options. Equal keys, equal plans."""
    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps([list(digests), options], sort_keys=True).encode())
    return h.hexdigest()


def build_global_plan(plans: Sequence[LocalPlan], *, dedup: str = "balanced", key: str = "") -> GlobalPlan:
    """The plan of a save by `len(plans)` ranks (`plans[r]` is rank r's), the same on every rank.

    Tensors come in order of first appearance (rank 0's order, then what later ranks add). Every
    tensor must have one dtype and shape on every rank and its distinct boxes must hold each of
    its elements once.

    Raises:
        EntryMismatchError: ranks disagree on a tensor's dtype or shape, or on a value.
        GeometryError: a tensor's boxes leave parts of it uncovered or overlap.
    """
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {', '.join(DEDUP_MODES)}, not {dedup!r}")
    for r, local in enumerate(plans):
        if local.rank != r:
            raise EntryMismatchError(f"the local plan gathered at position {r} is rank {local.rank}'s")
    names, dtypes, shapes, tids = _tensor_table(plans)
    width = max((len(s) for s in shapes), default=0)
    rows = _all_rows(plans, tids, width)
    ndims = np.array([len(s) for s in shapes], np.int64)
    tid, owner, off, size = _stored_boxes(rows, width, ndims, shapes, names, dtypes, dedup, len(plans))
    index = _positions(tid, owner, off)
    listed = np.lexsort((index, tid))  # rows in metadata order: tensor, then position
    tid, owner, off, size, index = tid[listed], owner[listed], off[listed], size[listed], index[listed]
    values, lengths = _values(plans)
    nesting: dict[str, tuple] = {}
    for local in plans:
        for fqn, path in local.nesting.items():
            nesting.setdefault(fqn, path)
    return GlobalPlan(len(plans), names, dtypes, shapes, tid, owner, index, off, size, values, lengths, nesting, key)


def _tensor_table(plans: Sequence[LocalPlan]):
    """The job's tensors in order of first appearance, checked for one dtype and shape, and each
    rank's tensor positions mapped to them (ranks with the same list as the previous one, the
    usual case, are compared in one step)."""
    names: list[str] = []
    dtypes: list[DType] = []
    shapes: list[tuple[int, ...]] = []
    where: dict[str, int] = {}
    first_rank: list[int] = []
    tids: list[np.ndarray] = []
    previous: LocalPlan | None = None
    for local in plans:
        if previous is not None and local.names == previous.names and local.dtypes == previous.dtypes \
                and local.shapes == previous.shapes:
            tids.append(tids[-1])
            continue
        mapped = np.empty(len(local.names), np.int64)
        for i, (fqn, dt, shape) in enumerate(zip(local.names, local.dtypes, local.shapes)):
            t = where.get(fqn)
            if t is None:
                t = where[fqn] = len(names)
                names.append(fqn)
                dtypes.append(parse_dtype(dt))
                shapes.append(tuple(int(s) for s in shape))
                first_rank.append(local.rank)
            elif (dtypes[t].name, shapes[t]) != (parse_dtype(dt).name, tuple(shape)):
                raise EntryMismatchError(f"{fqn}: rank {first_rank[t]} holds it as {dtypes[t].name}{list(shapes[t])}, "
                                         f"rank {local.rank} as {dt}{list(shape)}")
            mapped[i] = t
        tids.append(mapped)
        previous = local
    return names, dtypes, shapes, tids


def _all_rows(plans: Sequence[LocalPlan], tids: list[np.ndarray], width: int) -> np.ndarray:
    """Every rank's boxes as rows `(tensor, rank, slot, offsets[width], sizes[width])`."""
    parts = []
    for local, mapped in zip(plans, tids):
        b = local.boxes
        w = (b.shape[1] - 2) // 2
        part = np.zeros((len(b), 3 + 2 * width), np.int64)
        part[:, 0] = mapped[b[:, 0]] if len(b) else 0
        part[:, 1] = local.rank
        part[:, 2] = b[:, 1]
        part[:, 3:3 + w] = b[:, 2:2 + w]
        part[:, 3 + width:3 + width + w] = b[:, 2 + w:2 + 2 * w]
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros((0, 3 + 2 * width), np.int64)


def _stored_boxes(rows, width, ndims, shapes, names, dtypes, dedup, world_size):
    """Distinct boxes with their holders, checked to cover their tensors, and the rank storing each."""
    tid_col, rank_col, slot_col = rows[:, 0], rows[:, 1], rows[:, 2]
    off, size = rows[:, 3:3 + width], rows[:, 3 + width:]
    keys = [slot_col, rank_col] + [size[:, d] for d in reversed(range(width))] + \
           [off[:, d] for d in reversed(range(width))] + [tid_col]
    order = np.lexsort(keys)
    rows = rows[order]
    tid_col, rank_col, slot_col = rows[:, 0], rows[:, 1], rows[:, 2]
    off, size = rows[:, 3:3 + width], rows[:, 3 + width:]
    n = len(rows)
    limits = np.zeros((len(shapes), width), np.int64)
    for t, shape in enumerate(shapes):
        limits[t, :len(shape)] = shape
    outside = np.any((off < 0) | (size < 0) | (off + size > limits[tid_col]), axis=1) if n else np.zeros(0, bool)
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        t, k = int(tid_col[i]), len(shapes[int(tid_col[i])])
        raise GeometryError(f"{names[t]}: rank {int(rank_col[i])} holds a box at {off[i, :k].tolist()} of size "
                            f"{size[i, :k].tolist()}, which lies outside {list(shapes[t])}")
    ident = rows[:, [0, *range(3, 3 + 2 * width)]]
    new = np.ones(n, bool)
    new[1:] = np.any(ident[1:] != ident[:-1], axis=1)
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, n))
    g_tid, g_off, g_size = tid_col[starts], off[starts], size[starts]
    dims = np.arange(width)[None, :] < ndims[g_tid][:, None]
    volume = np.prod(np.where(dims, g_size, 1), axis=1)
    # Of the boxes starting at one place (only empty ones do) one is kept: they would share a
    # metadata key (fqn + offsets); the non-empty one, else the first.
    same_start = np.zeros(len(starts), bool)
    same_start[1:] = (g_tid[1:] == g_tid[:-1]) & np.all(g_off[1:] == g_off[:-1], axis=1)
    keep = one_per_start(same_start, volume)
    if keep is not None:
        starts, counts, g_tid, g_off, g_size, volume = (a[keep] for a in (starts, counts, g_tid, g_off, g_size, volume))
    check_cover(g_tid, g_off, g_size, volume, ndims, shapes, names)
    itemsize = np.array([d.itemsize for d in dtypes], np.int64)
    nbytes = volume * itemsize[g_tid] if len(g_tid) else np.zeros(0, np.int64)
    if dedup == "none":
        expand = np.repeat(np.arange(len(starts)), counts)
        owner = rank_col[members(starts, counts)]  # every holder of every box
        return g_tid[expand], owner, g_off[expand], g_size[expand]
    owner = rank_col[starts].copy()  # the lowest-ranked holder
    if dedup == "balanced":
        shared = np.flatnonzero(counts > 1)
        load = np.zeros(world_size, np.int64)
        single = counts == 1
        np.add.at(load, owner[single], nbytes[single])
        # largest first; ties: tensor order, then first appearance (rank, then slot)
        ranked = shared[np.lexsort((slot_col[starts[shared]], rank_col[starts[shared]], g_tid[shared], -nbytes[shared]))]
        ranked = ranked.tolist()
        owner[ranked] = least_loaded(load.tolist(), ((rank_col[int(starts[g]):int(starts[g] + counts[g])], nbytes[g])
                                                     for g in ranked))
    return g_tid, owner, g_off, g_size


def members(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The positions of runs `[starts[i], starts[i] + counts[i])`, run after run."""
    return np.repeat(starts, counts) + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def one_per_start(same_start: np.ndarray, volume: np.ndarray) -> np.ndarray | None:
    """Of distinct boxes in (tensor, offsets, sizes) order, which to keep where several start at
    one place (`same_start[i]`: box i starts where box i - 1 does; only empty boxes can): the
    non-empty one, else the first. None: keep all."""
    if not same_start.any():
        return None
    run = np.cumsum(~same_start)
    pick = np.lexsort((np.arange(len(same_start)), volume == 0, run))
    first = np.ones(len(pick), bool)
    first[1:] = run[pick][1:] != run[pick][:-1]
    return np.sort(pick[first])


def check_cover(g_tid, g_off, g_size, volume, ndims, shapes, names) -> None:
    """Each tensor's distinct boxes must hold as many elements as it has, and no two neighbours
    (in offset order) may overlap: what a gap, a duplicated shard or a wrong offset breaks."""
    n_tensors = len(shapes)
    held = np.zeros(n_tensors, np.int64)
    np.add.at(held, g_tid, volume)
    wanted = np.array([math.prod(s) for s in shapes], np.int64)
    bad = np.flatnonzero(held != wanted)
    overlap = np.zeros(len(g_tid), bool)
    if len(g_tid) > 1:
        same = g_tid[1:] == g_tid[:-1]
        lo = np.maximum(g_off[1:], g_off[:-1])
        hi = np.minimum(g_off[1:] + g_size[1:], g_off[:-1] + g_size[:-1])
        dims = np.arange(g_off.shape[1])[None, :] < ndims[g_tid[1:]][:, None]
        overlap[1:] = same & np.all((lo < hi) | ~dims, axis=1) & (volume[1:] > 0) & (volume[:-1] > 0) \
            & (ndims[g_tid[1:]] > 0)
    if len(bad) == 0 and not overlap.any():
        return
    t = int(bad[0]) if len(bad) else int(g_tid[np.flatnonzero(overlap)[0]])
    raise GeometryError(
        f"{names[t]}: the ranks' shards hold {int(held[t])} elements of a tensor of {int(wanted[t])} "
        f"({list(shapes[t])})" + (", some twice" if overlap[g_tid == t].any() else ""),
        hint="every element of a tensor must be held by some rank; partial or overlapping shards are not a layout")


def _positions(tid: np.ndarray, owner: np.ndarray, off: np.ndarray) -> np.ndarray:
    """Each stored box's position in its tensor's chunk list: rank-major, then by offsets (the
    order HyperParallel's metadata lists chunks in, and the offline planner's)."""
    if len(tid) == 0:
        return np.zeros(0, np.int64)
    order = np.lexsort(tuple(off[:, d] for d in reversed(range(off.shape[1]))) + (owner, tid))
    index = np.empty(len(tid), np.int64)
    sorted_tid = tid[order]
    first = np.ones(len(order), bool)
    first[1:] = sorted_tid[1:] != sorted_tid[:-1]
    run_start = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    index[order] = np.arange(len(order)) - run_start
    return index


def _values(plans: Sequence[LocalPlan]) -> tuple[tuple[PlannedValue, ...], dict[str, int]]:
    return values_of((local.rank, local.values) for local in plans)


def values_of(held_by: Iterable[tuple[int, Sequence[LocalValue]]]) -> tuple[tuple[PlannedValue, ...], dict[str, int]]:
    """From `(rank, its values)` in rank order: each value stored once, by its lowest-ranked
    holder (where the offline writer puts them), after checking every holder has the same
    pickle: a value that differs between ranks (an RNG state) would otherwise lose all copies
    but one."""
    holders: dict[str, list[tuple[int, LocalValue]]] = {}
    for rank, held in held_by:
        for v in held:
            holders.setdefault(v.fqn, []).append((rank, v))
    values, lengths = [], {}
    for fqn, held in holders.items():
        first_rank, first = held[0]
        for rank, v in held[1:]:
            if (v.nbytes, v.digest) != (first.nbytes, first.digest):
                raise EntryMismatchError(
                    f"{fqn}: rank {first_rank} and rank {rank} hold different values under this name; a save stores "
                    "one copy of a name", hint="store per-rank values under per-rank names (e.g. rng.rank3)")
        values.append(PlannedValue(fqn, first_rank))
        lengths[fqn] = first.nbytes
    return tuple(values), lengths
