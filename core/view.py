"""A renamed (and partly transposed) view of a `CheckpointIndex`, for name mapping in `convert`.

The engine only ever sees an index; mapping names onto the other framework's is therefore done
here, once, by presenting the same stored chunks under new names. A transposed tensor is the same
bytes seen through permuted strides: its chunks' boxes are permuted and its locations carry the
permuted strides, so every reader and writer handles it without knowing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hpckpt.core.codecs.torch_records import contiguous_strides
from hpckpt.core.geometry.box import Box
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry


def _permute(values: tuple[int, ...], perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(values[p] for p in perm)


def _unpermute(values: tuple[int, ...], perm: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, p in enumerate(perm):
        out[p] = values[i]
    return tuple(out)


class _ViewLocator:
    """Maps a view's chunk back to the source's, and permutes the location of a transposed one."""

    def __init__(self, inner: Any, source: CheckpointIndex, origin: dict[str, str],
                 transposes: dict[str, tuple[int, ...]]):
        self.inner, self.source, self.origin, self.transposes = inner, source, origin, transposes

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        original = self.source.tensors[self.origin[entry.fqn]]
        perm = self.transposes.get(entry.fqn)
        if perm is None:
            return self.inner.locate(chunk, original)
        box = Box(_unpermute(chunk.box.offsets, perm), _unpermute(chunk.box.sizes, perm))
        loc = self.inner.locate(Chunk(box, chunk.file, chunk.key), original)
        strides = loc.strides if loc.strides is not None else contiguous_strides(loc.stored_shape)
        return replace(loc, stored_shape=_permute(loc.stored_shape, perm), strides=_permute(strides, perm))

    def decode_value(self, entry: ValueEntry) -> Any:
        return self.inner.decode_value(self.source.values[self.origin[entry.fqn]])

    def file_problems(self, relative: str) -> list[str]:
        return self.inner.file_problems(relative)


def _chunks_seen_through(entry: TensorEntry, perm: tuple[int, ...] | None) -> list[Chunk]:
    if perm is None:
        return entry.chunks
    return [Chunk(Box(_permute(c.box.offsets, perm), _permute(c.box.sizes, perm)), c.file, c.key) for c in entry.chunks]


def renamed_view(index: CheckpointIndex, renames: dict[str, str],
                 transposes: dict[str, tuple[int, ...]] | None = None) -> CheckpointIndex:
    """`index` with entry `src` presented as `renames[src]` (absent: unchanged) and, for a source
    name in `transposes`, its dims permuted (`new_shape[i] = shape[perm[i]]`). Entries renamed
    to None are left out. Order follows the source."""
    transposes = transposes or {}
    origin: dict[str, str] = {}
    view_transposes: dict[str, tuple[int, ...]] = {}
    tensors: dict[str, TensorEntry] = {}

    def kept(entries: dict):
        """(new name, entry) of the entries not renamed to None, recording where each came from."""
        for fqn, entry in entries.items():
            new = renames.get(fqn, fqn)
            if new is not None:
                origin[new] = fqn
                yield new, entry

    for new, entry in kept(index.tensors):
        fqn = origin[new]
        perm = transposes.get(fqn)
        if perm is not None and perm != tuple(range(len(entry.shape))):
            if sorted(perm) != list(range(len(entry.shape))):
                raise ValueError(f"{fqn}: transpose {list(perm)} is not a permutation of its {len(entry.shape)} dims")
            view_transposes[new] = perm
        else:
            perm = None
        tensors[new] = TensorEntry(new, entry.dtype, _permute(entry.shape, perm) if perm else entry.shape,
                                   dtype_spelling=entry.dtype_spelling, n_chunks=entry.n_chunks,
                                   build=lambda entry=entry, perm=perm: _chunks_seen_through(entry, perm))
    values = {new: replace(entry, fqn=new) for new, entry in kept(index.values)}
    planner_data = None
    if index.planner_data:  # a renamed entry's nesting path no longer holds: it goes flat
        planner_data = {k: v for k, v in index.planner_data.items() if renames.get(k, k) == k}
    return replace(index, tensors=tensors, values=values, planner_data=planner_data,
                   locator=_ViewLocator(index.locator, index, origin, view_transposes))
