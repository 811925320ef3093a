"""HyperParallel DCP: `.metadata` (or rank-local `{r}.metadata` / legacy `.rank{r}_metadata`)
plus `_rank{r}_.safetensors` and `.bytes` files. Format spec: docs/hyperparallel-dcp-format.md.
"""

from __future__ import annotations

import re
from pathlib import Path

from hpckpt.converters.data_files import DataFileLocator
from hpckpt.core import dtypes
from hpckpt.core.box import Box
from hpckpt.core.errors import CorruptMetadataError, MissingFileError, UnknownFormatError
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry, ValueEntry
from hpckpt.core.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hpckpt.core.unpickle import loads, pickle_globals

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


def _read_pickle(root: Path, name: str) -> tuple[Metadata, set[tuple[str, str]]]:
    try:
        data = (root / name).read_bytes()
    except OSError as exc:
        raise MissingFileError(f"{root / name}: cannot be read ({exc.strerror})") from None
    if not data:
        raise CorruptMetadataError(f"{root / name}: empty metadata file")
    names = pickle_globals(data)
    metadata = loads(data, what=str(root / name))
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptMetadataError(f"{root / name}: pickle does not hold a HyperParallel Metadata object")
    return metadata, names


class HyperParallelAdapter:
    name = "hyperparallel"
    description = "HyperParallel DCP (.metadata + _rank{r}_.safetensors/.bytes), current and legacy layouts"

    def sniff(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        files = metadata_files(path)
        if not files:
            return False
        if files[0] != GLOBAL_METADATA:
            return True
        with open(path / GLOBAL_METADATA, "rb") as f:
            head = f.read(4096)
        return _HP_PREFIX.encode() in head

    def read_index(self, path: Path) -> CheckpointIndex:
        names = metadata_files(path)
        tensors: dict[str, TensorEntry] = {}
        values: dict[str, ValueEntry] = {}
        planner_data: dict = {}
        versions, modules = set(), set()
        for name in names:
            metadata, globals_ = _read_pickle(path, name)
            modules |= {module for module, _ in globals_}
            versions.add(str(metadata.__dict__.get("version", "1.0")))
            _merge(metadata, name, tensors, values)
            if isinstance(metadata.planner_data, dict):
                planner_data.update(metadata.planner_data)
        legacy = any(m.startswith(_LEGACY_PREFIX) for m in modules)
        data_files = sorted({c.file for t in tensors.values() for c in t.chunks} | {v.file for v in values.values()})
        ranks = [int(m.group(1)) for f in data_files + names if (m := _RANK_IN_NAME.search(f) or _RANK_LOCAL.match(f) or _LEGACY_RANK_LOCAL.match(f))]
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


def _merge(metadata: Metadata, source: str, tensors: dict[str, TensorEntry], values: dict[str, ValueEntry]) -> None:
    """Add one metadata file's entries; rank-local files of one checkpoint are merged this way."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CorruptMetadataError(f"{source}: metadata has no storage_data (written before finalize?)")
    by_position = {(k.fqn, tuple(k.offset or ()), k.index): v for k, v in storage.items()}
    by_box = {(k.fqn, tuple(k.offset or ())): v for k, v in storage.items()}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            spelling = str(item.properties.dtype)
            try:
                dtype = dtypes.dtype(spelling)
            except UnknownFormatError as exc:
                raise UnknownFormatError(f"{source}: tensor {fqn}: {exc.message}") from None
            shape = tuple(int(s) for s in item.size)
            entry = tensors.get(fqn)
            if entry is None:
                entry = tensors[fqn] = TensorEntry(fqn, dtype, shape, [], spelling)
            elif entry.dtype != dtype or entry.shape != shape:
                raise CorruptMetadataError(
                    f"{source}: tensor {fqn} is {dtype}{list(shape)} here but {entry.dtype}{list(entry.shape)} in another metadata file"
                )
            for i, chunk in enumerate(item.chunks):
                offsets = tuple(int(o) for o in chunk.offsets)
                info = by_position.get((fqn, offsets, i)) or by_box.get((fqn, offsets))
                if info is None:
                    raise CorruptMetadataError(f"{source}: chunk {i} of {fqn} at {list(offsets)} has no storage_data entry")
                box = Box(offsets, tuple(int(s) for s in chunk.sizes))
                entry.chunks.append(Chunk(box, info.relative_path, info.tensor_key or fqn))
        elif isinstance(item, BytesStorageMetadata):
            info = by_box.get((fqn, ())) or storage.get(MetadataIndex(fqn))
            if info is None:
                raise CorruptMetadataError(f"{source}: value {fqn} has no storage_data entry")
            values.setdefault(fqn, ValueEntry(fqn, info.relative_path, int(info.offset), int(info.length)))
        else:
            raise CorruptMetadataError(f"{source}: entry {fqn} has unexpected type {type(item).__name__}")


def _framework(tensors: dict[str, TensorEntry]) -> str | None:
    spellings = {t.dtype_spelling for t in tensors.values()}
    if any(s.startswith("torch.") for s in spellings):
        return "torch"
    if any(s[:1].isupper() for s in spellings):
        return "mindspore"
    return None
