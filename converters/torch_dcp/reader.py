"""PyTorch Distributed Checkpoint (DCP) directories: `.metadata` (or one `__{rank}.metadata` per
rank, `metadata_files`) plus `__{rank}_{i}.distcp` files.

The metadata is a pickle of `torch.distributed.checkpoint` classes, loaded through the safe
unpickler into the mirrors of `core.codecs.torch_dcp_metadata`. Each stored item (a tensor chunk or a
non-tensor value) is a complete torch.save zip record at the byte range its `_StorageInfo` gives;
the locator parses that record's directory only when a chunk is asked for. A value item that is
no zip record is raw bytes (what a planner returning an `io.BytesIO` unsaved writes); a value
record that holds tensors is read as its tensors and leaves (`nested`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpckpt.converters import hpckpt_json
from hpckpt.converters.safetensors_pieces import saved_offsets
from hpckpt.converters.torch_dcp import metadata_files, nested
from hpckpt.converters.torch_dcp.metadata_files import RANK_FILE, RANK_LOCAL
from hpckpt.core import dtypes
from hpckpt.core.codecs import safetensors_io
from hpckpt.core.codecs.metadata_schema import check_ints, check_shape, dtype_spelling, schema_errors
from hpckpt.core.codecs.torch_dcp_metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    _StorageInfo,
)
from hpckpt.core.codecs.torch_zip import ZIP_MAGIC, TensorRecord, load_record
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    EntryMismatchError,
    HpckptError,
    MissingFileError,
    UnknownFormatError,
)
from hpckpt.core.geometry.box import Box
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry, parse_range_key
from hpckpt.core.io.read import open_data_file
from hpckpt.core.paths import resolve_inside
from hpckpt.core.safety import input_files
from hpckpt.core.safety.pickle_budget import describe
from hpckpt.core.storage.readers import handle_of, pread
from hpckpt.core.storage.urls import as_path

METADATA = metadata_files.GLOBAL
_ZIP_END, _ZIP_END_SIZE = b"PK\x05\x06", 22  # a zip's end-of-central-directory record (no comment)


class TorchDcpLocator:
    """Finds chunk bytes by parsing the torch.save record at each item's byte range (cached), or,
    in a `.distcp` that is a safetensors file (`FileSystemWriter(serialization_format=
    SerializationFormat.SAFETENSORS)`), by the item's name in its header."""

    def __init__(self, root: Path, transformed: dict[tuple[str, str], Any] | None = None,
                 expanded: nested.Expanded | None = None):
        self.root = root
        self.transformed = transformed or {}
        self.nested_tensors = expanded.records if expanded else {}  # (file, key) -> tensor inside a value record
        self.leaves = expanded.leaves if expanded else {}  # value name -> leaf of a value record
        self._records: dict[tuple[str, int], Any] = {}
        self._safetensors: dict[str, safetensors_io.SafetensorsHeader | None] = {}
        self._placed: dict[str, dict] = {}  # file -> tensor -> saved offsets (DCP_SHARDING_INFO), parsed once

    def _safetensors_header(self, file: str) -> safetensors_io.SafetensorsHeader | None:
        """The header of a `.distcp` written as one safetensors file (None: torch.save records)."""
        if file not in self._safetensors:
            path = resolve_inside(self.root, file)
            self._safetensors[file] = (safetensors_io.read_header(path, strict=False)
                                       if path.is_file() and safetensors_io.is_safetensors(path) else None)
        return self._safetensors[file]

    def file_problems(self, relative: str) -> list[str]:
        """`.distcp` files of torch.save records have no header of their own: each record is
        checked when its item is located; a safetensors one has its header checked."""
        header = self._safetensors_header(relative)
        return list(header.problems) if header is not None else []

    def _locate_safetensors(self, header: safetensors_io.SafetensorsHeader, chunk: Chunk,
                            entry: TensorEntry) -> Location:
        info = header.entries.get(entry.fqn)
        if info is None:
            raise EntryMismatchError(f"{chunk.file}: has no tensor {entry.fqn!r}")
        if header.problems:
            raise CorruptDataError(f"{chunk.file}: {header.problems[0]}")
        placed = self._placed.get(chunk.file)
        if placed is None:
            placed = self._placed[chunk.file] = saved_offsets(header) or {}
        if info.dtype != entry.dtype or tuple(info.shape) != tuple(chunk.box.sizes) or \
                tuple(placed.get(entry.fqn, chunk.box.offsets)) != tuple(chunk.box.offsets):
            raise EntryMismatchError(f"{chunk.file}: tensor {entry.fqn!r} is {info.dtype} {list(info.shape)} at "
                                     f"{list(placed.get(entry.fqn, ()))}, the metadata says {entry.dtype} {chunk.box}")
        return Location(header.path, info.begin, info.end - info.begin, info.dtype, info.shape)

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        record = self.nested_tensors.get((chunk.file, chunk.key))
        if record is not None:
            self._check(record, chunk, entry)
            return record.location(resolve_inside(self.root, chunk.file))
        header = self._safetensors_header(chunk.file)
        if header is not None:
            return self._locate_safetensors(header, chunk, entry)
        path, record = self._record(chunk.file, chunk.key, entry.fqn)
        if not isinstance(record, TensorRecord):
            raise CorruptDataError(
                f"{chunk.file}: record {chunk.key} of {entry.fqn!r} holds {type(record).__name__}, not a tensor"
            )
        self._check(record, chunk, entry)
        return record.location(path)

    def decode_value(self, entry: ValueEntry) -> Any:
        if entry.fqn in self.leaves:
            return self.leaves[entry.fqn]
        key = f"{entry.offset}:{entry.length}"
        raw = self._raw_bytes(entry.file, key, entry.fqn)
        if raw is not None:
            return raw
        _path, value = self._record(entry.file, key, entry.fqn)
        return value

    def _raw_bytes(self, file: str, key: str, fqn: str) -> bytes | None:
        """The item's bytes when they are no zip record (raw `io.BytesIO` content), else None.
        A range that opens or ends like a zip is a record, so damage to one is still reported."""
        if (file, key) in self.transformed:
            return None  # refused by _record
        offset, length = parse_range_key(key, fqn, CorruptMetadataError)
        path = resolve_inside(self.root, file)
        self._check_range(path, file, fqn, offset, length)
        with open_data_file(path) as f:
            fd = handle_of(f)
            if pread(fd, min(length, len(ZIP_MAGIC)), offset) == ZIP_MAGIC or (
                    length >= _ZIP_END_SIZE and pread(fd, 4, offset + length - _ZIP_END_SIZE) == _ZIP_END):
                return None
            return pread(fd, length, offset)

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
        if not path.exists():
            raise MissingFileError(f"{file}: data file of {fqn!r} does not exist or cannot be read")
        size = input_files.check_regular(path, "data file").st_size  # a FIFO or a directory: refused, unopened
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
        return metadata_files.sniff(as_path(path))

    def read_index(self, path: Path) -> CheckpointIndex:
        root = as_path(path)
        names = metadata_files.metadata_names(root)
        merged = _merged(root, names)
        tensors = merged.entries()
        cross_checked = _cross_check(root, names, merged)
        expanded = nested.expand(root, merged.order, tensors, merged.values, merged.planner, set(merged.transformed))
        files = sorted({c.file for e in expanded.tensors.values() for c in e.chunks}
                       | {v.file for v in expanded.values.values()})
        transformed = merged.transformed
        warnings = [f"{len(transformed)} item(s) are stored with transforms hpckpt cannot read"] if transformed else []
        warnings += cross_checked
        versions = sorted(set(merged.versions))
        index = CheckpointIndex(
            root=root,
            format=self.name,
            format_version=",".join(versions) if versions else "unknown",
            framework="torch",
            tensors=expanded.tensors,
            values=expanded.values,
            metadata_files=names,
            data_files=files,
            locator=TorchDcpLocator(root, transformed, expanded),
            world_size=_world_size(files + names),
            planner_data=expanded.planner if merged.has_planner or expanded.leaves or expanded.records else None,
            warnings=warnings,
        )
        hpckpt_json.apply(index)  # the exact world size, when hpckpt wrote it
        return index


def _merged(root: Path, names: list[str]) -> "_Merged":
    merged = _Merged(root)
    for name in names:
        merged.add(name, metadata_files.load_metadata(root, name))
    return merged


def _cross_check(root: Path, names: list[str], merged: "_Merged") -> list[str]:
    """A `.metadata` beside rank-local `__{rank}.metadata` files is read only if they agree
    (`metadata_files.cross_check`); then the index warns that both are there."""
    local_names = [name for _, name in metadata_files.rank_local_files(root)] if names == [METADATA] else []
    if not local_names:
        return []
    local = _merged(root, local_names)
    return [metadata_files.cross_check(root, metadata_files.index_entries(merged.entries(), merged.values),
                                       metadata_files.index_entries(local.entries(), local.values), local_names)]


class _Merged:
    """The entries of every metadata file read, merged.

    With one `.metadata` this is that file. Rank-local files each list one rank's items: a
    tensor's chunks are the union of every rank's (replicas included, lowest rank first), a
    value is read from the lowest rank that saved it (the copy torch's `dcp_to_torch_save`
    reads); a name the files disagree on (dtype, shape, tensor or value, key path) is refused.
    """

    def __init__(self, root: Path):
        self.root = root
        self.order: list[str] = []
        self.tensors: dict[str, tuple[Any, tuple[int, ...], list[Chunk], str]] = {}  # dtype, shape, chunks, file
        self.values: dict[str, ValueEntry] = {}
        self._value_from: dict[str, str] = {}
        self.planner: dict[str, tuple] = {}
        self._planner_from: dict[str, str] = {}
        self.has_planner = False
        self.transformed: dict[tuple[str, str], Any] = {}
        self.versions: list[str] = []

    def entries(self) -> dict[str, TensorEntry]:
        return {fqn: TensorEntry(fqn, dtype, shape, chunks, dtype_spelling=dtype.torch)
                for fqn, (dtype, shape, chunks, _first) in self.tensors.items()}

    def add(self, name: str, metadata: Metadata) -> None:
        where = self.root / name
        lookup = _storage_lookup(metadata, where)
        for fqn, item in metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                dtype, shape, chunks = _tensor_item(fqn, item, lookup, self.root, where, self.transformed)
                self._add_tensor(name, fqn, dtype, shape, chunks)
            elif isinstance(item, BytesStorageMetadata):
                value = _value_entry(fqn, lookup, self.root, where, self.transformed)
                if fqn in self.tensors:
                    self._conflict(fqn, "a tensor", self.tensors[fqn][3], "a value", name)
                if fqn not in self.values:
                    self.values[fqn], self._value_from[fqn] = value, name
                    self.order.append(fqn)
            else:
                raise UnknownFormatError(f"{where}: {fqn!r} has unknown metadata {type(item).__name__}")
        if isinstance(metadata.planner_data, dict):
            self.has_planner = True
            for fqn, path in metadata.planner_data.items():
                if fqn in self.planner and self.planner[fqn] != path:
                    self._conflict(fqn, f"at key path {self.planner[fqn]!r}", self._planner_from[fqn],
                                   f"at {path!r}", name)
                self.planner.setdefault(fqn, path)
                self._planner_from.setdefault(fqn, name)
        if getattr(metadata, "version", None):
            self.versions.append(str(metadata.version))

    def _add_tensor(self, name: str, fqn: str, dtype: Any, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
        if fqn in self.values:
            self._conflict(fqn, "a value", self._value_from[fqn], "a tensor", name)
        known = self.tensors.get(fqn)
        if known is None:
            self.tensors[fqn] = (dtype, shape, chunks, name)
            self.order.append(fqn)
        elif (known[0], known[1]) != (dtype, shape):
            self._conflict(fqn, f"{known[0]} {list(known[1])}", known[3], f"{dtype} {list(shape)}", name)
        else:
            known[2].extend(chunks)

    def _conflict(self, fqn: str, first: str, first_file: str, second: str, second_file: str) -> None:
        raise CorruptMetadataError(
            f"{self.root}: the metadata files disagree on {fqn!r}: {first} in {first_file}, {second} in {second_file}",
            hint="rank-local metadata files of one checkpoint must describe the same entries alike",
        )


def _storage_lookup(metadata: Metadata, where: Path) -> dict[tuple[str, tuple | None], _StorageInfo]:
    """Index storage_data by (fqn, chunk offsets); byte items have offsets None."""
    lookup = {}
    for key, info in metadata.storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CorruptMetadataError(f"{where}: storage_data entry {describe(key)} is malformed")
        offset = check_ints(key.offset, f"{where}: storage_data key of {key.fqn!r}: offset") \
            if key.offset is not None else None
        lookup[(key.fqn, offset or None)] = info
    return lookup


def _find_info(lookup: dict, fqn: str, offsets: tuple | None, where: Path) -> _StorageInfo:
    info = lookup.get((fqn, offsets or None))
    if info is None:
        at = f" chunk at offsets {list(offsets)}" if offsets else ""
        raise CorruptMetadataError(f"{where}: {fqn!r}{at} has no storage_data entry")
    return info


def _checked_item(fqn: str, info: _StorageInfo, root: Path, where: Path, transformed: dict) -> tuple[str, int, int]:
    """Return (relative file, offset, length) of an item, refusing paths outside the checkpoint."""
    try:
        resolve_inside(root, info.relative_path)
        offset, length = int(info.offset), int(info.length)
    except HpckptError as exc:
        exc.message = f"{exc.message} (item {fqn!r})"
        exc.args = (exc.message,)
        raise
    except (TypeError, ValueError):
        raise CorruptMetadataError(f"{where}: item {fqn!r} has a malformed byte range") from None
    if getattr(info, "transform_descriptors", None):
        transformed[(info.relative_path, f"{offset}:{length}")] = info.transform_descriptors
    return info.relative_path, offset, length


def _tensor_item(fqn: str, item: TensorStorageMetadata, lookup: dict, root: Path, where: Path,
                 transformed: dict) -> tuple[Any, tuple[int, ...], list[Chunk]]:
    props = item.properties
    spelling = getattr(props, "dtype", None)
    if spelling is None:
        raise CorruptMetadataError(f"{where}: tensor {fqn!r} has no dtype")
    dtype = dtypes.dtype(dtype_spelling(props, f"{where}: tensor {fqn!r}"))
    shape = check_shape(item.size, dtype.itemsize, f"{where}: tensor {fqn!r}")
    chunks = []
    for i, chunk in enumerate(item.chunks):
        with schema_errors(f"{where}: tensor {fqn!r}: chunk {i}"):
            offsets, sizes = tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or min(sizes, default=0) < 0:
            raise CorruptMetadataError(f"{where}: tensor {fqn!r}: chunk {i} offsets {list(offsets)} sizes "
                                       f"{list(sizes)} are not a box of a {len(shape)}-d tensor")
        file, offset, length = _checked_item(fqn, _find_info(lookup, fqn, offsets, where), root, where, transformed)
        chunks.append(Chunk(Box(offsets, sizes), file=file, key=f"{offset}:{length}"))
    return dtype, shape, chunks


def _value_entry(fqn: str, lookup: dict, root: Path, where: Path, transformed: dict) -> ValueEntry:
    file, offset, length = _checked_item(fqn, _find_info(lookup, fqn, None, where), root, where, transformed)
    return ValueEntry(fqn, file, offset, length, encoding="torch_save")


def _world_size(names: list[str]) -> int | None:
    """At least max rank + 1 ranks saved, from `__{rank}_{i}.distcp` and `__{rank}.metadata` names."""
    ranks = [int(m.group(1)) for f in names
             if (m := RANK_FILE.match(os.path.basename(f)) or RANK_LOCAL.match(os.path.basename(f)))]
    return max(ranks) + 1 if ranks else None
