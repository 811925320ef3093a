"""Hugging Face sharded safetensors: `model.safetensors.index.json` with a `weight_map`.

Read: also the per-rank output of PyTorch's `HuggingFaceStorageWriter(save_distributed=True)`
(`shard-{r+1}-model-{i}-of-{n}.safetensors` and no index), the pieces of each tensor placed by the
offsets in each file's `__metadata__` (`converters.safetensors_pieces`).

Written: whole tensors packed greedily, in the plan's order, into shards of at most
`--max-shard-size` (a larger tensor gets a shard of its own), as Hugging Face's sharding does,
named `model-0000i-of-0000n.safetensors`; then the index and the values' `values.json`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpckpt.converters import values_sidecar
from hpckpt.converters.base import WriterOptions
from hpckpt.converters.safetensors_file import flavour, index_safetensors_files, safetensors_file, whole_tensors
from hpckpt.converters.safetensors_pieces import PER_RANK_FILE
from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.output import Finished, OutputLayout
from hpckpt.core.safety import input_files
from hpckpt.core.storage.urls import lexists

INDEX_NAME = "model.safetensors.index.json"
SIDECAR_NAME = "values.json"  # hpckpt's values beside the shards (converters.values_sidecar)


def _index_path(path: Path) -> Path | None:
    if path.is_dir() and lexists(path / INDEX_NAME):  # a FIFO or directory: refused when read
        return path / INDEX_NAME
    if path.is_file() and path.name.endswith(".safetensors.index.json"):
        return path
    return None


def _per_rank_files(path: Path) -> list[str]:
    """torch's `HuggingFaceStorageWriter(save_distributed=True)` output: per-rank files, no index."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if PER_RANK_FILE.match(p.name) and p.is_file())


class HfShardedReader:
    name = "hf-sharded"

    def sniff(self, path: Path) -> bool:
        return _index_path(path) is not None or bool(_per_rank_files(path))

    def read_index(self, path: Path) -> CheckpointIndex:
        index_file = _index_path(path)
        if index_file is None:
            return self._read_per_rank(path)
        weight_map, files = read_weight_map(index_file, "safetensors index")
        index = index_safetensors_files(index_file.parent, files, self.name, sidecar=SIDECAR_NAME, owners=weight_map)
        index.metadata_files = [index_file.name]
        missing = sorted(set(weight_map) - set(index.tensors))
        if missing:
            raise CorruptMetadataError(
                f"{index_file}: weight_map names {len(missing)} tensor(s) absent from the shards, e.g. {missing[0]!r}"
            )
        return index

    def _read_per_rank(self, path: Path) -> CheckpointIndex:
        """Every rank's pieces, placed by their `DCP_SHARDING_INFO` offsets (no file lists them all)."""
        files = _per_rank_files(path)
        index = index_safetensors_files(path, files, self.name)
        index.format_version = "1 (torch DCP per-rank shards)"
        ranks = {int(PER_RANK_FILE.match(f).group(1)) - 1 for f in files}
        index.world_size = max(ranks) + 1
        pieces = sum(1 for e in index.tensors.values() if e.n_chunks > 1)
        # a warning, not a note: a lost last rank's file would shrink tensors and nothing could tell
        notes = [f"{len(files)} per-rank file(s) of torch.distributed.checkpoint's HuggingFaceStorageWriter "
                 f"(save_distributed=True) and no index: {pieces} tensor(s) assembled from pieces by their "
                 "DCP_SHARDING_INFO offsets; each global shape is the extent of its pieces, as no file records "
                 "it, so a lost file of the last rank cannot be detected"]
        absent = sorted(set(range(index.world_size)) - ranks)
        if absent:
            index.warnings.append(f"no file of rank(s) {', '.join(map(str, absent))} (a rank with nothing to "
                                  "save writes none; pieces that leave a gap are refused when read)")
        index.warnings[:0] = notes
        return index


def read_weight_map(index_file: Path, what: str) -> tuple[dict, list[str]]:
    """A Hugging Face index's `weight_map` (tensor -> shard file) and its shard files, sorted.

    Raises:
        CorruptMetadataError: not JSON, no `weight_map`, or a value that is not a file name.
    """
    data = input_files.read_small(index_file, what, input_files.MAX_INDEX_BYTES)
    document = input_files.load_json(data, f"{index_file}: {what}")
    try:
        weight_map = document["weight_map"]
        files = sorted(set(weight_map.values()))
    except (KeyError, TypeError, AttributeError) as exc:
        raise CorruptMetadataError(f"{index_file}: not a valid {what} ({type(exc).__name__}: {exc})") from None
    if not all(isinstance(f, str) for f in files):
        raise CorruptMetadataError(f"{index_file}: weight_map values must be file names")
    return weight_map, files


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
        files = tuple(safetensors_file(shard_name(i, len(groups)), group, flavour(self.options),
                                       dict(self.options.user_metadata)) for i, group in enumerate(groups))
        weight_map = {t.fqn: shard_name(i, len(groups)) for i, group in enumerate(groups) for t, _ in group}
        document = {"metadata": {"total_size": plan.nbytes()}, "weight_map": dict(sorted(weight_map.items()))}
        self._metadata = ((INDEX_NAME, (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()),)
        converted = ()
        if values:
            data, converted = values_sidecar.encode(values)
            self._metadata += ((SIDECAR_NAME, data),)
        return OutputLayout(files, converted=converted)

    def expected_files(self, plan: Plan) -> list[str]:
        n = len(self._shards(plan))
        return [shard_name(i, n) for i in range(n)]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        return Finished(metadata=self._metadata)
