"""Hugging Face's older weights layout: `pytorch_model.bin.index.json` and torch.save shards (read only).

`transformers`' `save_pretrained(..., safe_serialization=False)` writes `pytorch_model.bin` (small
models) or shards `pytorch_model-0000i-of-0000n.bin` with the index
`{"metadata": {"total_size": ...}, "weight_map": {name: shard}}`; a variant adds its name
(`pytorch_model.fp16-00001-of-00002.bin`, `pytorch_model.bin.index.fp16.json`). Each shard is a
torch.save zip of a flat `{name: tensor}` dict, read like any torch.save file (never unpickled
with the stock unpickler). TensorFlow and Flax indexes of the same family are refused by name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hpckpt.converters.hf_sharded import read_weight_map
from hpckpt.converters.torch_save_file import (
    TorchSaveLocator,
    TorchSaveReader,
    flatten_record,
    head_of,
    truncated_zip_head,
)
from hpckpt.core.codecs import torch_zip
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    MissingFileError,
    UnknownFormatError,
)
from hpckpt.core.geometry.box import full_box
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry
from hpckpt.core.paths import resolve_inside
from hpckpt.core.safety import input_files

SINGLE_NAME = "pytorch_model.bin"
_INDEX = re.compile(r"^pytorch_model(\.[\w-]+)?\.bin\.index(\.[\w-]+)?\.json$")
_OTHER_FRAMEWORKS = {"tf_model.h5.index.json": "TensorFlow", "flax_model.msgpack.index.json": "Flax"}


def _index_file(path: Path) -> Path | None:
    if path.is_file():
        return path if _INDEX.match(path.name) or path.name in _OTHER_FRAMEWORKS else None
    if not path.is_dir() or (path / "model.safetensors.index.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if _INDEX.match(p.name) or p.name in _OTHER_FRAMEWORKS)
    return found[0] if found else None


def _single_bin(path: Path) -> Path | None:
    """A directory `save_pretrained` wrote one unsharded `pytorch_model.bin` into."""
    if path.is_dir() and (path / SINGLE_NAME).is_file() and not any(path.glob("*.safetensors")):
        return path / SINGLE_NAME
    return None


class HfTorchBinReader:
    name = "hf-torch-bin"

    def sniff(self, path: Path) -> bool:
        return _index_file(path) is not None or _single_bin(path) is not None

    def read_index(self, path: Path) -> CheckpointIndex:
        index_file = _index_file(path)
        if index_file is None:
            single = _single_bin(path)
            assert single is not None
            return self._read(single.parent, [single.name], None, [])
        framework = _OTHER_FRAMEWORKS.get(index_file.name)
        if framework is not None:
            raise UnknownFormatError(
                f"{index_file}: Hugging Face {framework} weights, which hpckpt does not read",
                hint=f"load them with transformers (from_{'tf' if framework == 'TensorFlow' else 'flax'}=True) "
                     "and save_pretrained() them as safetensors")
        weight_map, files = read_weight_map(index_file, "pytorch_model.bin index")
        return self._read(index_file.parent, files, weight_map, [index_file.name])

    def _read(self, root: Path, files: list[str], weight_map: dict | None, metadata_files: list[str]) -> CheckpointIndex:
        tensors: dict[str, TensorEntry] = {}
        locations: dict[str, Location] = {}
        values: dict[str, Any] = {}
        value_files: dict[str, str] = {}
        for name in files:
            shard = resolve_inside(root, name)
            if not shard.exists():
                raise MissingFileError(f"{name}: shard named by the index is missing from {root}")
            input_files.check_regular(shard, "pytorch_model.bin shard")  # a FIFO or directory: exit 8
            problem = "empty file" if shard.stat().st_size == 0 else truncated_zip_head(head_of(shard))
            if problem is not None:
                raise CorruptDataError(f"{shard}: {problem}: a pytorch_model.bin shard cut short?")
            if not TorchSaveReader().sniff(shard):
                raise CorruptMetadataError(f"{shard}: not a torch.save file (a pytorch_model.bin shard must be one)")
            TorchSaveReader.refuse_legacy(shard, "a pytorch_model.bin shard")
            records, shard_values = flatten_record(shard, torch_zip.load_record(shard))
            for fqn, record in records.items():
                named = weight_map.get(fqn) if weight_map is not None else None
                if (fqn in tensors or fqn in values) and named != name:
                    continue  # in two shards: the one the index names wins, else the first
                values.pop(fqn, None)  # a value of that name in an earlier shard loses to it
                value_files.pop(fqn, None)
                tensors[fqn] = TensorEntry(fqn, record.dtype, record.shape, [Chunk(full_box(record.shape), name, fqn)],
                                           record.dtype.torch)
                locations[fqn] = record.location(shard)
            for fqn, value in shard_values.items():
                if fqn not in tensors and fqn not in values:
                    values[fqn], value_files[fqn] = value, name
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(tensors) - set(values))
            if missing:
                raise CorruptMetadataError(f"{root / metadata_files[0]}: weight_map names {len(missing)} entr(ies) "
                                           f"absent from the shards, e.g. {missing[0]!r}")
        return CheckpointIndex(
            root=root,
            format=self.name,
            format_version="bin",
            framework="torch",
            tensors=tensors,
            values={fqn: ValueEntry(fqn, f, 0, (root / f).stat().st_size, "inline") for fqn, f in value_files.items()},
            data_files=sorted(files),
            locator=TorchSaveLocator(root, locations, values),
            metadata_files=metadata_files,
        )
