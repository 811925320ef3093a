"""hpckpt inside torch.distributed.checkpoint: a `StorageReader` and a `StorageWriter` for torch's
own `dcp.load` and `dcp.save`, as s3torchconnector plugs its storage into them.

    import torch.distributed.checkpoint as dcp
    from hpckpt.dist.torch_storage import HpckptReader, HpckptWriter

    dcp.load(state_dict, storage_reader=HpckptReader("ckpt/any-format"))
    dcp.save(state_dict, storage_writer=HpckptWriter("ckpt/step100"))

`HpckptReader` gives torch the metadata of any checkpoint hpckpt reads (HyperParallel current and
legacy, PyTorch DCP, MindSpore `.ckpt`, safetensors and Hugging Face sharded, torch.save): each
tensor's stored chunks. torch's planner then asks for the overlaps of its targets with them, and
each is read with ranged reads into the target (`core.io.read.read_box`). A value is decoded by
hpckpt's safe unpickler and handed to torch's planner as a torch.save record hpckpt wrote of it;
torch's `torch.load(weights_only=False)` never meets a checkpoint's own pickle.

`HpckptWriter` writes what torch's planner decides (its de-dup, its items) as PyTorch DCP, through
hpckpt's writer and engine: every rank's `__{rank}_0.distcp` into a staging directory beside the
destination, fsynced and hashed as written, then the coordinator writes `.metadata` and the
manifest and renames the directory into place. Until then nothing at the destination loads.

This module imports torch (the only other one that does is `frameworks.torch_tensors`); `import
hpckpt.dist` does not import it.
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                   WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from hpckpt.converters import open_index
from hpckpt.converters.base import WriterOptions
from hpckpt.converters.torch_dcp.reader import TorchDcpReader
from hpckpt.converters.torch_dcp.writer import TorchDcpWriter, distcp_name, value_archive
from hpckpt.core.commit.staging import Staging, shared_staging
from hpckpt.core.errors import EntryMismatchError, HpckptError, UnsupportedDTypeError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.plan import PlannedValue, plan_as_given
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.io.read import OpenFiles, read_box
from hpckpt.core.io.write import WriteSettings, fill, lay_out
from hpckpt.core.safety.unpickle import reading_own_output
from hpckpt.dist import manifest_parts
from hpckpt.dist.frameworks import torch_tensors

__all__ = ["HpckptReader", "HpckptWriter"]


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


class HpckptReader(StorageReader):
    """torch's `StorageReader` over any checkpoint hpckpt reads, with ranged reads."""

    def __init__(self, path: str | os.PathLike | None = None):
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.index = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)
        self.index = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.exists(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise ValueError("HpckptReader needs the checkpoint's path (HpckptReader(path) or checkpoint_id=)")
        self.index = index = open_index(self.path)
        state: dict[str, Any] = {}
        for fqn, entry in index.tensors.items():
            boxes = list(dict.fromkeys(chunk.box for chunk in entry.chunks))  # a replica is one chunk to torch
            state[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=_torch_dtype(entry.dtype, fqn)), torch.Size(entry.shape),
                [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in boxes])
        for fqn in index.values:
            state[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=state, planner_data=dict(index.planner_data or {}) or None)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.index is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        index = self.index
        with OpenFiles() as files:
            for item in plan.items:
                fqn = item.storage_index.fqn
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(self._record(planner, item.dest_index.fqn, fqn)))
                    continue
                entry = index.tensors[fqn]
                chunk_at = item.storage_index.offset or (0,) * len(entry.shape)
                box = Box(tuple(int(c) + int(o) for c, o in zip(chunk_at, item.storage_offsets)),
                          tuple(int(n) for n in item.lengths))
                target = planner.resolve_tensor(item).detach()
                view = torch_tensors.direct_view(target, entry.dtype)
                if view is not None:
                    read_box(index, entry, box, files, out=view.reshape(box.sizes))
                else:
                    torch_tensors.fill(target, read_box(index, entry, box, files), entry.dtype)
                planner.commit_tensor(item, target)
        return _done()

    def _record(self, planner: LoadPlanner, dest: str, fqn: str) -> bytes:
        """The value as a torch.save record of hpckpt's making: decoded safely, written again (an
        io.BytesIO when the target is one: hpckpt's readers give its content as bytes)."""
        value = self.index.decode_value(fqn)
        targets = getattr(planner, "state_dict", None)  # the default planner's flattened targets
        target = targets.get(dest) if isinstance(targets, dict) else None
        if isinstance(target, io.BytesIO) and isinstance(value, (bytes, bytearray)):
            value = io.BytesIO(value)
        try:
            return value_archive(fqn, value)
        except TypeError as exc:
            raise EntryMismatchError(f"{fqn}: a {type(value).__name__} value cannot be handed to torch: {exc}") \
                from None


def _torch_dtype(dtype, fqn: str) -> torch.dtype:
    found = getattr(torch, dtype.name, None)
    if not isinstance(found, torch.dtype):
        raise UnsupportedDTypeError(f"{fqn}: torch has no dtype {dtype.name}")
    return found


class HpckptWriter(StorageWriter):
    """torch's `StorageWriter` writing PyTorch DCP through hpckpt's writer and engine, with
    hpckpt's manifest and atomic commit (`hpckpt verify --deep` checks what it wrote)."""

    def __init__(self, path: str | os.PathLike | None = None, *, sync: bool = True):
        super().__init__()
        self.path = Path(path).absolute() if path is not None else None
        self.sync = sync
        self.rank, self.is_coordinator = 0, True
        self.staging: Staging | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id).absolute()
        self._release()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int | None = None,
                              use_collectives: bool = True, **kwargs: Any) -> None:
        if self.path is None:
            raise ValueError("HpckptWriter needs the destination (HpckptWriter(path) or checkpoint_id=)")
        world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
        if not use_collectives and world > 1:
            raise ValueError("HpckptWriter commits one checkpoint for every rank: use_collectives=False is not "
                             "supported (hpckpt.dist.save(..., coordination='none') writes rank-local metadata)")
        self.is_coordinator = is_coordinator
        self.rank = rank if rank is not None else (tdist.get_rank() if world > 1 else 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator opens the shared staging directory (the destination locked; what a
        killed save left removed) before any rank writes."""
        self._release()
        stale = _open_stagings.pop(self.path, None)  # a failed save's (torch calls no finish then)
        if stale is not None:
            stale.close()
        self.staging = Staging(self.path, force=True, sync=self.sync, parents=True, shared=True)
        _open_stagings[self.path] = self.staging
        return [replace(p, storage_data=rank) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """This rank's items as `__{rank}_0.distcp` in the staging directory, through the engine."""
        rank, directory = self.rank, shared_staging(self.path)
        tensors: dict[str, tuple] = {}
        pieces: dict[str, list] = {}
        payloads: dict[str, bytes] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                payloads[fqn] = planner.resolve_data(item).getvalue()
                continue
            data = item.tensor_data
            t = planner.resolve_data(item).detach()
            dtype = torch_tensors.dtype_of(t, fqn)
            box = Box(tuple(int(o) for o in data.chunk.offsets), tuple(int(n) for n in data.chunk.sizes))
            tensors.setdefault(fqn, (dtype, tuple(int(n) for n in data.size), []))[2].append((rank, box))
            pieces.setdefault(fqn, []).append((box, torch_tensors.to_numpy(t.contiguous(), copy=False)))
        local = plan_as_given(tensors, rank + 1, values=[PlannedValue(f, rank) for f in payloads], producing=(rank,))
        writer = TorchDcpWriter(WriterOptions(framework="torch"), payloads=payloads)
        layout = lay_out(local, {}, writer)
        source = memory_index({f: MemoryTensor(tensors[f][0], tensors[f][1], p) for f, p in pieces.items()},
                              framework="torch")
        done, _finished = fill(layout, source, writer, directory, WriteSettings(sync=self.sync))
        manifest_parts.write_part(directory, rank, done.files, with_summary=True)
        stored = {(s.fqn, s.offsets): s for s in writer.stored_items()}
        results = []
        for item in plan.items:
            offsets = None if item.type == WriteItemType.BYTE_IO else tuple(int(o) for o in item.index.offset)
            s = stored[(item.index.fqn, offsets)]
            results.append(WriteResult(index=item.index, size_in_bytes=s.length,
                                       storage_data=_StorageInfo(s.file, s.offset, s.length)))
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator: every reported file there, `.metadata` (torch's own, as torch's
        FileSystemWriter pickles it), the manifest, one rename."""
        if self.staging is None:
            raise HpckptError("HpckptWriter.finish: no staging directory (prepare_global_plan did not run here)")
        staging = self.staging.path
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        expected = {distcp_name(rank) for rank, rank_results in enumerate(results) if rank_results}
        for name in sorted(expected):
            if not (staging / name).exists():
                raise HpckptError(f"{name}: missing from the staging directory; nothing was committed")
        data = pickle.dumps(metadata, protocol=4)
        self.staging.write_metadata(((".metadata", data),))
        with reading_own_output():
            written = TorchDcpReader().read_index(staging)  # as a loader will read it
        manifest_parts.write_manifest(staging, format_name="torch-dcp", world_size=len(results),
                                      files=manifest_parts.read_summaries(staging, len(results)),
                                      metadata=((".metadata", data),), written=written)
        self.staging.commit()
        self._release()

    def _release(self) -> None:
        if self.staging is not None:
            self.staging.close()  # removes it unless committed; releases the lock
            if _open_stagings.get(self.path) is self.staging:
                del _open_stagings[self.path]
            self.staging = None


#: destination -> the staging directory a coordinator holds open (and locked) for it. A save that
#: failed on some rank never reaches `finish`, so its staging directory stays locked until the
#: next save to that destination in this process, from any writer object, releases and removes it.
_open_stagings: dict[Path, Staging] = {}
