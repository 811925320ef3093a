"""PyTorch Distributed Checkpoint (DCP) directories: `.metadata` plus `__{rank}_{i}.distcp` files.

`.metadata` is a pickle of `torch.distributed.checkpoint` classes, loaded through the safe
unpickler into the mirrors of `core.torch_dcp_metadata`. Each stored item (a tensor chunk or a
non-tensor value) is a complete torch.save zip record at the byte range its `_StorageInfo` gives;
the locator parses that record's directory only when a chunk is asked for.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from hpckpt.core import dtypes
from hpckpt.core.box import Box
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    EntryMismatchError,
    HpckptError,
    MissingFileError,
    NotACheckpointError,
    PathNotFoundError,
    UnknownFormatError,
)
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry, parse_range_key
from hpckpt.core.paths import resolve_inside
from hpckpt.core.torch_dcp_metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    _StorageInfo,
)
from hpckpt.core.torch_zip import TensorRecord, load_record
from hpckpt.core.unpickle import loads, safe_global, sniff_head

METADATA = ".metadata"
_DCP_MODULE = "torch.distributed.checkpoint."
_RANK_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")


def _is_dcp_pickle(head: bytes) -> bool:
    """True when the pickle opens with a torch.distributed.checkpoint class (even if truncated later)."""
    return _DCP_MODULE.encode() in head


class TorchDcpLocator:
    """Finds chunk bytes by parsing the torch.save record at each item's byte range (cached)."""

    def __init__(self, root: Path, transformed: dict[tuple[str, str], Any] | None = None):
        self.root = root
        self.transformed = transformed or {}
        self._records: dict[tuple[str, int], Any] = {}

    def file_problems(self, relative: str) -> list[str]:
        """`.distcp` files are concatenated records with no header of their own: each record is
        checked when its item is located."""
        return []

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        path, record = self._record(chunk.file, chunk.key, entry.fqn)
        if not isinstance(record, TensorRecord):
            raise CorruptDataError(
                f"{chunk.file}: record {chunk.key} of {entry.fqn!r} holds {type(record).__name__}, not a tensor"
            )
        self._check(record, chunk, entry)
        return record.location(path)

    def decode_value(self, entry: ValueEntry) -> Any:
        _path, value = self._record(entry.file, f"{entry.offset}:{entry.length}", entry.fqn)
        return value

    def _record(self, file: str, key: str, fqn: str) -> tuple[Path, Any]:
        """Return the absolute path and the parsed record of one item, checking file and range."""
        if (file, key) in self.transformed:
            raise UnknownFormatError(
                f"{file}: item {fqn!r} is stored with transforms {self.transformed[(file, key)]!r}, "
                "which hpckpt does not read yet"
            )
        offset, length = parse_range_key(key, fqn, CorruptMetadataError)
        path = resolve_inside(self.root, file)
        cache_key = (file, offset)
        if cache_key not in self._records:
            self._check_range(path, file, fqn, offset, length)
            try:
                self._records[cache_key] = load_record(path, offset, length)
            except HpckptError as exc:
                exc.message = f"{exc.message} (item {fqn!r})"
                exc.args = (exc.message,)
                raise
        return path, self._records[cache_key]

    @staticmethod
    def _check_range(path: Path, file: str, fqn: str, offset: int, length: int) -> None:
        try:
            size = path.stat().st_size
        except OSError:
            raise MissingFileError(f"{file}: data file of {fqn!r} does not exist or cannot be read") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise CorruptDataError(
                f"{file}: item {fqn!r} at bytes {offset}..{offset + length} lies outside the {size}-byte file"
            )

    @staticmethod
    def _check(record: TensorRecord, chunk: Chunk, entry: TensorEntry) -> None:
        """The record must hold exactly the chunk the metadata announces, or reads go wrong."""
        if record.dtype != entry.dtype or record.shape != chunk.box.sizes:
            raise EntryMismatchError(
                f"{chunk.file}: record {chunk.key} of {entry.fqn!r} holds {record.dtype} {list(record.shape)}, "
                f"metadata says {entry.dtype} {list(chunk.box.sizes)}"
            )


class TorchDcpReader:
    """`FormatAdapter` for PyTorch DCP checkpoint directories."""

    name = "torch-dcp"

    def sniff(self, path: Path) -> bool:
        meta = Path(path) / METADATA
        if not meta.is_file():
            return False
        return _is_dcp_pickle(sniff_head(meta))

    def read_index(self, path: Path) -> CheckpointIndex:
        root = Path(path)
        metadata = _load_metadata(root)
        lookup = _storage_lookup(metadata, root)
        tensors: dict[str, TensorEntry] = {}
        values: dict[str, ValueEntry] = {}
        transformed: dict[tuple[str, str], Any] = {}
        for fqn, item in metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                tensors[fqn] = _tensor_entry(fqn, item, lookup, root, transformed)
            elif isinstance(item, BytesStorageMetadata):
                values[fqn] = _value_entry(fqn, lookup, root, transformed)
            else:
                raise UnknownFormatError(f"{root / METADATA}: {fqn!r} has unknown metadata {type(item).__name__}")
        files = sorted({c.file for e in tensors.values() for c in e.chunks} | {v.file for v in values.values()})
        notes = [f"{len(transformed)} item(s) are stored with transforms hpckpt cannot read"] if transformed else []
        return CheckpointIndex(
            root=root,
            format=self.name,
            format_version=str(metadata.version) if getattr(metadata, "version", None) else "unknown",
            framework="torch",
            tensors=tensors,
            values=values,
            metadata_files=[METADATA],
            data_files=files,
            locator=TorchDcpLocator(root, transformed),
            world_size=_world_size(files),
            planner_data=metadata.planner_data if isinstance(metadata.planner_data, dict) else None,
            notes=notes,
        )


def _load_metadata(root: Path) -> Metadata:
    """Read and safely unpickle `.metadata`, checking it has the shape of DCP metadata."""
    if not root.exists():
        raise PathNotFoundError(f"{root}: no such file or directory")
    if not root.is_dir():
        raise NotACheckpointError(f"{root}: a PyTorch DCP checkpoint is a directory")
    meta = root / METADATA
    try:
        data = meta.read_bytes()
    except FileNotFoundError:
        raise NotACheckpointError(f"{root}: no {METADATA} file, not a PyTorch DCP checkpoint") from None
    except OSError as exc:
        raise MissingFileError(f"{meta}: cannot read ({exc.strerror})") from exc
    metadata = loads(data, what=str(meta), resolver=safe_global)
    if not isinstance(metadata, Metadata):
        raise CorruptMetadataError(f"{meta}: holds {type(metadata).__name__}, not DCP Metadata")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise CorruptMetadataError(f"{meta}: state_dict_metadata or storage_data is missing")
    return metadata


def _storage_lookup(metadata: Metadata, root: Path) -> dict[tuple[str, tuple | None], _StorageInfo]:
    """Index storage_data by (fqn, chunk offsets); byte items have offsets None."""
    lookup = {}
    for key, info in metadata.storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptMetadataError(f"{root / METADATA}: storage_data entry {key!r} is malformed")
        offset = tuple(key.offset) if key.offset is not None else None
        lookup[(key.fqn, offset or None)] = info
    return lookup


def _find_info(lookup: dict, fqn: str, offsets: tuple | None, root: Path) -> _StorageInfo:
    info = lookup.get((fqn, offsets or None))
    if info is None:
        where = f" chunk at offsets {list(offsets)}" if offsets else ""
        raise CorruptMetadataError(f"{root / METADATA}: {fqn!r}{where} has no storage_data entry")
    return info


def _checked_item(fqn: str, info: _StorageInfo, root: Path, transformed: dict) -> tuple[str, int, int]:
    """Return (relative file, offset, length) of an item, refusing paths outside the checkpoint."""
    try:
        resolve_inside(root, info.relative_path)
        offset, length = int(info.offset), int(info.length)
    except HpckptError as exc:
        exc.message = f"{exc.message} (item {fqn!r})"
        exc.args = (exc.message,)
        raise
    except (TypeError, ValueError):
        raise CorruptMetadataError(f"{root / METADATA}: item {fqn!r} has a malformed byte range") from None
    if getattr(info, "transform_descriptors", None):
        transformed[(info.relative_path, f"{offset}:{length}")] = info.transform_descriptors
    return info.relative_path, offset, length


def _tensor_entry(fqn: str, item: TensorStorageMetadata, lookup: dict, root: Path, transformed: dict) -> TensorEntry:
    props = item.properties
    spelling = getattr(props, "dtype", None)
    dtype = dtypes.dtype(spelling) if spelling is not None else None
    if dtype is None:
        raise CorruptMetadataError(f"{root / METADATA}: tensor {fqn!r} has no dtype")
    chunks = []
    for chunk in item.chunks:
        offsets, sizes = tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)
        file, offset, length = _checked_item(fqn, _find_info(lookup, fqn, offsets, root), root, transformed)
        chunks.append(Chunk(Box(offsets, sizes), file=file, key=f"{offset}:{length}"))
    return TensorEntry(fqn, dtype, tuple(int(n) for n in item.size), chunks, dtype_spelling=dtype.torch)


def _value_entry(fqn: str, lookup: dict, root: Path, transformed: dict) -> ValueEntry:
    file, offset, length = _checked_item(fqn, _find_info(lookup, fqn, None, root), root, transformed)
    return ValueEntry(fqn, file, offset, length, encoding="torch_save")


def _world_size(files: list[str]) -> int | None:
    """At least max rank + 1 ranks saved, from `__{rank}_{i}.distcp` names."""
    ranks = [int(m.group(1)) for f in files if (m := _RANK_FILE.match(os.path.basename(f)))]
    return max(ranks) + 1 if ranks else None
