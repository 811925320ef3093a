"""Write a small HyperParallel DCP checkpoint from in-memory chunks (examples, tests, benchmarks).

Everything is held in memory, so this is for small checkpoints only; resharding and conversion
stream through the copy engine instead. The files follow HyperParallel's own writer: one
`_rank{r}_.safetensors` and `_rank{r}_.bytes` per rank, keys `fqn` or `fqn.__dcp_chunk_{i}`
when a rank holds several chunks of one tensor, values pickled, chunks listed rank-major with
`MetadataIndex.index` = position, and `.metadata` written last.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpckpt.core import safetensors_io
from hpckpt.core.box import Box
from hpckpt.core.dtypes import DType
from hpckpt.core.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    dumps_metadata,
)


@dataclass(frozen=True)
class ChunkData:
    rank: int
    box: Box
    data: bytes  # C-order little-endian bytes of the box


def _dtype_string(dtype: DType, framework: str) -> str:
    return dtype.mindspore if framework == "mindspore" and dtype.mindspore else dtype.torch


def write_checkpoint(root: Path, tensors: dict[str, tuple[DType, tuple[int, ...], list[ChunkData]]],
                     values: dict[str, tuple[int, Any]] | None = None, framework: str = "torch") -> Metadata:
    """Write a HyperParallel checkpoint into the existing directory `root`; return its Metadata."""
    values = values or {}
    per_rank: dict[int, list[tuple[str, ChunkData]]] = defaultdict(list)
    for fqn, (_dtype, _shape, chunks) in tensors.items():
        starts = {c.box.offsets for c in chunks if not c.box.is_empty}
        for chunk in chunks:
            if chunk.box.is_empty and chunk.box.offsets in starts:
                continue  # holds nothing, and would share the metadata key of the non-empty one
            per_rank[chunk.rank].append((fqn, chunk))
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, StorageInfo] = {}
    chunk_lists: dict[str, list[ChunkStorageMetadata]] = {fqn: [] for fqn in tensors}
    for rank in sorted(per_rank):
        items = per_rank[rank]
        counts: dict[str, int] = defaultdict(int)
        for fqn, _ in items:
            counts[fqn] += 1
        seen: dict[str, int] = defaultdict(int)
        file_name = f"_rank{rank}_.safetensors"
        records = []
        for fqn, chunk in items:
            key = fqn if counts[fqn] == 1 else f"{fqn}.__dcp_chunk_{seen[fqn]}"
            seen[fqn] += 1
            dtype = tensors[fqn][0]
            records.append((key, dtype, chunk.box.sizes, chunk.data))
            position = len(chunk_lists[fqn])
            chunk_lists[fqn].append(ChunkStorageMetadata(chunk.box.offsets, chunk.box.sizes))
            storage[MetadataIndex(fqn, chunk.box.offsets, position)] = StorageInfo(file_name, 0, -1, key)
        safetensors_io.write_file(root / file_name, records,
                                  {"format": "ms"} if framework == "mindspore" else None)
    for fqn, (dtype, shape, _chunks) in tensors.items():
        state[fqn] = TensorStorageMetadata(TensorProperties(_dtype_string(dtype, framework)), tuple(shape), chunk_lists[fqn])
    by_rank: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    for fqn, (rank, value) in values.items():
        by_rank[rank].append((fqn, pickle.dumps(value, protocol=4)))
        state[fqn] = BytesStorageMetadata()
    for rank, payloads in sorted(by_rank.items()):
        file_name = f"_rank{rank}_.bytes"
        position = 0
        with open(root / file_name, "wb") as f:
            for fqn, payload in payloads:
                f.write(payload)
                storage[MetadataIndex(fqn)] = StorageInfo(file_name, position, len(payload))
                position += len(payload)
    metadata = Metadata(state, planner_data={fqn: (fqn,) for fqn in state}, storage_data=storage)
    (root / ".metadata").write_bytes(dumps_metadata(metadata))
    return metadata
