"""A single safetensors file (or a directory holding exactly one): every key is a whole tensor.

Read: any such file (MindSpore's `format: ms` flavour too); a file holding pieces of larger tensors
(one rank's file of a sharded save) is read as stored, and its notes say so. Written: every tensor
whole under its own name, header first, non-tensor values in a JSON sidecar `NAME.values.json`,
the source's own `__metadata__` keys carried (`converters.safetensors_pieces`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpckpt.converters import values_sidecar
from hpckpt.converters.base import WriterOptions
from hpckpt.converters.data_files import ZIP_MAGIC, DataFileLocator
from hpckpt.converters.safetensors_pieces import HP_RANK_FILE, carried_metadata, saved_offsets, single_file_notes
from hpckpt.core.codecs import safetensors_io
from hpckpt.core.errors import CorruptMetadataError, HpckptError
from hpckpt.core.geometry.box import Box, full_box
from hpckpt.core.geometry.plan import Plan, PlannedBox, PlannedTensor
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry
from hpckpt.core.io.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.safety import input_files
from hpckpt.core.storage.urls import lexists


def index_safetensors_files(root: Path, files: list[str], fmt: str, *, assemble: bool = True,
                            sidecar: str | None = None, owners: Mapping[str, str] | None = None,
                            locator: DataFileLocator | None = None) -> CheckpointIndex:
    """Build an index over the safetensors files `files` (relative to `root`).

    A tensor whose file's `__metadata__` places it at offsets (`DCP_SHARDING_INFO`, PyTorch's
    Hugging Face storage writer) is a piece: with `assemble`, the pieces of all files are chunks of
    one tensor as large as their extent; without (one file read on its own), each is read as
    stored and the index's notes say what it is. `sidecar` names the JSON file of the values
    hpckpt wrote beside the tensors (`converters.values_sidecar`), read when present. A key stored
    whole in several files is read from the one `owners` (an index's weight_map) names, as
    Hugging Face loaders do; without one, from the first, with a warning.
    """
    locator = locator if locator is not None else DataFileLocator(root)  # (a format's own, reading its values)
    tensors: dict[str, TensorEntry] = {}
    frameworks = set()
    headers = []
    twice: list[str] = []
    for name in files:
        header = locator.header(name)
        headers.append(header)
        frameworks.add({"ms": "mindspore", "pt": "torch"}.get(header.metadata.get("format", ""), None))
        offsets = saved_offsets(header) if assemble else None
        for key, info in header.entries.items():
            at = offsets[key] if offsets is not None else (0,) * len(info.shape)
            chunk = Chunk(Box(at, info.shape), name, key)
            entry = tensors.get(key)
            if entry is None:
                tensors[key] = TensorEntry(key, info.dtype, chunk.box.ends, [chunk], info.dtype.safetensors)
            elif offsets is not None:
                _add_piece(entry, chunk, info.dtype, name)
            elif owners is not None and owners.get(key) == name:
                tensors[key] = TensorEntry(key, info.dtype, info.shape, [chunk], info.dtype.safetensors)
            elif owners is None or owners.get(key) is None:
                twice.append(key)
    frameworks.discard(None)
    carried, notes, warnings = carried_metadata(headers)
    if twice:
        warnings.append(f"{len(twice)} tensor(s) stored whole in several files and named by no index, "
                        f"e.g. {twice[0]!r}: the first file's copy is read")
    if not assemble:
        warnings = [n for header in headers for n in single_file_notes(header)] + warnings
    return CheckpointIndex(
        root=root,
        format=fmt,
        format_version="1",
        framework=frameworks.pop() if len(frameworks) == 1 else None,
        tensors=dict(sorted(tensors.items())),
        values=values_sidecar.value_entries(root, sidecar) if sidecar and lexists(root / sidecar) else {},
        data_files=sorted(files),
        locator=locator,
        notes=notes,
        warnings=warnings,
        user_metadata=carried,
    )


def _add_piece(entry: TensorEntry, chunk: Chunk, dtype, name: str) -> None:
    """One more piece of a tensor saved in pieces: the tensor grows to hold it."""
    if dtype != entry.dtype:
        raise CorruptMetadataError(f"{name}: piece of {entry.fqn} is {dtype}, another file's is {entry.dtype}")
    if len(chunk.box.sizes) != len(entry.shape):
        raise CorruptMetadataError(f"{name}: piece of {entry.fqn} has {len(chunk.box.sizes)} dims, another file's "
                                   f"{len(entry.shape)}")
    if any(c.box == chunk.box for c in entry.chunks):
        return  # the same piece saved twice (a replica): one is enough
    entry.chunks.append(chunk)
    entry.n_chunks = len(entry.chunks)
    entry.shape = tuple(max(a, b) for a, b in zip(entry.shape, chunk.box.ends))




def _single_file(path: Path) -> Path | None:
    if path.is_file():
        return path
    if path.is_dir():
        # `_rank{r}_.safetensors` alone is a HyperParallel rank file whose metadata is missing
        # (an interrupted save), not a one-file checkpoint.
        candidates = sorted(path.glob("*.safetensors"))
        alone = len(candidates) == 1 and not HP_RANK_FILE.match(candidates[0].name)
        if alone and not (path / "model.safetensors.index.json").exists():
            return candidates[0]
    return None


def _is_zip(path: Path) -> bool:
    try:
        with input_files.open_file(path) as f:
            return f.read(4) == ZIP_MAGIC
    except HpckptError:
        return not lexists(path)  # a FIFO or a directory is ours, to say what it is
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
        return index_safetensors_files(single.parent, [single.name], self.name, assemble=False,
                                       sidecar=values_sidecar.sidecar_name(single.name))


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


def safetensors_file(name: str, items: list[tuple[PlannedTensor, PlannedBox]], flavour: str,
                     user_metadata: Mapping[str, str] | None = None) -> FileLayout:
    """One safetensors file of whole tensors under their own names, header first; the source's
    `user_metadata` keys go into `__metadata__` before hpckpt's own, which win."""
    metadata = dict(sorted((user_metadata or {}).items()))
    metadata["format"] = flavour
    head, offsets = safetensors_io.encode_header([(t.fqn, t.dtype, t.shape) for t, _ in items], metadata)
    boxes = tuple(Placement(t, b, (Extent(at, t.box_nbytes(b)),)) for (t, b), at in zip(items, offsets))
    return FileLayout(name, len(head) + sum(p.nbytes for p in boxes), ((0, head),), boxes)


def flavour(options: WriterOptions) -> str:
    """The `__metadata__` format: "pt" unless MindSpore's flavour is asked for (Hugging Face
    loaders accept only pt/tf/flax/mlx)."""
    return "ms" if options.framework == "mindspore" else "pt"


class SafetensorsWriter:
    """`FormatWriter` of one safetensors file; non-tensor values go into `NAME.values.json`."""

    def __init__(self, options: WriterOptions):
        self.options = options
        self._sidecar: tuple[tuple[str, bytes], ...] = ()

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        name, converted = self.options.name, ()
        if values:
            data, converted = values_sidecar.encode(values)
            self._sidecar = ((values_sidecar.sidecar_name(name), data),)
        return OutputLayout((safetensors_file(name, whole_tensors(plan, "safetensors"), flavour(self.options),
                                              dict(self.options.user_metadata)),), converted=converted)

    def expected_files(self, plan: Plan) -> list[str]:
        return [self.options.name]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        return Finished(metadata=self._sidecar)
