"""A single safetensors file (or a directory holding exactly one): every key is a whole tensor."""

from __future__ import annotations

import re
from pathlib import Path

from hpckpt.converters.data_files import DataFileLocator
from hpckpt.core import safetensors_io
from hpckpt.core.box import full_box
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry


def index_safetensors_files(root: Path, files: list[str], fmt: str) -> CheckpointIndex:
    """Build an index over whole-tensor safetensors files `files` (relative to `root`)."""
    locator = DataFileLocator(root)
    tensors: dict[str, TensorEntry] = {}
    frameworks = set()
    for name in files:
        header = safetensors_io.read_header(locator.path(name))
        frameworks.add({"ms": "mindspore", "pt": "torch"}.get(header.metadata.get("format", ""), None))
        for key, info in header.entries.items():
            if key in tensors:
                continue  # duplicates across shards: the first wins, as Hugging Face loaders do
            chunk = Chunk(full_box(info.shape), name, key)
            tensors[key] = TensorEntry(key, info.dtype, info.shape, [chunk], info.dtype.safetensors)
    frameworks.discard(None)
    return CheckpointIndex(
        root=root,
        format=fmt,
        format_version="1",
        framework=frameworks.pop() if len(frameworks) == 1 else None,
        tensors=dict(sorted(tensors.items())),
        values={},
        metadata_files=[],
        data_files=sorted(files),
        locator=locator,
        world_size=None,
    )


_RANK_FILE = re.compile(r"^_rank\d+_\.safetensors$")


def _single_file(path: Path) -> Path | None:
    if path.is_file():
        return path
    if path.is_dir():
        # `_rank{r}_.safetensors` alone is a HyperParallel rank file whose metadata is missing
        # (an interrupted save), not a one-file checkpoint.
        candidates = sorted(path.glob("*.safetensors"))
        alone = len(candidates) == 1 and not _RANK_FILE.match(candidates[0].name)
        if alone and not (path / "model.safetensors.index.json").exists():
            return candidates[0]
    return None


class SafetensorsFileAdapter:
    name = "safetensors"
    description = "one safetensors file (or a directory holding exactly one)"

    def sniff(self, path: Path) -> bool:
        single = _single_file(path)
        return single is not None and safetensors_io.is_safetensors(single)

    def read_index(self, path: Path) -> CheckpointIndex:
        single = _single_file(path)
        assert single is not None
        return index_safetensors_files(single.parent, [single.name], self.name)
