"""Which bytes of which file are each stored box: what `verify --deep` and `hpckpt checksum`
hash, read from the index alone (a box is dense when its chunk is one contiguous run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hpckpt.core.commit import manifest
from hpckpt.core.errors import HpckptError
from hpckpt.core.index import BufferLocation, CheckpointIndex, Chunk, Location



@dataclass(frozen=True)
class StoredBox:
    """A stored chunk whose bytes are one dense C-order run of its file: what a manifest box is."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    extents: tuple[tuple[int, int], ...]


@dataclass
class StoredBoxes:
    """Per data file, its boxes in file order, and the chunks only its file digest covers
    (`(fqn, reason)`: strided, or bytes shared with another chunk)."""

    boxes: dict[str, list[StoredBox]] = field(default_factory=dict)
    digest_only: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def _dense(loc: Location, chunk: Chunk) -> bool:
    """The chunk's bytes are one C-order run (a box's digest is taken in file order)."""
    if int(np.prod(loc.stored_shape, dtype=np.int64)) != chunk.box.volume:
        return False
    if loc.strides is None:
        return True
    expected, step = [], 1
    for s in reversed(loc.stored_shape):
        expected.append(step)
        step *= max(s, 1)
    return all(z <= 1 or s == e for z, s, e in zip(loc.stored_shape, loc.strides, reversed(expected)))


def located_chunks(index: CheckpointIndex, skip: set[str]):
    """`(entry, chunk, location)` of every stored chunk a deep check reads: of a dtype hpckpt
    reads, not empty, inside its tensor, not in a file of `skip`, and locatable (the structural
    checks report the others)."""
    for entry in index.tensors.values():
        if entry.dtype.refusal is not None:
            continue
        for chunk in entry.chunks:
            if chunk.file in skip or chunk.box.is_empty or not chunk.box.inside(entry.shape):
                continue
            try:
                loc = index.locate(chunk, entry)
            except HpckptError:
                continue
            yield entry, chunk, loc


def stored_boxes(index: CheckpointIndex, skip: set[str] = frozenset()) -> StoredBoxes:
    """The boxes of every data file as its metadata lists them (chunks of files in `skip`, and
    chunks that cannot be located, are left out: the structural checks report those)."""
    out = StoredBoxes()
    candidates: dict[str, list[tuple[int, int, StoredBox]]] = {}
    for entry, chunk, loc in located_chunks(index, skip):
        if isinstance(loc, BufferLocation):
            continue
        nbytes = chunk.box.volume * entry.dtype.itemsize
        if not _dense(loc, chunk):
            out.digest_only.setdefault(chunk.file, []).append((entry.fqn, "strided"))
            continue
        box = StoredBox(entry.fqn, tuple(chunk.box.offsets), tuple(chunk.box.sizes), ((loc.offset, nbytes),))
        candidates.setdefault(chunk.file, []).append((loc.offset, nbytes, box))
    for name, runs in candidates.items():
        runs.sort(key=lambda r: (r[0], r[1]))
        distinct: list[tuple[int, int, StoredBox]] = []
        for offset, nbytes, box in runs:
            if distinct and distinct[-1][:2] == (offset, nbytes):  # a replica stored once, listed twice
                out.digest_only.setdefault(name, []).append((box.fqn, "the same bytes as another chunk"))
            else:
                distinct.append((offset, nbytes, box))
        shared, active = set(), []  # `active`: earlier runs that end after the current start
        for i, (offset, nbytes, _) in enumerate(distinct):
            active = [j for j in active if distinct[j][0] + distinct[j][1] > offset]
            if active:
                shared.update(active)
                shared.add(i)
            active.append(i)
        for i, (_, _, box) in enumerate(distinct):
            if i in shared:
                out.digest_only.setdefault(name, []).append((box.fqn, "bytes overlap another chunk's"))
        out.boxes[name] = [box for i, (_, _, box) in enumerate(distinct) if i not in shared]
    return out


def metadata_names(index: CheckpointIndex) -> list[str]:
    """The files besides the data files that hold what the checkpoint is: its metadata files
    and the values sidecar (a manifest records their digests)."""
    values = {v.file for v in index.values.values()} - set(index.data_files)
    return sorted((set(index.metadata_files) | values) - {manifest.NAME})
