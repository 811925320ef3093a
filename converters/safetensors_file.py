"""A single safetensors file (or a directory holding exactly one): every key is a whole tensor.

Read: any such file (MindSpore's `format: ms` flavour too). Written: every tensor whole under its
own name, header first, non-tensor values in a JSON sidecar `NAME.values.json`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.data_files import ZIP_MAGIC, DataFileLocator
from hpckpt.core import safetensors_io
from hpckpt.core.box import full_box
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry
from hpckpt.core.json_values import values_document
from hpckpt.core.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.plan import Plan, PlannedBox, PlannedTensor


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
        data_files=sorted(files),
        locator=locator,
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


def _is_zip(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == ZIP_MAGIC
    except OSError:
        return True  # unreadable: not ours to claim


class SafetensorsFileReader:
    name = "safetensors"

    def sniff(self, path: Path) -> bool:
        """A file that looks like safetensors, or one named `.safetensors` that is no zip (a
        damaged one is still ours, so that its error says what is wrong with it)."""
        single = _single_file(path)
        if single is None:
            return False
        return safetensors_io.is_safetensors(single) or (single.suffix == ".safetensors" and not _is_zip(single))

    def read_index(self, path: Path) -> CheckpointIndex:
        single = _single_file(path)
        assert single is not None
        return index_safetensors_files(single.parent, [single.name], self.name)


# --- writing ------------------------------------------------------------------------------------


def whole_tensors(plan: Plan, fmt: str) -> list[tuple[PlannedTensor, PlannedBox]]:
    """The plan's tensors, each stored whole on rank 0: what a one-file format can hold.

    Raises:
        ValueError: the plan splits a tensor (a consolidation plan never does).
    """
    out = []
    for tensor in plan.tensors:
        if len(tensor.boxes) != 1 or tensor.boxes[0].box != full_box(tensor.shape):
            raise ValueError(f"{fmt} stores whole tensors; {tensor.fqn} is planned in {len(tensor.boxes)} boxes")
        out.append((tensor, tensor.boxes[0]))
    return out


def safetensors_file(name: str, items: list[tuple[PlannedTensor, PlannedBox]], flavour: str) -> FileLayout:
    """One safetensors file of whole tensors under their own names, header first."""
    head, offsets = safetensors_io.encode_header([(t.fqn, t.dtype, t.shape) for t, _ in items], {"format": flavour})
    boxes = tuple(Placement(t, b, (Extent(at, t.box_nbytes(b)),)) for (t, b), at in zip(items, offsets))
    return FileLayout(name, len(head) + sum(p.nbytes for p in boxes), ((0, head),), boxes)


def flavour(options: WriterOptions) -> str:
    """The `__metadata__` format: "pt" unless MindSpore's flavour is asked for (Hugging Face
    loaders accept only pt/tf/flax/mlx)."""
    return "ms" if options.framework == "mindspore" else "pt"


def values_sidecar(values: Mapping[str, Any]) -> bytes:
    return (json.dumps(values_document(values), indent=1) + "\n").encode()


class SafetensorsWriter:
    """`FormatWriter` of one safetensors file; non-tensor values go into `NAME.values.json`."""

    def __init__(self, options: WriterOptions):
        self.options = options
        self._sidecar: tuple[tuple[str, bytes], ...] = ()

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        name = self.options.name
        if values:
            self._sidecar = ((name.removesuffix(".safetensors") + ".values.json", values_sidecar(values)),)
        return OutputLayout((safetensors_file(name, whole_tensors(plan, "safetensors"), flavour(self.options)),))

    def expected_files(self, plan: Plan) -> list[str]:
        return [self.options.name]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        return Finished(metadata=self._sidecar)
