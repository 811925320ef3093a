"""HyperParallel DCP: `.metadata` (or rank-local `{r}.metadata` / legacy `.rank{r}_metadata`)
plus `_rank{r}_.safetensors` and `.bytes` files. Format spec: docs/hyperparallel-dcp-format.md.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from hpckpt.converters import index_cache
from hpckpt.converters.data_files import DataFileLocator
from hpckpt.core import dtypes
from hpckpt.core.box import Box
from hpckpt.core.errors import CorruptMetadataError, MissingFileError, UnknownFormatError
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry, ValueEntry, int_rows
from hpckpt.core.layout import inferred_layouts
from hpckpt.core.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hpckpt.core.unpickle import loads, sniff_head

GLOBAL_METADATA = ".metadata"
_RANK_LOCAL = re.compile(r"^(\d+)\.metadata$")
_LEGACY_RANK_LOCAL = re.compile(r"^\.rank(\d+)_metadata$")
_RANK_IN_NAME = re.compile(r"_rank(\d+)[_.]")
_HP_PREFIX = "hyper_parallel.core."
_LEGACY_PREFIX = "hyper_parallel.core.checkpoint."


def metadata_files(root: Path) -> list[str]:
    """The metadata files of a HyperParallel checkpoint: `.metadata`, else the rank-local ones."""
    if (root / GLOBAL_METADATA).is_file():
        return [GLOBAL_METADATA]
    ranked = []
    for child in root.iterdir():
        match = _RANK_LOCAL.match(child.name) or _LEGACY_RANK_LOCAL.match(child.name)
        if match and child.is_file():
            ranked.append((int(match.group(1)), child.name))
    return [name for _, name in sorted(ranked)]


def _read_pickle(root: Path, name: str) -> Metadata:
    try:
        data = (root / name).read_bytes()
    except OSError as exc:
        raise MissingFileError(f"{root / name}: cannot be read ({exc.strerror})") from None
    if not data:
        raise CorruptMetadataError(f"{root / name}: empty metadata file")
    metadata = loads(data, what=str(root / name))
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
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
        if use_cache:
            index = index_cache.load(path, names, DataFileLocator(path), lambda: self._parse(path, names))
        if index is None:
            index = self._parse(path, names)
            if use_cache:
                inferred_layouts(index)  # the snapshot keeps what inspect derives
                index_cache.store(index)
        index.locator.warnings = index.warnings  # a value read as raw bytes is said so (DataFileLocator)
        return index

    def _parse(self, path: Path, names: list[str]) -> CheckpointIndex:
        tensors: dict[str, TensorEntry] = {}
        values: dict[str, ValueEntry] = {}
        planner_data: dict = {}
        versions: set[str] = set()
        files: set[str] = set()
        legacy = False
        for name in names:
            legacy |= _LEGACY_PREFIX.encode() in sniff_head(path / name)
            metadata = _read_pickle(path, name)
            versions.add(str(metadata.__dict__.get("version", "1.0")))
            _Source(metadata, name).merge_into(tensors, values)
            files.update(info.relative_path for info in metadata.storage_data.values())
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
            locator=DataFileLocator(path),
            world_size=max(ranks) + 1 if ranks else None,
            planner_data=planner_data or None,
        )


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
            self._by_box = {(k.fqn, k.offset): v for k, v in storage.items()}
            expected = sum(len(i.chunks) if isinstance(i, TensorStorageMetadata) else 1
                           for i in self.metadata.state_dict_metadata.values())
            self._by_position = {}
            if len(storage) < expected:
                self._by_position = {(k.fqn, tuple(k.offset or ()), k.index): v for k, v in storage.items()}
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
        return [Chunk(Box(_ints(c.offsets), _ints(c.sizes)), info.relative_path, info.tensor_key or fqn)
                for c, info in zip(item.chunks, self._infos(fqn, item))]

    def files(self, fqn: str, item: TensorStorageMetadata, which: Iterable[int] | None = None) -> list[str]:
        return [info.relative_path for info in self._infos(fqn, item, which)]

    def merge_into(self, tensors: dict[str, TensorEntry], values: dict[str, ValueEntry]) -> None:
        storage = self.metadata.storage_data
        for fqn, item in self.metadata.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                spelling = str(item.properties.dtype)
                try:
                    dtype = dtypes.dtype(spelling)
                except UnknownFormatError as exc:
                    raise UnknownFormatError(f"{self.name}: tensor {fqn}: {exc.message}") from None
                shape = tuple(int(s) for s in item.size)
                build = functools.partial(self.chunks, fqn, item)
                entry = tensors.get(fqn)
                if entry is None:
                    tensors[fqn] = TensorEntry(fqn, dtype, shape, None, spelling, build=build, n_chunks=len(item.chunks),
                                               build_arrays=functools.partial(_arrays, item, len(shape), fqn),
                                               build_files=functools.partial(self.files, fqn, item))
                elif entry.dtype != dtype or entry.shape != shape:
                    raise CorruptMetadataError(
                        f"{self.name}: tensor {fqn} is {dtype}{list(shape)} here but "
                        f"{entry.dtype}{list(entry.shape)} in another metadata file"
                    )
                else:
                    entry._build = _concat(entry._build, build)
                    entry._build_arrays = entry._build_files = None
                    entry.n_chunks += len(item.chunks)
            elif isinstance(item, BytesStorageMetadata):
                info = storage.get(MetadataIndex(fqn))
                if info is None:
                    raise CorruptMetadataError(f"{self.name}: value {fqn} has no storage_data entry")
                values.setdefault(fqn, ValueEntry(fqn, info.relative_path, int(info.offset), int(info.length)))
            else:
                raise CorruptMetadataError(f"{self.name}: entry {fqn} has unexpected type {type(item).__name__}")


def _ints(values) -> tuple[int, ...]:
    """A box's offsets or sizes as a tuple of ints, whatever sequence the pickle held."""
    return tuple(map(int, values))


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
