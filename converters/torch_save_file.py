"""A torch.save file (zip format, torch >= 1.6): read and written without torch, never running its pickle.

Read: nested dicts are flattened with "." between keys, as PyTorch DCP flattens a state dict
(`{"model": {"w": t}, "optim": {"state": {0: {...}}}}` -> `model.w`, `optim.state.0.exp_avg`).
A list or tuple holding a tensor is entered too, named as DCP names list items
(`core.nesting.flatten_nested`: `hist.0`, `tup.1`), so no tensor hides inside a value; a list,
tuple or other leaf holding no tensor stays one value, as before.

Written: one flat dict `{fqn: tensor or value}` that `torch.load(..., weights_only=True)` and
`mmap=True` load; tensors in the plan's order, then the values (`core.codecs.torch_archive`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.safetensors_file import whole_tensors
from hpckpt.core.codecs import torch_zip
from hpckpt.core.codecs.pickle_builder import loadable_values
from hpckpt.core.codecs.torch_archive import TorchArchive, archive_name_for
from hpckpt.core.codecs.torch_records import is_tensor_record
from hpckpt.core.errors import CorruptDataError, HpckptError, UnknownFormatError
from hpckpt.core.geometry.box import full_box
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry
from hpckpt.core.io.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.nesting import flatten_nested, holds_tensor
from hpckpt.core.paths import resolve_inside
from hpckpt.core.safety import input_files

_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"  # pickle of torch's legacy magic number
_EXTENSIONS = (".pt", ".pth", ".bin")  # the torch-save format's (converters.FORMATS)


class TorchSaveLocator:
    """Tensors are found once, when the archives' pickles are read (one torch.save file, or the
    shards of a Hugging Face `.bin` checkpoint under `root`); values are kept decoded."""

    def __init__(self, root: Path, locations: dict[str, Location], values: dict[str, Any]):
        self.root = root
        self.locations = locations
        self.values = values

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        return self.locations[entry.fqn]

    def decode_value(self, entry: ValueEntry) -> Any:
        return self.values[entry.fqn]

    def file_problems(self, relative: str) -> list[str]:
        path = resolve_inside(self.root, relative)
        size = path.stat().st_size
        return [f"{fqn} ends at byte {loc.offset + loc.nbytes}, past the end of the {size}-byte file"
                for fqn, loc in self.locations.items() if loc.path.name == path.name and loc.offset + loc.nbytes > size]


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch_zip.TensorRecord], values: dict[str, Any]) -> None:
    """Dicts are entered as they always were; a list, tuple or odd-keyed dict holding a tensor is
    flattened as DCP names its leaves; anything else is one value (names and bytes unchanged)."""
    if is_tensor_record(obj):
        _put(prefix, obj, tensors, values)
    elif isinstance(obj, dict) and obj and all(isinstance(k, (str, int)) for k in obj):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), tensors, values)
    elif holds_tensor(obj, is_tensor_record, tuples=True):
        nested = {prefix: obj} if prefix else dict(enumerate(obj) if isinstance(obj, (list, tuple)) else obj.items())
        for name, leaf in flatten_nested(nested, is_tensor_record, tuples=True):
            _put(name, leaf, tensors, values)
    else:
        _put(prefix or "value", obj, tensors, values)


def _put(name: str, leaf: Any, tensors: dict, values: dict) -> None:
    """One flattened entry; a name given twice (`{0: a, "0": b}`, `{"a.b": a, "a": {"b": b}}`)
    would keep one of them, so it is refused."""
    if name in tensors or name in values:
        raise CorruptDataError(f"two entries flatten to the same name {name!r}: hpckpt names entries by "
                               "their key path joined with '.', and cannot keep both")
    (tensors if is_tensor_record(leaf) else values)[name] = leaf


def flatten_record(path: Path, tree: Any) -> tuple[dict[str, torch_zip.TensorRecord], dict[str, Any]]:
    """A torch.save record's tensors and values by flattened name.

    Raises:
        CorruptDataError: two entries flatten to the same name.
    """
    records: dict[str, torch_zip.TensorRecord] = {}
    values: dict[str, Any] = {}
    try:
        _flatten(tree, "", records, values)
    except CorruptDataError as exc:
        raise CorruptDataError(f"{path}: {exc.message}") from None
    return records, values


_HEAD_BYTES = 30 + 1024  # a local header and the first member's name (`archive/data.pkl`, `{stem}/data.pkl`)


def head_of(path: Path) -> bytes:
    with input_files.open_file(path, "torch.save file") as f:
        return f.read(_HEAD_BYTES)


def _first_member_name(head: bytes) -> bytes:
    if len(head) < 30 or head[:4] != torch_zip.ZIP_MAGIC:
        return b""
    name_length = int.from_bytes(head[26:28], "little")
    return head[30 : 30 + name_length]


def truncated_zip_head(head: bytes) -> str | None:
    """What is wrong with a file cut inside its first zip record (a non-empty prefix of the
    zip magic, or the magic with a local header or member name that ends early), else None:
    a torch.save file truncated there has no member name left to recognise it by."""
    magic = torch_zip.ZIP_MAGIC
    if not head or not (magic.startswith(head) or head.startswith(magic)):
        return None
    if len(head) < 30:
        return f"truncated zip file ({len(head)} bytes; a zip local header has 30)"
    name_length = int.from_bytes(head[26:28], "little")
    if len(head) < min(30 + name_length, _HEAD_BYTES):
        return f"truncated zip file ({len(head)} bytes; its first member name ends at byte {30 + name_length})"
    return None


class TorchSaveReader:
    name = "torch-save"

    def sniff(self, path: Path) -> bool:
        if not path.is_file():
            return False
        try:
            head = head_of(path)
        except (OSError, HpckptError):
            return False
        if _first_member_name(head).endswith(b"data.pkl") or head.startswith(_LEGACY_MAGIC):
            return True
        # cut inside its first zip record: by its name a torch.save file, truncated (read_index says so)
        return path.suffix.lower() in _EXTENSIONS and truncated_zip_head(head) is not None

    @staticmethod
    def refuse_legacy(path: Path, what: str = "a torch.save file") -> None:
        """Raises UnknownFormatError for the pre-1.6 (non-zip) format, which has no index to read."""
        with input_files.open_file(path, "torch.save file") as f:
            if f.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC:
                raise UnknownFormatError(
                    f"{path}: {what} in torch's legacy (pre-1.6, non-zip) format",
                    hint="load and save it again with a current torch (torch.save writes the zip format)",
                )

    def read_index(self, path: Path) -> CheckpointIndex:
        problem = truncated_zip_head(head_of(path))
        if problem is not None:
            raise CorruptDataError(f"{path}: {problem}: a torch.save file cut short?")
        self.refuse_legacy(path)
        records, values = flatten_record(path, torch_zip.load_record(path))
        tensors = {
            fqn: TensorEntry(fqn, r.dtype, r.shape, [Chunk(full_box(r.shape), path.name, fqn)], r.dtype.torch)
            for fqn, r in records.items()
        }
        locator = TorchSaveLocator(path.parent, {fqn: r.location(path) for fqn, r in records.items()}, values)
        # (a single-file index: the same fields as mindspore_ckpt.py's, with this format's values)
        return CheckpointIndex(
            root=path.parent,
            format=self.name,
            format_version="zip",
            framework="torch",
            tensors=tensors,
            values={fqn: ValueEntry(fqn, path.name, 0, path.stat().st_size, "inline") for fqn in values},
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
        kept, skipped, converted = loadable_values((v.fqn, values[v.fqn]) for v in plan.values)
        for fqn, data in kept:
            archive.add_value(fqn, data)
        archive.layout(0)
        boxes = []
        for key, (tensor, planned) in zip(keys, items):
            at, nbytes = archive.tensor_extent(key)
            boxes.append(Placement(tensor, planned, (Extent(at, nbytes),), key))
        return OutputLayout((FileLayout(self.options.name, archive.size, tuple(archive.fixed), tuple(boxes)),),
                            tuple(skipped), tuple(converted))

    def expected_files(self, plan: Plan) -> list[str]:
        return [self.options.name]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        assert self._archive is not None, "layout() first"
        name = self.options.name
        return Finished(tuple((name, at, data) for at, data in self._archive.finish(crcs)))
