"""HyperParallel DCP laid out as HyperParallel's own writer lays it out, so its loader reads it.

Per storing rank one `_rank{r}_.safetensors` (keys `fqn`, or `fqn.__dcp_chunk_{i}` when the file
holds several chunks of one tensor), values pickled (protocol 4) into `_rank{r}_.bytes`, and
`.metadata` last: chunks listed rank-major with `MetadataIndex.index` = position, dtypes spelled
as torch or MindSpore writes them (`--framework`, default the source's). The world size and
layout written, which file names cannot tell, are in the manifest `core.io.write` adds.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.hyperparallel.reader import KNOWN_VERSIONS
from hpckpt.core.codecs.hyperparallel_metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    dumps_metadata,
)
from hpckpt.core.codecs.hyperparallel_metadata_columns import (
    TensorColumns,
    ValueColumns,
    dumps_metadata_columns,
    fits,
)
from hpckpt.core.codecs.pickle_builder import standalone_pickle
from hpckpt.core.codecs.safetensors_io import encode_header
from hpckpt.core.codecs.torch_records import TorchDevice
from hpckpt.core.dtypes import DType
from hpckpt.core.geometry.plan import Plan, PlannedTensor
from hpckpt.core.io.output import Extent, FileLayout, Finished, OutputLayout, Placement

METADATA_NAME = ".metadata"
COLUMNS_FROM = 50_000  # chunks: from here `.metadata` is written from columns (`finish`)


def tensor_file(rank: int) -> str:
    return f"_rank{rank}_.safetensors"


def values_file(rank: int) -> str:
    return f"_rank{rank}_.bytes"


def physical_keys(fqns: list[str]) -> list[str]:
    """HyperParallel's key rule for the chunks of one file, in file order: the fqn when the file
    holds one chunk of it, else `fqn.__dcp_chunk_{i}`, with `_` appended until the key is unique."""
    counts: dict[str, int] = defaultdict(int)
    for fqn in fqns:
        counts[fqn] += 1
    used = {fqn for fqn in fqns if counts[fqn] == 1}
    seen: dict[str, int] = defaultdict(int)
    keys = []
    for fqn in fqns:
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


def value_payload(value: Any, fqn: str) -> bytes:
    """A value pickled as HyperParallel pickles it (protocol 4); one holding a torch dtype or
    device is pickled naming torch's own globals (`torch.float32`), as torch would, since the
    stock pickler would name hpckpt's stand-ins instead."""
    if _names_torch(value):
        return standalone_pickle(value, fqn)
    return pickle.dumps(value, protocol=4)


def _names_torch(value: Any) -> bool:
    if isinstance(value, (DType, TorchDevice)):
        return True
    if isinstance(value, dict):
        return any(_names_torch(k) or _names_torch(v) for k, v in value.items())
    return isinstance(value, (list, tuple, set)) and any(_names_torch(v) for v in value)


class HyperParallelWriter:
    """`FormatWriter` of HyperParallel DCP (call order in `converters.base`)."""

    def __init__(self, options: WriterOptions, value_lengths: Mapping[str, int] | None = None,
                 payloads: Mapping[str, bytes] | None = None):
        """`value_lengths`: the pickle lengths of values other processes write (a running job's
        ranks each write their own); `payloads`: values this process pickled already (as
        `value_payload` does). `layout` is then given only the values neither covers."""
        self.mindspore = (options.framework or options.source_framework) == "mindspore"
        # the source's metadata version when it is one HyperParallel wrote ("2.0" is a label, the
        # layout is the same: both lines' loaders read either), else the default
        self.version = options.source_version if options.source_version in KNOWN_VERSIONS else "1.0"
        self._plan: Plan | None = None
        self._given: dict[str, bytes] = dict(payloads or {})
        self._payloads: dict[str, bytes] = {}
        self._lengths: dict[str, int] = dict(value_lengths or {})

    def _spelling(self, dtype: DType) -> str:
        return (dtype.ms_spelling or dtype.torch) if self.mindspore else dtype.torch

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        self._plan = plan
        # Values are decoded (safely) and pickled again with protocol 4, as HyperParallel writes
        # them: the same bytes whatever the source format.
        self._payloads = {v.fqn: self._given[v.fqn] if v.fqn in self._given else value_payload(values[v.fqn], v.fqn)
                          for v in plan.values if v.fqn in values or v.fqn in self._given}
        self._lengths.update((fqn, len(p)) for fqn, p in self._payloads.items())
        file_metadata = {"format": "ms"} if self.mindspore else None
        files = []
        for rank, items in plan.by_rank.items():
            if rank not in plan.producing:
                continue
            keys = physical_keys([t.fqn for t, _ in items])
            head, offsets = encode_header([(k, t.dtype, b.box.sizes) for k, (t, b) in zip(keys, items)], file_metadata)
            boxes = tuple(Placement(t, b, (Extent(at, t.box_nbytes(b)),)) for (t, b), at in zip(items, offsets))
            files.append(FileLayout(tensor_file(rank), len(head) + sum(p.nbytes for p in boxes), ((0, head),), boxes))
        for rank in sorted({v.rank for v in plan.values}):
            if rank in plan.producing:
                data = b"".join(self._payloads[v.fqn] for v in plan.values_of(rank))
                files.append(FileLayout(values_file(rank), len(data), ((0, data),)))
        return OutputLayout(tuple(files))

    def expected_files(self, plan: Plan) -> list[str]:
        tensors = [tensor_file(r) for r in plan.storing_ranks if r in plan.producing]
        return sorted(tensors + [values_file(r) for r in {v.rank for v in plan.values} if r in plan.producing])

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        """`.metadata` (the world size and layout written go into the manifest, `core.io.write`):
        pickled as HyperParallel pickles it (the same bytes), or for a plan of `COLUMNS_FROM`
        chunks or more, written from columns (`core.codecs.hyperparallel_metadata_columns`: the
        same objects, in seconds instead of minutes)."""
        assert self._plan is not None, "layout() first"
        if sum(len(t.columns) for t in self._plan.tensors) >= COLUMNS_FROM:
            data = self._columns_metadata()
            if data is not None:
                return Finished(metadata=((METADATA_NAME, data),))
        return Finished(metadata=((METADATA_NAME, dumps_metadata(self.metadata())),))

    def from_global_plan(self, gp) -> tuple[list[str], Finished] | None:
        """A live save's commit from its `GlobalPlan` arrays, with no object per chunk: the files
        expected and `.metadata`, the bytes `layout(gp.plan())` and `finish` give. None where
        that path is needed: fewer than `COLUMNS_FROM` chunks (HyperParallel's own pickler's
        bytes), a file holding several chunks of one tensor (their keys are renamed), an integer
        too large for the columns."""
        if len(gp.tid) < COLUMNS_FROM or np.any(np.diff(gp.tid) < 0):
            return None
        bounds = np.searchsorted(gp.tid, np.arange(len(gp.names) + 1))
        tensors = []
        for t, (fqn, dt, shape) in enumerate(zip(gp.names, gp.dtypes, gp.shapes)):
            lo, hi, ndim = int(bounds[t]), int(bounds[t + 1]), len(shape)
            owners = gp.owner[lo:hi].astype(np.int64)
            if hi - lo > 1 and np.any(np.diff(np.sort(owners)) == 0):
                return None
            tensors.append(TensorColumns(fqn, self._spelling(dt), tuple(shape), gp.offsets[lo:hi, :ndim],
                                         gp.sizes[lo:hi, :ndim], owners, gp.index[lo:hi].astype(np.int64)))
        if not fits(tensors):
            return None
        self._lengths.update(gp.value_lengths)
        values = self._value_columns(gp.values)
        data = dumps_metadata_columns(tensors, values, [tensor_file(r) for r in range(gp.world_size)],
                                      planner_data=gp.key_paths() or None, version=self.version)
        expected = sorted([tensor_file(int(r)) for r in np.unique(gp.owner)] +
                          [values_file(r) for r in {v.rank for v in gp.values}])
        return expected, Finished(metadata=((METADATA_NAME, data),))

    def _columns_metadata(self) -> bytes | None:
        """`metadata()` written from columns; None when an integer does not fit their form."""
        plan = self._plan
        renamed: dict[tuple[str, int], str] = {}  # (fqn, index) -> key, where a file holds several chunks of it
        for rank, items in plan.by_rank.items():
            fqns = [t.fqn for t, _ in items]
            if len(set(fqns)) < len(fqns):
                for key, (tensor, planned) in zip(physical_keys(fqns), items):
                    if key != tensor.fqn:
                        renamed[(tensor.fqn, planned.index)] = key
        tensors = []
        for t in plan.tensors:
            c = t.columns
            index = c.positions()
            keys = [renamed.get((t.fqn, i), t.fqn) for i in index.tolist()] if renamed else None
            tensors.append(TensorColumns(t.fqn, self._spelling(t.dtype), tuple(t.shape), c.offsets, c.sizes, c.ranks,
                                         index, keys))
        if not fits(tensors):
            return None
        files = [tensor_file(r) for r in range(plan.world_size)]
        return dumps_metadata_columns(tensors, self._value_columns(plan.values), files,
                                      planner_data=dict(plan.nesting) or None, version=self.version)

    def _value_columns(self, values) -> list[ValueColumns]:
        """Each value's place in its rank's values file: ranks in order, values in plan order."""
        out = []
        for rank in sorted({v.rank for v in values}):
            position = 0
            for value in (v for v in values if v.rank == rank):
                out.append(ValueColumns(value.fqn, values_file(rank), position, self._lengths[value.fqn]))
                position += self._lengths[value.fqn]
        return out

    def metadata(self) -> Metadata:
        """The `.metadata` of the whole plan (every rank, also when only some are written)."""
        plan = self._plan
        assert plan is not None, "layout() first"
        storage: dict[MetadataIndex, StorageInfo] = {}
        for rank, items in plan.by_rank.items():
            name = tensor_file(rank)
            for key, (tensor, planned) in zip(physical_keys([t.fqn for t, _ in items]), items):
                storage[MetadataIndex(tensor.fqn, planned.box.offsets, planned.index)] = StorageInfo(name, 0, -1, key)
        state: dict[str, Any] = {t.fqn: self._tensor_metadata(t) for t in plan.tensors}
        for value in plan.values:
            state[value.fqn] = BytesStorageMetadata()
        for rank in sorted({v.rank for v in plan.values}):
            position = 0
            for value in plan.values_of(rank):
                length = self._lengths[value.fqn]
                storage[MetadataIndex(value.fqn)] = StorageInfo(values_file(rank), position, length)
                position += length
        return Metadata(state, planner_data=dict(plan.nesting) or None, storage_data=storage, version=self.version)

    def _tensor_metadata(self, tensor: PlannedTensor) -> TensorStorageMetadata:
        chunks = [ChunkStorageMetadata(b.box.offsets, b.box.sizes) for b in tensor.boxes]
        return TensorStorageMetadata(TensorProperties(self._spelling(tensor.dtype)), tuple(tensor.shape), chunks)
