"""HyperParallel's `.metadata` model, with HyperParallel's exact class and field names.

The classes mirror `hyper_parallel.core.distributed_checkpoint.{metadata,storage}` so that a pickle
written by HyperParallel loads into them (through `core.safety.unpickle`) and a pickle written by
`dumps_metadata` loads into HyperParallel. They are plain (not slotted) dataclasses because pickle
restores them by updating `__dict__`, which is also how HyperParallel's own classes are restored.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Iterator

from hpckpt.core.codecs.metadata_schema import RequiredFields, check_entries
from hpckpt.core.errors import CorruptMetadataError

HP_METADATA_MODULE = "hyper_parallel.core.distributed_checkpoint.metadata"
HP_STORAGE_MODULE = "hyper_parallel.core.distributed_checkpoint.storage"
HP_LEGACY_METADATA_MODULE = "hyper_parallel.core.checkpoint.metadata"
HP_LEGACY_STORAGE_MODULE = "hyper_parallel.core.checkpoint.storage"


@dataclass(frozen=True)
class ChunkStorageMetadata:
    """One stored box of a tensor, in global coordinates (`()`/`()` for a 0-d tensor)."""

    offsets: tuple
    sizes: tuple


@dataclass(frozen=True)
class TensorProperties(RequiredFields):
    dtype: str
    requires_grad: bool = False
    memory_format: str | None = None


@dataclass(frozen=True)
class TensorStorageMetadata(RequiredFields):
    properties: TensorProperties
    size: tuple
    chunks: list = field(default_factory=list)


@dataclass
class BytesStorageMetadata(RequiredFields):
    """Marker for a non-tensor value (stored pickled in a `.bytes` file)."""


@dataclass(frozen=True)
class MetadataIndex:
    """Key of `storage_data`; identity is fqn + offset, `index` is a hint (M0 semantics)."""

    fqn: str
    offset: tuple = ()
    index: int | None = field(default=None, compare=False, hash=False)


@dataclass
class StorageInfo:
    relative_path: str
    offset: int
    length: int
    tensor_key: str | None = None  # absent in legacy pickles: the class default applies


@dataclass
class Metadata(RequiredFields):
    state_dict_metadata: dict
    planner_data: Any = None
    storage_data: dict | None = None
    version: str = "1.0"


_CLASS_MODULE = {
    Metadata: HP_METADATA_MODULE,
    TensorStorageMetadata: HP_METADATA_MODULE,
    TensorProperties: HP_METADATA_MODULE,
    ChunkStorageMetadata: HP_METADATA_MODULE,
    BytesStorageMetadata: HP_METADATA_MODULE,
    MetadataIndex: HP_METADATA_MODULE,
    StorageInfo: HP_STORAGE_MODULE,
}

#: Our class for each (module, name) HyperParallel has used, current and legacy.
HP_CLASSES: dict[tuple[str, str], type] = {}
for _cls, _module in _CLASS_MODULE.items():
    HP_CLASSES[(_module, _cls.__name__)] = _cls
    _legacy = _module.replace(".distributed_checkpoint.", ".checkpoint.")
    HP_CLASSES[(_legacy, _cls.__name__)] = _cls


# Writing: HyperParallel must find its own classes in our pickle. The pickler emits, for each of
# our instances, a stand-in class whose module and qualified name are HyperParallel's; the
# stand-ins are visible in sys.modules only while a dump runs, so nothing else can see them.
def _make_stand_ins() -> dict[type, type]:
    return {
        cls: type(cls.__name__, (), {"__module__": module, "__qualname__": cls.__name__})
        for cls, module in _CLASS_MODULE.items()
    }


_STAND_INS = _make_stand_ins()


_FIELD_NAMES = {cls: tuple(f.name for f in fields(cls)) for cls in _CLASS_MODULE}
_BOX_FIELDS = frozenset(("offsets", "sizes", "size", "offset"))


def _plain(value: Any) -> Any:
    """Shapes and offsets go out as plain tuples of ints (HyperParallel compares with tuples)."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return tuple(int(v) for v in value)
    return value


def _to_stand_ins(obj: Any) -> Any:
    """Copy a metadata tree, replacing each of our instances by a stand-in with the same state.

    pickle writes an instance as NEWOBJ of its own class, so the instances themselves must be of
    the stand-in classes; their `__dict__` holds exactly HyperParallel's field names. Tuples of
    ints (most of the tree) are returned as they are.
    """
    kind = type(obj)
    stand_in = _STAND_INS.get(kind)
    if stand_in is not None:
        copy = object.__new__(stand_in)
        state = copy.__dict__
        for name in _FIELD_NAMES[kind]:
            value = getattr(obj, name)
            state[name] = _plain(value) if name in _BOX_FIELDS else _to_stand_ins(value)
        return copy
    if kind is dict:
        return {_to_stand_ins(k): _to_stand_ins(v) for k, v in obj.items()}
    if kind is list:
        return [_to_stand_ins(v) for v in obj]
    if kind is tuple:
        return tuple(_to_stand_ins(v) for v in obj)
    return obj


@contextmanager
def _stand_in_modules() -> Iterator[None]:
    """Make HyperParallel's module paths (and their parents) resolve to the stand-ins, briefly."""
    wanted: dict[str, types.ModuleType] = {}
    for module_name in (HP_METADATA_MODULE, HP_STORAGE_MODULE):
        parts = module_name.split(".")
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            wanted.setdefault(name, types.ModuleType(name))
        for stand_in in _STAND_INS.values():
            if stand_in.__module__ == module_name:
                setattr(wanted[module_name], stand_in.__qualname__, stand_in)
    added = [name for name in wanted if name not in sys.modules]
    if len(added) < len(wanted) and HP_METADATA_MODULE in sys.modules:
        raise RuntimeError("HyperParallel is imported in this process; write metadata from a separate process")
    for name in added:
        sys.modules[name] = wanted[name]
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def dumps_metadata(metadata: Metadata) -> bytes:
    """Serialise `metadata` as HyperParallel does: protocol 4, its module paths and field names."""
    buffer = io.BytesIO()
    with _stand_in_modules():
        pickle.Pickler(buffer, protocol=4).dump(_to_stand_ins(metadata))
    return buffer.getvalue()


# --- HyperParallel's own schema rules (the shared ones: `metadata_schema.py`) ---------------------

def check_hp_metadata(metadata: Metadata, nbytes: int, where: str) -> None:
    """`check_entries` for HyperParallel."""
    check_entries(metadata, nbytes, where, storage_types=(MetadataIndex, StorageInfo),
                  tensor_type=TensorStorageMetadata)


def check_shared_starts(boxes: Iterable[Any], where: str) -> None:
    """HyperParallel keys storage_data by tensor and offsets, so chunks starting at the same
    offsets share one entry: right for replicas (identical boxes), but two non-empty chunks of
    different sizes there mean one of them has no data (duplicate keys in a damaged or tampered
    `storage_data`, which the dict silently collapsed). `boxes`: `Box`es of one tensor.

    Checked where chunks become `Chunk`s (verify, the writing commands); the chunk arrays that
    inspect's layout pass and planning use skip it: a pass there would slow planning
    (docs/design-figures.md)."""
    seen: dict[tuple, tuple] = {}
    for box in boxes:
        sizes = seen.setdefault(box.offsets, box.sizes)
        if sizes != box.sizes and all(sizes) and all(box.sizes):
            raise CorruptMetadataError(
                f"{where}: chunks of sizes {list(sizes)} and {list(box.sizes)} both start at {list(box.offsets)} and "
                "so share one storage_data entry: one of them has no data (duplicate storage_data keys?)")
