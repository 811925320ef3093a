"""Hugging Face sharded safetensors: `model.safetensors.index.json` with a `weight_map`.

Written: whole tensors packed greedily, in the plan's order, into shards of at most
`--max-shard-size` (a larger tensor gets a shard of its own), as Hugging Face's sharding does,
named `model-0000i-of-0000n.safetensors`; then the index and the values' `values.json`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.safetensors_file import flavour, index_safetensors_files, safetensors_file, values_sidecar, whole_tensors
from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.output import Finished, OutputLayout
from hpckpt.core.plan import Plan

INDEX_NAME = "model.safetensors.index.json"


def _index_path(path: Path) -> Path | None:
    if path.is_dir() and (path / INDEX_NAME).is_file():
        return path / INDEX_NAME
    if path.is_file() and path.name.endswith(".index.json"):
        return path
    return None


class HfShardedReader:
    name = "hf-sharded"

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


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class HfShardedWriter:
    """`FormatWriter` of Hugging Face sharded safetensors."""

    def __init__(self, options: WriterOptions):
        self.options = options
        self._metadata: tuple[tuple[str, bytes], ...] = ()

    def _shards(self, plan: Plan) -> list[list]:
        groups: list[list] = [[]]
        size = 0
        for tensor, planned in whole_tensors(plan, "hf"):
            nbytes = tensor.box_nbytes(planned)
            if groups[-1] and size + nbytes > self.options.max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((tensor, planned))
            size += nbytes
        return groups

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        groups = self._shards(plan)
        files = tuple(safetensors_file(shard_name(i, len(groups)), group, flavour(self.options))
                      for i, group in enumerate(groups))
        weight_map = {t.fqn: shard_name(i, len(groups)) for i, group in enumerate(groups) for t, _ in group}
        document = {"metadata": {"total_size": plan.nbytes()}, "weight_map": dict(sorted(weight_map.items()))}
        self._metadata = ((INDEX_NAME, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()),)
        if values:
            self._metadata += (("values.json", values_sidecar(values)),)
        return OutputLayout(files)

    def expected_files(self, plan: Plan) -> list[str]:
        n = len(self._shards(plan))
        return [shard_name(i, n) for i in range(n)]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        return Finished(metadata=self._metadata)
