"""Mirrors of PyTorch DCP's `.metadata` classes, so torch-written metadata loads without torch.

Only what a reader needs is kept; torch dtypes arrive as our `DType` and `torch.Size` as tuples
(see `core.safety.unpickle`). `TensorProperties` is pickled by torch as a 5-tuple state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpckpt.core.codecs.metadata_schema import RequiredFields, check_entries


@dataclass
class ChunkStorageMetadata:
    offsets: tuple = ()
    sizes: tuple = ()


@dataclass
class TensorProperties(RequiredFields):
    dtype: Any = None
    layout: Any = None
    requires_grad: bool = False
    memory_format: Any = None
    pin_memory: bool = False

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            names = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
            state = dict(zip(names, state))
        self.__dict__.update(state)


@dataclass
class TensorStorageMetadata(RequiredFields):
    properties: TensorProperties = None  # type: ignore[assignment]
    size: tuple = ()
    chunks: list = field(default_factory=list)


@dataclass
class BytesStorageMetadata(RequiredFields):
    pass


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str = ""
    offset: tuple | None = None
    index: int | None = field(default=None, compare=False, hash=False)


@dataclass
class StorageMeta(RequiredFields):
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list = field(default_factory=list)


@dataclass
class Metadata(RequiredFields):
    state_dict_metadata: dict = field(default_factory=dict)
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass
class _StorageInfo:
    relative_path: str = ""
    offset: int = 0
    length: int = 0
    transform_descriptors: Any = None


def _mem_format(value: int) -> str:
    return {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"}.get(value, str(value))


_MODULE = "torch.distributed.checkpoint.metadata"

TORCH_DCP_CLASSES: dict[tuple[str, str], Any] = {
    (_MODULE, "Metadata"): Metadata,
    (_MODULE, "TensorStorageMetadata"): TensorStorageMetadata,
    (_MODULE, "TensorProperties"): TensorProperties,
    (_MODULE, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_MODULE, "BytesStorageMetadata"): BytesStorageMetadata,
    (_MODULE, "MetadataIndex"): MetadataIndex,
    (_MODULE, "StorageMeta"): StorageMeta,
    (_MODULE, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
}


def check_dcp_metadata(metadata: Metadata, nbytes: int, where: str) -> None:
    """The schema of PyTorch DCP metadata, per tensor (see `metadata_schema.check_entries`)."""
    check_entries(metadata, nbytes, where, storage_types=(MetadataIndex, _StorageInfo),
                  tensor_type=TensorStorageMetadata)
