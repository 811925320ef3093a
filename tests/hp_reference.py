"""An independent HyperParallel reference writer, shared by the tests.

Stand-in dataclasses with HyperParallel's class names, field lists and module paths (field lists
from the format spec, section 3.2), pickled by the stock pickler; data files are written by the
`safetensors` library. Nothing here uses hpckpt's own writer (`hpckpt.core.codecs.hyperparallel_metadata.dumps_metadata`
and the converters), so a bug in hpckpt's writer cannot hide a bug in hpckpt's reader or in
`hpckpt verify`: the tests that read or verify checkpoints written here would otherwise share the
writer's mistakes. Tests import it by plain name, like `_util`: `from hp_reference import write_hp`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _util import FIXTURES
from safetensors.numpy import save_file

HP_META = "hyper_parallel.core.distributed_checkpoint.metadata"
HP_STORAGE = "hyper_parallel.core.distributed_checkpoint.storage"
LEGACY_META = "hyper_parallel.core.checkpoint.metadata"  # older HyperParallel; read, never written
LEGACY_STORAGE = "hyper_parallel.core.checkpoint.storage"


@dataclass(frozen=True)
class ChunkStorageMetadata:
    offsets: tuple
    sizes: tuple


@dataclass(frozen=True)
class TensorProperties:
    dtype: str
    requires_grad: bool = False
    memory_format: Any = None


@dataclass(frozen=True)
class TensorStorageMetadata:
    properties: TensorProperties
    size: tuple
    chunks: list = field(default_factory=list)


@dataclass
class BytesStorageMetadata:
    pass


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: tuple = ()
    index: Any = field(default=None, compare=False, hash=False)


@dataclass
class StorageInfo:
    relative_path: str
    offset: int
    length: int
    tensor_key: Any = None


@dataclass
class Metadata:
    state_dict_metadata: dict
    planner_data: Any = None
    storage_data: Any = None
    version: str = "1.0"


HP_CLASSES = {
    HP_META: (Metadata, TensorStorageMetadata, TensorProperties, ChunkStorageMetadata,
              BytesStorageMetadata, MetadataIndex),
    HP_STORAGE: (StorageInfo,),
}
for _module, _classes in HP_CLASSES.items():
    for _cls in _classes:
        _cls.__module__ = _module


@contextlib.contextmanager
def hp_modules():
    """Make the stand-ins importable under HyperParallel's current module names, for this block only.

    Needed to pickle them (the pickler checks that each class can be found under its module name)
    and to unpickle such a pickle with the stock unpickler.
    """
    names = ["hyper_parallel", "hyper_parallel.core", "hyper_parallel.core.distributed_checkpoint", *HP_CLASSES]
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    for module, classes in HP_CLASSES.items():
        for cls in classes:
            setattr(sys.modules[module], cls.__name__, cls)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def dump_hp(metadata: Any) -> bytes:
    """`metadata` pickled by the stock pickler at protocol 4, naming HyperParallel's modules."""
    with hp_modules():
        return pickle.dumps(metadata, protocol=4)


def write_hp(root: Path, tensors: dict, values: dict | None = None, planner_data: Any = None) -> Path:
    """Write a HyperParallel checkpoint into `root` and return `root`.

    tensors: fqn -> (dtype string, global shape, [(file, key, offsets, array[, sizes])]) where
    `sizes` (default: the array's shape) is what the metadata claims;
    values: fqn -> (file, payload bytes);
    planner_data: the Metadata's planner_data (default: fqn -> (fqn,) for every entry).
    """
    root.mkdir(parents=True, exist_ok=True)
    state: dict = {}
    storage: dict = {}
    files: dict[str, dict[str, np.ndarray]] = {}
    for fqn, (dtype, shape, chunks) in tensors.items():
        metas = []
        for i, (file, key, offsets, array, *sizes) in enumerate(chunks):
            files.setdefault(file, {})[key] = np.ascontiguousarray(array)
            metas.append(ChunkStorageMetadata(tuple(offsets), tuple(sizes[0] if sizes else array.shape)))
            storage[MetadataIndex(fqn, tuple(offsets), i)] = StorageInfo(file, 0, -1, key)
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype), tuple(shape), metas)
    for file, content in files.items():
        save_file(content, str(root / file))
    for fqn, (file, payload) in (values or {}).items():
        path = root / file
        offset = path.stat().st_size if path.exists() else 0
        with open(path, "ab") as f:
            f.write(payload)
        state[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = StorageInfo(file, offset, len(payload))
    if planner_data is None:
        planner_data = {fqn: (fqn,) for fqn in state}
    (root / ".metadata").write_bytes(dump_hp(Metadata(state, planner_data, storage)))
    return root


def copy_fixture(name: str, dest: Path) -> Path:
    """A writable copy of a read-only fixture."""
    shutil.copytree(FIXTURES / name, dest, copy_function=shutil.copyfile)
    os.chmod(dest, 0o755)
    return dest
