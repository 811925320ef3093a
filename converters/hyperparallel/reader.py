"""HyperParallel DCP: `.metadata` (or rank-local `{r}.metadata` / legacy `.rank{r}_metadata`)
plus `_rank{r}_.safetensors` and `.bytes` files (docs/formats.md; the metadata classes:
`core/codecs/hyperparallel_metadata.py`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hpckpt.converters import hpckpt_json, index_cache
from hpckpt.converters.data_files import DataFileLocator
from hpckpt.converters.torch_dcp.metadata_files import cross_check, index_entries
from hpckpt.core import dtypes
from hpckpt.core.codecs.hyperparallel_metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    check_hp_metadata,
    check_shared_starts,
)
from hpckpt.core.codecs.hyperparallel_metadata_columns_read import ColumnsMetadata, TensorRecords, read_columns
from hpckpt.core.codecs.hyperparallel_metadata_stock_read import STOCK_FROM_BYTES, read_stock_columns
from hpckpt.core.codecs.metadata_schema import bad_chunk, check_ints, check_shape, dtype_spelling, guarded, storage_paths
from hpckpt.core.commit import manifest
from hpckpt.core.errors import CorruptMetadataError, UnknownFormatError, UnsafePathError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import inferred_layouts
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry, ValueEntry, int_rows
from hpckpt.core.paths import resolve_inside
from hpckpt.core.safety import input_files
from hpckpt.core.safety.pickle_scan import sniff_head
from hpckpt.core.safety.unpickle import METADATA, loads
from hpckpt.core.storage.urls import lexists

GLOBAL_METADATA = ".metadata"
_RANK_LOCAL = re.compile(r"^(\d+)\.metadata$")
_LEGACY_RANK_LOCAL = re.compile(r"^\.rank(\d+)_metadata$")
_RANK_IN_NAME = re.compile(r"_rank(\d+)[_.]")
_HP_PREFIX = "hyper_parallel.core."
_LEGACY_PREFIX = "hyper_parallel.core.checkpoint."


def _inside(root: Path, name: str) -> None:
    """A metadata file that is a symlink out of the checkpoint is refused (exit 12), as a data file is."""
    try:
        resolve_inside(root, name)
    except UnsafePathError:
        raise UnsafePathError(f"{root / name}: the metadata file is a symlink that leaves the checkpoint "
                              f"directory {root}", hint="copy the file into the checkpoint instead") from None


def metadata_files(root: Path) -> list[str]:
    """The metadata files of a HyperParallel checkpoint: `.metadata`, else the rank-local ones.

    Raises:
        MissingFileError: one of them is a FIFO, a device or a directory (refused unopened,
            whatever the format: a PyTorch DCP `.metadata` is checked here too, as this runs first).
    """
    if lexists(root / GLOBAL_METADATA):
        _inside(root, GLOBAL_METADATA)
        input_files.check_regular(root / GLOBAL_METADATA, "metadata file")
        return [GLOBAL_METADATA]
    return [name for _, name in rank_local(root)]


def rank_local(root: Path) -> list[tuple[int, str]]:
    """`(rank, name)` of every `{rank}.metadata` (or legacy `.rank{rank}_metadata`), by rank."""
    ranked = []
    for child in root.iterdir():
        match = _RANK_LOCAL.match(child.name) or _LEGACY_RANK_LOCAL.match(child.name)
        if match:
            _inside(root, child.name)
            input_files.check_regular(child, "metadata file")
            ranked.append((int(match.group(1)), child.name))
    return sorted(ranked)


def _read_bytes(root: Path, name: str) -> bytes:
    data = input_files.read_small(root / name, "metadata file", input_files.metadata_limit())
    if not data:
        raise CorruptMetadataError(f"{root / name}: empty metadata file")
    return data


def _read_pickle(root: Path, name: str, data: bytes | None = None) -> Metadata:
    if data is None:
        data = _read_bytes(root, name)
    metadata = loads(data, what=str(root / name), kind=METADATA)
    if not isinstance(metadata, Metadata):  # before its fields are looked at
        raise CorruptMetadataError(f"{root / name}: pickle holds {type(metadata).__name__}, not a HyperParallel "
                                   "Metadata object")
    check_hp_metadata(metadata, len(data), str(root / name))
    if not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptMetadataError(f"{root / name}: pickle does not hold a HyperParallel Metadata object")
    if not isinstance(metadata.storage_data, dict):
        raise CorruptMetadataError(f"{root / name}: metadata has no storage_data (written before finalize?)")
    return metadata


class HyperParallelReader:
    name = "hyperparallel"

    def sniff(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        files = metadata_files(path)
        if not files:
            return False
        return files[0] != GLOBAL_METADATA or _HP_PREFIX.encode() in sniff_head(path / GLOBAL_METADATA)

    def read_index(self, path: Path, *, use_cache: bool = False) -> CheckpointIndex:
        names = metadata_files(path)
        index = None
        if use_cache:  # a manifest's listing first: it lives in the checkpoint and is checked against it
            index = index_cache.from_manifest(path, names, DataFileLocator(path, siblings=True), lambda: self._parse(path, names))
        if use_cache and index is None:  # the record is part of the cache's identity: a changed one is read again
            identity = names + [n for n in (manifest.NAME, hpckpt_json.NAME) if lexists(path / n)]
            index = index_cache.load(path, identity, DataFileLocator(path, siblings=True), lambda: self._parse(path, names))
        if index is not None:
            hpckpt_json.apply(index)  # the snapshot has the world size, not the record's warnings
        else:
            index = self._parse(path, names)
            index.warnings += self._cross_check(path, names, index)
            hpckpt_json.apply(index)
            if use_cache:
                inferred_layouts(index)  # the snapshot keeps what inspect derives
                index_cache.store(index)
        unknown = [v for v in index.format_version.split(",") if v not in KNOWN_VERSIONS]
        if unknown:
            index.warnings.append(f"metadata version {', '.join(map(repr, unknown))} is not one hpckpt knows "
                                  f"({', '.join(KNOWN_VERSIONS)}); read as they are (the same classes)")
        index.locator.warnings = index.warnings  # a value read as raw bytes is said so (DataFileLocator)
        return index

    def _cross_check(self, path: Path, names: list[str], index: CheckpointIndex) -> list[str]:
        """`.metadata` beside `{rank}.metadata` files is read only if they agree (as PyTorch DCP's,
        `metadata_files.cross_check`)."""
        local_names = [name for _, name in rank_local(path)] if names == [GLOBAL_METADATA] else []
        if not local_names:
            return []
        local = self._parse(path, local_names)
        return [cross_check(path, index_entries(index.tensors, index.values),
                            index_entries(local.tensors, local.values), local_names)]

    def _parse(self, path: Path, names: list[str]) -> CheckpointIndex:
        tensors: dict[str, TensorEntry] = {}
        values: dict[str, ValueEntry] = {}
        replicas: list[ValueEntry] = []  # values stored again by another rank (rank-local metadata)
        planner_data: dict = {}
        versions: set[str] = set()
        files: set[str] = set()
        legacy = False
        for name in names:
            legacy |= _LEGACY_PREFIX.encode() in sniff_head(path / name)
            data = _read_bytes(path, name)
            columns = read_columns(data)
            if columns is None and len(data) >= STOCK_FROM_BYTES:
                columns = read_stock_columns(data, str(path / name))
            if columns is not None:  # hpckpt's own form or the stock pickler's: arrays, no object per chunk
                metadata = Metadata({}, planner_data=columns.planner_data, storage_data={}, version=columns.version)
                check_hp_metadata(metadata, len(data), str(path / name))
                source: _Source | _ColumnSource = _ColumnSource(columns, name)
                files.update(columns.data_files())
            else:
                metadata = _read_pickle(path, name, data)
                source = _Source(metadata, name)
                files.update(storage_paths(metadata.storage_data, name))
            del data
            versions.add(metadata_version(metadata))
            source.merge_into(tensors, values, replicas)
            if isinstance(metadata.planner_data, dict):
                planner_data.update(metadata.planner_data)
        data_files = sorted(files)
        ranks = [int(m.group(1)) for f in data_files + names
                 if (m := _RANK_IN_NAME.search(f) or _RANK_LOCAL.match(f) or _LEGACY_RANK_LOCAL.match(f))]
        return CheckpointIndex(
            root=path,
            format="hyperparallel-legacy" if legacy else "hyperparallel",
            format_version=",".join(sorted(versions)),
            framework=_framework(tensors),
            tensors=tensors,
            values=values,
            metadata_files=names,
            data_files=data_files,
            locator=DataFileLocator(path, value_replicas=replicas, siblings=True),
            world_size=max(ranks) + 1 if ranks else None,
            planner_data=planner_data or None,
        )


#: `Metadata.version` values HyperParallel has written: "1.0" (the default, often absent from the
#: pickle) and "2.0" (a label of one development line, with no change of layout: the format
#: delta, A2-A3). Versions are labels, never compared as strings.
KNOWN_VERSIONS = ("1.0", "2.0")


def metadata_version(metadata: Metadata) -> str:
    """The version a `.metadata` says it is ("1.0" when it says none), printable."""
    version = metadata.__dict__.get("version", "1.0")
    return version if isinstance(version, str) and version.isprintable() and len(version) <= 32 else repr(version)[:40]


class _Source:
    """One metadata file; rank-local files of one checkpoint are merged source by source.

    Chunks are only turned into `Chunk` objects when a command asks for them (see TensorEntry).
    """

    def __init__(self, metadata: Metadata, name: str):
        self.metadata = metadata
        self.name = name
        self._by_box: dict | None = None
        self._by_position: dict | None = None
        self._positions: dict | None = None

    def _lookup(self) -> tuple[dict, dict]:
        """Chunk storage by (fqn, offsets) and, when boxes repeat, by (fqn, offsets, position).

        MetadataIndex compares by fqn + offset (HyperParallel M0), so identical boxes saved
        without de-dup collapse into one dict key; then entries are looked up by position too.
        """
        if self._by_box is None:
            storage = self.metadata.storage_data
            self._by_box = {(k.fqn, _ints(k.offset or ())): v for k, v in storage.items()}  # ints: hashed safely
            expected = sum(len(i.chunks) if isinstance(i, TensorStorageMetadata) else 1
                           for i in self.metadata.state_dict_metadata.values())
            self._by_position = {}
            if len(storage) < expected:
                self._by_position = {(k.fqn, _ints(k.offset or ()), k.index): v for k, v in storage.items()}
        return self._by_box, self._by_position

    def _by_index(self) -> dict[str, dict[int, tuple]]:
        """fqn -> chunk position -> (offsets, StorageInfo), from `MetadataIndex.index`, which
        HyperParallel's writer sets to the chunk's position: one pass over storage_data."""
        if self._positions is None:
            self._positions = {}
            for key, info in self.metadata.storage_data.items():
                if key.index is not None:
                    self._positions.setdefault(key.fqn, {})[key.index] = (key.offset, info)
        return self._positions

    def _infos(self, fqn: str, item: TensorStorageMetadata, which: Iterable[int] | None = None) -> list:
        """The StorageInfo of chunks `which` (default: all) of `fqn`, in that order: by position
        when it agrees with the chunk's offsets (one dict lookup), else by offsets."""
        chunks = item.chunks
        positions = self._by_index().get(fqn, {})
        by_box = by_position = None
        out = []
        for i in range(len(chunks)) if which is None else which:
            offsets = chunks[i].offsets
            found = positions.get(i)
            if found is not None and found[0] == offsets:
                out.append(found[1])
                continue
            if by_box is None:
                by_box, by_position = self._lookup()
            offsets = _ints(offsets)
            info = (by_position.get((fqn, offsets, i)) if by_position else None) or by_box.get((fqn, offsets))
            if info is None:
                info = self.metadata.storage_data.get(MetadataIndex(fqn, offsets))
            if info is None:
                raise CorruptMetadataError(f"{self.name}: chunk {i} of {fqn} at {list(offsets)} has no storage_data entry")
            out.append(info)
        return out

    def chunks(self, fqn: str, item: TensorStorageMetadata) -> list[Chunk]:
        built = [Chunk(Box(_ints(c.offsets), _ints(c.sizes)), info.relative_path, info.tensor_key or fqn)
                 for c, info in zip(item.chunks, self._infos(fqn, item))]
        if len(built) > 1:
            check_shared_starts([c.box for c in built], f"{self.name}: tensor {fqn}")
        return built

    def files(self, fqn: str, item: TensorStorageMetadata, which: Iterable[int] | None = None) -> list[str]:
        return [info.relative_path for info in self._infos(fqn, item, which)]

    def merge_into(self, tensors: dict[str, TensorEntry], values: dict[str, ValueEntry],
                   replicas: list[ValueEntry] | None = None) -> None:
        storage = self.metadata.storage_data
        for fqn, item in self.metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                spelling = dtype_spelling(item.properties, f"{self.name}: tensor {fqn}")
                where = f"{self.name}: tensor {fqn}"
                dtype, shape = _dtype_and_shape(spelling, item.size, where)
                diagnose = functools.partial(_bad_chunk, item, len(shape))
                _merge_tensor(tensors, self.name, TensorEntry(
                    fqn, dtype, shape, None, spelling, n_chunks=len(item.chunks),
                    build=guarded(functools.partial(self.chunks, fqn, item), where, diagnose),
                    build_arrays=guarded(functools.partial(_arrays, item, len(shape), fqn), where, diagnose),
                    build_files=guarded(functools.partial(self.files, fqn, item), where, diagnose)))
            elif isinstance(item, BytesStorageMetadata):
                info = storage.get(MetadataIndex(fqn))
                _merge_value(values, replicas, self.name, fqn, info and (info.relative_path, getattr(info, "offset", None),
                                                                         getattr(info, "length", None)))
            else:
                raise CorruptMetadataError(f"{self.name}: entry {fqn} has unexpected type {type(item).__name__}")


class _ColumnSource:
    """One metadata file read by `read_columns`: each tensor's chunks are arrays already."""

    def __init__(self, columns: ColumnsMetadata, name: str):
        self.columns = columns
        self.name = name

    def chunks(self, t: TensorRecords) -> list[Chunk]:
        keys = self.columns.strings[t.keys].tolist()
        built = [Chunk(Box(tuple(o), tuple(z)), file, key or t.fqn) for o, z, file, key in
                 zip(t.offsets.tolist(), t.sizes.tolist(), self.columns.chunk_files(t), keys)]
        if len(built) > 1:
            check_shared_starts([c.box for c in built], f"{self.name}: tensor {t.fqn}")
        return built

    def merge_into(self, tensors: dict[str, TensorEntry], values: dict[str, ValueEntry],
                   replicas: list[ValueEntry] | None = None) -> None:
        for t in self.columns.tensors:
            dtype, shape = _dtype_and_shape(t.dtype, t.shape, f"{self.name}: tensor {t.fqn}")
            _merge_tensor(tensors, self.name, TensorEntry(
                t.fqn, dtype, shape, None, t.dtype, n_chunks=len(t.offsets), build=functools.partial(self.chunks, t),
                build_arrays=functools.partial(_pair, t.offsets, t.sizes),
                build_files=functools.partial(self.columns.chunk_files, t)))
        stored = {v.fqn: (v.file, v.offset, v.length) for v in self.columns.value_storage}
        for fqn in self.columns.values:
            _merge_value(values, replicas, self.name, fqn, stored.get(fqn))


def _dtype_and_shape(spelling: str, size, where: str):
    """A tensor's dtype (from the metadata's spelling) and checked shape."""
    try:
        dtype = dtypes.dtype(spelling)
    except UnknownFormatError as exc:
        raise UnknownFormatError(f"{where}: {exc.message}") from None
    return dtype, check_shape(size, dtype.itemsize, where)


def _merge_tensor(tensors: dict[str, TensorEntry], name: str, new: TensorEntry) -> None:
    """Add a metadata file's entry of a tensor; rank-local files each list their own chunks of it."""
    entry = tensors.get(new.fqn)
    if entry is None:
        tensors[new.fqn] = new
    elif entry.dtype != new.dtype or entry.shape != new.shape:
        raise CorruptMetadataError(f"{name}: tensor {new.fqn} is {new.dtype}{list(new.shape)} here but "
                                   f"{entry.dtype}{list(entry.shape)} in another metadata file")
    else:
        entry._build = _concat(entry._build, new._build)
        entry._build_arrays = entry._build_files = None
        entry.n_chunks += new.n_chunks


def _merge_value(values: dict[str, ValueEntry], replicas: list[ValueEntry] | None, name: str, fqn: str,
                 stored: tuple | None) -> None:
    """Add a value stored at `(file, offset, length)`; another file's copy is a replica (read by
    that rank's loader, checked by verify)."""
    if stored is None:
        raise CorruptMetadataError(f"{name}: value {fqn} has no storage_data entry")
    offset, length = check_ints(stored[1:], f"{name}: value {fqn}: byte range")
    entry = ValueEntry(fqn, stored[0], offset, length)
    if values.setdefault(fqn, entry) is not entry and replicas is not None:
        replicas.append(entry)


def _pair(offsets: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return offsets, sizes


def _ints(values) -> tuple[int, ...]:
    """A box's offsets or sizes as a tuple of ints, whatever sequence the pickle held."""
    return tuple(map(int, values))


def _bad_chunk(item: TensorStorageMetadata, ndim: int) -> str | None:
    return bad_chunk(item.chunks, ndim)


def _arrays(item: TensorStorageMetadata, ndim: int, fqn: str) -> tuple[np.ndarray, np.ndarray]:
    chunks, what = item.chunks, f"chunk of {fqn}"
    return int_rows([c.offsets for c in chunks], ndim, what), int_rows([c.sizes for c in chunks], ndim, what)


def _concat(first, second):
    return lambda: first() + second()


def _framework(tensors: dict[str, TensorEntry]) -> str | None:
    spellings = {t.dtype_spelling for t in tensors.values()}
    if any(s.startswith("torch.") for s in spellings):
        return "torch"
    if any(s[:1].isupper() for s in spellings):
        return "mindspore"
    return None
