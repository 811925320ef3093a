"""Planning a reshard: which stored regions feed which target boxes, and where each box is written.

A plan is plain data (frozen dataclasses of ints and strings): printable, comparable and the same
on every machine for the same inputs, which is what lets `reshard --rank` fan one job out over many
machines and still produce byte-identical output.

Steps: (1) the target layout gives every target rank its boxes; (2) identical boxes on several
ranks (replicas) are stored once, each in the file of the least-loaded holder, as HyperParallel's
own de-dup does; (3) each stored box is intersected with the source chunks through a sorted
interval index (O(log C + k) per box instead of PyTorch DCP's all-pairs scan); (4) the output
metadata lists chunks rank-major with `MetadataIndex.index` = position, in HyperParallel's format.
"""

from __future__ import annotations

import bisect
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from hpckpt.core.box import Box
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import GeometryError
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry
from hpckpt.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
)


class TargetLayout(Protocol):
    """What the planner needs of a layout: the boxes a target rank holds of a tensor."""

    def boxes(self, shape: tuple[int, ...], rank: int) -> list[Box]: ...


@dataclass(frozen=True, slots=True)
class Piece:
    """The part `region` (global coordinates) of a target box that source chunk `chunk` holds."""

    chunk: Chunk
    region: Box


@dataclass(frozen=True)
class TargetTensor:
    """One box of one tensor stored under `key` in a target file, and the pieces that fill it.

    `dtype` is the stored dtype; `source_dtype`, when set and different, asks the engine to cast.
    """

    fqn: str
    key: str
    dtype: DType
    box: Box
    pieces: tuple[Piece, ...]
    source_dtype: DType | None = None

    @property
    def nbytes(self) -> int:
        return self.box.volume * self.dtype.itemsize


@dataclass
class TargetFile:
    rank: int
    name: str
    tensors: list[TargetTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class RankStats:
    rank: int
    bytes_written: int
    bytes_read: int
    source_files: int


@dataclass
class Plan:
    world_size: int
    files: list[TargetFile]  # tensor files of the ranks being produced, rank order
    values: list[tuple[str, bytes]]  # (fqn, pickled payload) for `_rank{values_rank}_.bytes`
    values_rank: int
    metadata: Metadata  # for the whole target checkpoint (all ranks), written last
    producing: tuple[int, ...]  # the target ranks whose files this plan writes

    def stats(self) -> list[RankStats]:
        out = []
        for f in self.files:
            sources = {(p.chunk.file) for t in f.tensors for p in t.pieces}
            read = sum(p.region.volume * t.dtype.itemsize for t in f.tensors for p in t.pieces)
            out.append(RankStats(f.rank, f.nbytes, read, len(sources)))
        return out


class ChunkFinder:
    """Sorted-interval index over a tensor's stored chunks.

    Chunks are sorted by their start along the dimension with the most distinct starts; a box can
    only meet chunks whose start lies in `(box.start - longest_chunk, box.end)`, found by bisection.
    Identical replicas (rank-local metadata without de-dup) are indexed once.
    """

    def __init__(self, chunks: Iterable[Chunk]):
        unique: dict[Box, Chunk] = {}
        for chunk in chunks:
            if not chunk.box.is_empty:
                unique.setdefault(chunk.box, chunk)
        self._chunks = list(unique.values())
        ndim = self._chunks[0].box.ndim if self._chunks else 0
        if ndim == 0:
            self._dim = None
            return
        self._dim = max(range(ndim), key=lambda d: len({c.box.offsets[d] for c in self._chunks}))
        self._chunks.sort(key=lambda c: c.box.offsets[self._dim])
        self._starts = [c.box.offsets[self._dim] for c in self._chunks]
        self._longest = max(c.box.sizes[self._dim] for c in self._chunks)

    def overlapping(self, box: Box) -> list[Piece]:
        if self._dim is None:  # 0-d tensors: the single stored value covers the box
            return [Piece(c, box) for c in self._chunks[:1]]
        d = self._dim
        lo = bisect.bisect_right(self._starts, box.offsets[d] - self._longest)
        hi = bisect.bisect_left(self._starts, box.offsets[d] + box.sizes[d])
        pieces = []
        for chunk in self._chunks[lo:hi]:
            region = chunk.box.intersect(box)
            if region is not None:
                pieces.append(Piece(chunk, region))
        return pieces


def _physical_keys(items: list[tuple[str, Box]]) -> list[str]:
    """HyperParallel's key rule: the fqn when a file holds one chunk of it, else
    `fqn.__dcp_chunk_{i}`, with `_` appended until the key is unique in the file."""
    counts: dict[str, int] = defaultdict(int)
    for fqn, _ in items:
        counts[fqn] += 1
    used = {fqn for fqn, _ in items if counts[fqn] == 1}
    seen: dict[str, int] = defaultdict(int)
    keys = []
    for fqn, _ in items:
        if counts[fqn] == 1:
            keys.append(fqn)
            continue
        key = f"{fqn}.__dcp_chunk_{seen[fqn]}"
        seen[fqn] += 1
        while key in used:
            key += "_"
        used.add(key)
        keys.append(key)
    return keys


def _assign_owners(tensors: list[TensorEntry], layout_of: Callable[[TensorEntry], TargetLayout],
                   world_size: int) -> dict[int, list[tuple[TensorEntry, Box]]]:
    """Give every distinct target box one owning rank, balancing bytes as HyperParallel does:
    boxes held by one rank go to it; replicated boxes, largest first, to the least-loaded holder."""
    owned: dict[int, list[tuple[TensorEntry, Box]]] = defaultdict(list)
    load = [0] * world_size
    shared: list[tuple[int, int, TensorEntry, Box, list[int]]] = []
    order = 0
    for entry in tensors:
        layout = layout_of(entry)
        holders: dict[Box, list[int]] = {}
        for rank in range(world_size):
            for box in layout.boxes(entry.shape, rank):
                if not box.inside(entry.shape):
                    raise GeometryError(f"{entry.fqn}: target box {box} of rank {rank} lies outside {list(entry.shape)}")
                holders.setdefault(box, []).append(rank)
        # An empty box that starts where a non-empty one does holds nothing, and would share the
        # non-empty one's metadata key (fqn + offsets): leave it out.
        starts = {box.offsets for box in holders if not box.is_empty}
        for box, ranks in holders.items():
            if box.is_empty and box.offsets in starts:
                continue
            if len(ranks) == 1:
                owned[ranks[0]].append((entry, box))
                load[ranks[0]] += box.volume * entry.dtype.itemsize
            else:
                shared.append((-(box.volume * entry.dtype.itemsize), order, entry, box, ranks))
            order += 1
    for neg_bytes, _, entry, box, ranks in sorted(shared, key=lambda s: (s[0], s[1])):
        owner = min(ranks, key=lambda r: (load[r], r))
        owned[owner].append((entry, box))
        load[owner] -= neg_bytes
    return owned


def make_plan(index: CheckpointIndex, layout_of: Callable[[TensorEntry], TargetLayout], world_size: int,
              *, names: Iterable[str] | None = None, ranks: Iterable[int] | None = None,
              dtype_spelling: Callable[[DType], str] = lambda d: d.torch,
              cast_to: DType | None = None, casts: dict[str, DType] | None = None) -> Plan:
    """Plan resharding `index` onto `world_size` target ranks laid out by `layout_of`.

    `names` restricts the tensors and values carried over (default: all); `ranks` restricts the
    files planned for copying (fan-out), while the metadata always describes every rank.
    `cast_to` casts floating tensors, `casts` (fqn -> dtype) single ones, over `cast_to`;
    `dtype_spelling` writes dtypes as torch or MindSpore does.

    Raises:
        GeometryError: a target box lies outside its tensor, or the source does not cover it.
    """
    wanted = set(index.tensors) | set(index.values) if names is None else set(names)
    tensors = [e for fqn, e in index.tensors.items() if fqn in wanted]
    owned = _assign_owners(tensors, layout_of, world_size)
    finders: dict[str, ChunkFinder] = {}
    producing = set(range(world_size)) if ranks is None else set(ranks)
    files: list[TargetFile] = []
    state: dict = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    chunk_lists: dict[str, list[ChunkStorageMetadata]] = {e.fqn: [] for e in tensors}
    order = {e.fqn: i for i, e in enumerate(tensors)}
    for rank in range(world_size):
        items = sorted(owned.get(rank, []), key=lambda item: (order[item[0].fqn], item[1].offsets))
        if not items:
            continue
        name = f"_rank{rank}_.safetensors"
        keys = _physical_keys([(entry.fqn, box) for entry, box in items])
        target = TargetFile(rank, name)
        for (entry, box), key in zip(items, keys):
            position = len(chunk_lists[entry.fqn])
            chunk_lists[entry.fqn].append(ChunkStorageMetadata(box.offsets, box.sizes))
            storage[MetadataIndex(entry.fqn, box.offsets, position)] = StorageInfo(name, 0, -1, key)
            if rank in producing:
                out = _out_dtype(entry.dtype, casts.get(entry.fqn, cast_to) if casts else cast_to)
                target.tensors.append(TargetTensor(entry.fqn, key, out, box, _pieces(entry, box, finders),
                                                   source_dtype=entry.dtype if out != entry.dtype else None))
        if rank in producing:
            files.append(target)
    for entry in tensors:
        state[entry.fqn] = TensorStorageMetadata(
            TensorProperties(dtype_spelling(_out_dtype(entry.dtype, casts.get(entry.fqn, cast_to) if casts else cast_to))),
            tuple(entry.shape), chunk_lists[entry.fqn])
    # Values are decoded (safely) and pickled again with protocol 4, as HyperParallel writes them:
    # the same bytes whatever the source format, and PyTorch DCP's torch.save records become pickles.
    values = [(fqn, pickle.dumps(index.decode_value(fqn), protocol=4)) for fqn in index.values if fqn in wanted]
    values_rank = 0
    position = 0
    for fqn, payload in values:
        state[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = StorageInfo(f"_rank{values_rank}_.bytes", position, len(payload))
        position += len(payload)
    planner_data = {fqn: path for fqn, path in (index.planner_data or {}).items() if fqn in state} or None
    metadata = Metadata(state, planner_data=planner_data, storage_data=storage)
    return Plan(world_size, files, values, values_rank, metadata, tuple(sorted(producing)))


def _out_dtype(dtype: DType, cast_to: DType | None) -> DType:
    from hpckpt.core.cast import CASTABLE

    return cast_to if cast_to is not None and dtype.name in CASTABLE else dtype


def _pieces(entry: TensorEntry, box: Box, finders: dict[str, ChunkFinder]) -> tuple[Piece, ...]:
    finder = finders.get(entry.fqn) or finders.setdefault(entry.fqn, ChunkFinder(entry.chunks))
    pieces = tuple(finder.overlapping(box))
    covered = sum(p.region.volume for p in pieces)
    if covered != box.volume:
        raise GeometryError(f"{entry.fqn}: the source covers {covered} of the {box.volume} elements of {box}")
    return pieces


def plan_whole_tensors(index: CheckpointIndex, names: list[str], *, max_file_bytes: int | None = None,
                       file_names: Callable[[int, int], str] = lambda i, n: "model.safetensors",
                       cast_to: DType | None = None, casts: dict[str, DType] | None = None) -> list[TargetFile]:
    """Plan consolidated files: every tensor whole under its own name, in `names` order.

    With `max_file_bytes`, tensors are packed greedily into files of at most that size (a tensor
    larger than the cap gets a file of its own), as Hugging Face's sharding does; `file_names(i, n)`
    names file i of n. `cast_to` casts floating tensors (others keep their dtype); `casts`
    (fqn -> dtype) casts single ones, over `cast_to`.
    """
    from hpckpt.core.box import full_box

    finders: dict[str, ChunkFinder] = {}
    groups: list[list[TargetTensor]] = [[]]
    size = 0
    for fqn in names:
        entry = index.tensors[fqn]
        dtype = _out_dtype(entry.dtype, casts.get(fqn, cast_to) if casts else cast_to)
        box = full_box(entry.shape)
        tensor = TargetTensor(fqn, fqn, dtype, box, _pieces(entry, box, finders),
                              source_dtype=entry.dtype if dtype != entry.dtype else None)
        if max_file_bytes is not None and groups[-1] and size + tensor.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    return [TargetFile(0, file_names(i, len(groups)), group) for i, group in enumerate(groups)]
