"""A torch.save file (zip format, torch >= 1.6): read and written without torch, never running its pickle.

Read: nested dicts are flattened with "." between keys, as PyTorch DCP flattens a state dict
(`{"model": {"w": t}, "optim": {"state": {0: {...}}}}` -> `model.w`, `optim.state.0.exp_avg`);
lists, tuples and every other non-tensor leaf stay whole as one value.

Written: one flat dict `{fqn: tensor or value}` that `torch.load(..., weights_only=True)` and
`mmap=True` load; tensors in the plan's order, then the values (`core.torch_archive`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.safetensors_file import whole_tensors
from hpckpt.core.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.plan import Plan
from hpckpt.core.torch_archive import TorchArchive, archive_name_for

from hpckpt.core import torch_zip
from hpckpt.core.box import full_box
from hpckpt.core.errors import CorruptDataError, UnknownFormatError
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry

_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # pickle of torch's legacy magic number


class TorchSaveLocator:
    """Tensors are found once, when the archive's pickle is read; values are kept decoded."""

    def __init__(self, path: Path, locations: dict[str, Location], values: dict[str, Any]):
        self.path = path
        self.locations = locations
        self.values = values

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        return self.locations[entry.fqn]

    def decode_value(self, entry: ValueEntry) -> Any:
        return self.values[entry.fqn]

    def file_problems(self, relative: str) -> list[str]:
        size = self.path.stat().st_size
        return [f"{entry} ends at byte {loc.offset + loc.nbytes}, past the end of the {size}-byte file"
                for entry, loc in self.locations.items() if loc.offset + loc.nbytes > size]


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch_zip.TensorRecord], values: dict[str, Any]) -> None:
    if isinstance(obj, torch_zip.TensorRecord):
        tensors[prefix] = obj
    elif isinstance(obj, dict) and obj and all(isinstance(k, (str, int)) for k in obj):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), tensors, values)
    else:
        values[prefix or "value"] = obj


def _first_member_name(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(30 + 256)
    if len(head) < 30 or head[:4] != torch_zip.ZIP_MAGIC:
        return b""
    name_length = int.from_bytes(head[26:28], "little")
    return head[30 : 30 + name_length]


class TorchSaveReader:
    name = "torch-save"

    def sniff(self, path: Path) -> bool:
        if not path.is_file():
            return False
        try:
            if _first_member_name(path).endswith(b"data.pkl"):
                return True
            with open(path, "rb") as f:
                return f.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC
        except OSError:
            return False

    def read_index(self, path: Path) -> CheckpointIndex:
        with open(path, "rb") as f:
            if f.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC:
                raise UnknownFormatError(
                    f"{path}: a torch.save file in the legacy (pre-1.6, non-zip) format",
                    hint="load and save it again with a current torch (torch.save writes the zip format)",
                )
        tree = torch_zip.load_record(path)
        records: dict[str, torch_zip.TensorRecord] = {}
        values: dict[str, Any] = {}
        _flatten(tree, "", records, values)
        clash = set(records) & set(values)
        if clash:
            raise CorruptDataError(f"{path}: flattened names collide: {sorted(clash)[:3]}")
        tensors = {
            fqn: TensorEntry(fqn, r.dtype, r.shape, [Chunk(full_box(r.shape), path.name, fqn)], r.dtype.torch)
            for fqn, r in records.items()
        }
        locator = TorchSaveLocator(path, {fqn: r.location(path) for fqn, r in records.items()}, values)
        # (a single-file index: the same fields as mindspore_ckpt.py's, with this format's values)
        return CheckpointIndex(
            root=path.parent,
            format=self.name,
            format_version="zip",
            framework="torch",
            tensors=tensors,
            values={fqn: ValueEntry(fqn, path.name, 0, os.stat(path).st_size, "inline") for fqn in values},
            data_files=[path.name],
            locator=locator,
        )


class TorchSaveFileWriter:
    """`FormatWriter` of a torch.save file."""

    def __init__(self, options: WriterOptions):
        self.options = options
        self._archive: TorchArchive | None = None

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        archive = self._archive = TorchArchive(archive_name_for(self.options.name))
        items = whole_tensors(plan, "torch-save")
        keys = [archive.add_tensor(t.fqn, t.dtype, t.shape) for t, _ in items]
        for value in plan.values:
            archive.add_value(value.fqn, values[value.fqn])
        archive.layout(0)
        boxes = []
        for key, (tensor, planned) in zip(keys, items):
            at, nbytes = archive.tensor_extent(key)
            boxes.append(Placement(tensor, planned, (Extent(at, nbytes),), key))
        return OutputLayout((FileLayout(self.options.name, archive.size, tuple(archive.fixed), tuple(boxes)),))

    def expected_files(self, plan: Plan) -> list[str]:
        return [self.options.name]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        assert self._archive is not None, "layout() first"
        name = self.options.name
        return Finished(tuple((name, at, data) for at, data in self._archive.finish(crcs)))
