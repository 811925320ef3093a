"""A checkpoint index over arrays in memory: the second kind of source the engine copies from.

A running job saving its state, counters computed during a conversion, a test writing a known
tensor: each is a set of boxes held in memory rather than in files. Presented as a
`CheckpointIndex` whose chunks resolve to `BufferLocation`s, they go through the same plan,
writers, engine and commit as a checkpoint on disk, so no format needs to know where its bytes
come from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.core.dtypes import DType
from hpckpt.core.errors import EntryMismatchError
from hpckpt.core.geometry.box import Box, full_box
from hpckpt.core.index import BufferLocation, CheckpointIndex, Chunk, TensorEntry, ValueEntry

MEMORY = "<memory>"  # the `file` of every in-memory chunk


@dataclass(frozen=True)
class MemoryTensor:
    """A tensor of global `shape` whose stored boxes are `chunks` of `(box, array)`; each array
    has its box's shape and the numpy storage of `dtype` (raw bits for bfloat16 and float8)."""

    dtype: DType
    shape: tuple[int, ...]
    chunks: Sequence[tuple[Box, np.ndarray]]

    @classmethod
    def whole(cls, dtype: DType, array: np.ndarray) -> "MemoryTensor":
        return cls(dtype, tuple(array.shape), [(full_box(tuple(array.shape)), array)])


class MemoryLocator:
    """Chunks are keyed by their position in the tensor's list; values are kept as objects."""

    def __init__(self, tensors: Mapping[str, MemoryTensor], values: Mapping[str, Any]):
        self.tensors, self.values = tensors, values

    def locate(self, chunk: Chunk, entry: TensorEntry) -> BufferLocation:
        box, array = self.tensors[entry.fqn].chunks[int(chunk.key)]
        if tuple(array.shape) != tuple(box.sizes) or array.dtype.itemsize != entry.dtype.itemsize:
            raise EntryMismatchError(f"{entry.fqn}: the array of chunk {box} is {array.dtype}{list(array.shape)}, "
                                     f"not {entry.dtype}{list(box.sizes)}")
        return BufferLocation(array.view(entry.dtype.np), entry.dtype)

    def decode_value(self, entry: ValueEntry) -> Any:
        return self.values[entry.fqn]

    def file_problems(self, relative: str) -> list[str]:
        return []


def memory_index(tensors: Mapping[str, MemoryTensor], values: Mapping[str, Any] | None = None, *,
                 framework: str | None = None, planner_data: Mapping[str, tuple] | None = None,
                 root: Path | None = None) -> CheckpointIndex:
    """An index over `tensors` and the plain Python `values`, in the order given."""
    values = dict(values or {})
    entries = {
        fqn: TensorEntry(fqn, t.dtype, tuple(t.shape),
                         [Chunk(box, MEMORY, str(i)) for i, (box, _array) in enumerate(t.chunks)],
                         t.dtype.torch if framework != "mindspore" else (t.dtype.ms_spelling or t.dtype.torch))
        for fqn, t in tensors.items()
    }
    return CheckpointIndex(
        root=root or Path("."),
        format="memory",
        format_version="1",
        framework=framework,
        tensors=entries,
        values={fqn: ValueEntry(fqn, MEMORY, 0, 0, "inline") for fqn in values},
        data_files=[],
        locator=MemoryLocator(dict(tensors), values),
        planner_data=dict(planner_data) if planner_data else None,
    )


class _Combined:
    """The chunks of `extra` tensors from memory, every other one from the source's locator."""

    def __init__(self, inner: Any, memory: MemoryLocator):
        self.inner, self.memory = inner, memory

    def locate(self, chunk: Chunk, entry: TensorEntry):
        if chunk.file == MEMORY and entry.fqn in self.memory.tensors:
            return self.memory.locate(chunk, entry)
        return self.inner.locate(chunk, entry)

    def decode_value(self, entry: ValueEntry) -> Any:
        return self.inner.decode_value(entry)

    def file_problems(self, relative: str) -> list[str]:
        return [] if relative == MEMORY else self.inner.file_problems(relative)


def with_memory_tensors(index: CheckpointIndex, tensors: Mapping[str, MemoryTensor]) -> CheckpointIndex:
    """`index` plus `tensors` held in memory (added after its own, replacing none)."""
    extra = memory_index(tensors, framework=index.framework)
    return replace(index, tensors={**index.tensors, **extra.tensors},
                   locator=_Combined(index.locator, extra.locator))
