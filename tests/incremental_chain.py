"""Incremental HyperParallel checkpoints built as HyperParallel's "2.0" writer builds them
(`FileSystemWriter(incremental_from=, changed_fqns=)`, format delta A4): the changed entries are
written into the new step directory, every unchanged entry keeps its baseline `StorageInfo` with
`relative_path` recomputed against the new directory (`../global_step_100/_rank0_.safetensors`, one
hop however long the chain), `tensor_key` unset (that line keys tensors by name),
`MetadataIndex.index` kept, and `Metadata.version = "2.0"`. Used by test_incremental and by the
object-store tests."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
from hpckpt.converters.hyperparallel.reader import _read_pickle
from hpckpt.core import dtypes
from hpckpt.core.codecs.hyperparallel_metadata import StorageInfo, dumps_metadata
from hpckpt.core.geometry.box import Box

SHAPES = {"w": ((8, 4), np.float32), "b": ((4,), np.float32), "e": ((6, 2), np.int64)}


def full(step: int) -> dict[str, np.ndarray]:
    return {name: (np.arange(np.prod(shape)).reshape(shape) * step).astype(dtype)
            for name, (shape, dtype) in SHAPES.items()}


def write(root: Path, arrays: dict[str, np.ndarray], step: int) -> None:
    """A full 2-rank checkpoint of `arrays` (row-split, as FSDP does) and the value `step`."""
    tensors = {}
    for name, array in arrays.items():
        dtype = dtypes.from_numpy(array.dtype)
        if array.ndim == 1:  # replicated, stored once by rank 0
            tensors[name] = (dtype, array.shape, [ChunkData(0, Box((0,), array.shape), array.tobytes())])
            continue
        half = array.shape[0] // 2
        tensors[name] = (dtype, array.shape, [
            ChunkData(r, Box((r * half, 0), (half, array.shape[1])), array[r * half:(r + 1) * half].tobytes())
            for r in range(2)])
    write_checkpoint(root, tensors, {"step": (0, step)})


def incremental(parent: Path, name: str, baseline: str, changed: dict[str, np.ndarray], step: int) -> None:
    """`parent/name`: the baseline's entries, those in `changed` (and the value `step`) written anew."""
    scratch = parent / f".scratch-{name}"
    write(scratch, changed, step)
    base, new = _read_pickle(parent / baseline, ".metadata"), _read_pickle(scratch, ".metadata")
    storage = {}
    for key, info in base.storage_data.items():
        if key.fqn in changed or key.fqn == "step":
            continue
        path = info.relative_path if info.relative_path.startswith("../") else f"../{baseline}/{info.relative_path}"
        storage[key] = StorageInfo(path, info.offset, info.length, None)
    for key, info in new.storage_data.items():
        storage[key] = StorageInfo(info.relative_path, info.offset, info.length, None)
    state = dict(base.state_dict_metadata)
    state.update(new.state_dict_metadata)
    (parent / name).mkdir()
    for f in scratch.iterdir():
        if f.name.startswith("_rank"):
            f.rename(parent / name / f.name)
    shutil.rmtree(scratch)
    (parent / name / ".metadata").write_bytes(
        dumps_metadata(replace(base, state_dict_metadata=state, storage_data=storage, version="2.0")))


def build_chain(parent: Path) -> Path:
    """global_step_100 (full), _200 (w changed), _300 (b changed): _300 reads w from _200, e from
    _100; returns `parent`."""
    write(parent / "global_step_100", full(100), 100)
    incremental(parent, "global_step_200", "global_step_100", {"w": full(200)["w"]}, 200)
    incremental(parent, "global_step_300", "global_step_200", {"b": full(300)["b"]}, 300)
    return parent


def expected() -> dict[str, np.ndarray]:
    return {"w": full(200)["w"], "b": full(300)["b"], "e": full(100)["e"]}
