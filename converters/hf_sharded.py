"""Hugging Face sharded safetensors: `model.safetensors.index.json` with a `weight_map`."""

from __future__ import annotations

import json
from pathlib import Path

from hpckpt.converters.safetensors_file import index_safetensors_files
from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.index import CheckpointIndex

INDEX_NAME = "model.safetensors.index.json"


def _index_path(path: Path) -> Path | None:
    if path.is_dir() and (path / INDEX_NAME).is_file():
        return path / INDEX_NAME
    if path.is_file() and path.name.endswith(".index.json"):
        return path
    return None


class HfShardedAdapter:
    name = "hf-sharded"
    description = "Hugging Face sharded safetensors (model.safetensors.index.json + shards)"

    def sniff(self, path: Path) -> bool:
        return _index_path(path) is not None

    def read_index(self, path: Path) -> CheckpointIndex:
        index_file = _index_path(path)
        assert index_file is not None
        try:
            doc = json.loads(index_file.read_text(encoding="utf-8"))
            weight_map = doc["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptMetadataError(f"{index_file}: not a valid safetensors index ({exc})") from None
        if not all(isinstance(f, str) for f in files):
            raise CorruptMetadataError(f"{index_file}: weight_map values must be file names")
        index = index_safetensors_files(index_file.parent, files, self.name)
        index.metadata_files = [index_file.name]
        missing = sorted(set(weight_map) - set(index.tensors))
        if missing:
            raise CorruptMetadataError(
                f"{index_file}: weight_map names {len(missing)} tensor(s) absent from the shards, e.g. {missing[0]!r}"
            )
        return index
