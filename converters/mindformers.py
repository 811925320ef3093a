"""MindFormers Checkpoint 2.0 (`use_legacy_format: False`, format delta B), read and written.

A save is one `iteration_{:08d}/` directory under a root whose `latest_checkpointed_iteration.txt`
names the newest; in it, `metadata.json` (rank 0: per parameter its dtype, global shape and
chunks, and `storage_data`, which maps the repr of `(name, global_offset)` to the files holding
that chunk), `common.json` (epoch, step, loss scale, ...) and `{prefix}-model-{i:07d}-{n:07d}.safetensors`
/ `-opt-` files: plain MindSpore safetensors keyed by parameter name, each holding its local slice.
With remove-redundancy each chunk is listed once; without, every replica's file is listed and the
first is read. A single card writes no `metadata.json`: the tensors are whole, read from the headers.
`common.json`'s entries are the checkpoint's values, as `common.KEY`.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.data_files import DataFileLocator
from hpckpt.converters.safetensors_file import index_safetensors_files
from hpckpt.core import dtypes
from hpckpt.core.codecs.safetensors_io import encode_header
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    HpckptError,
    MissingFileError,
    ReshardOptionError,
    UnknownFormatError,
)
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import to_tensor_map
from hpckpt.core.geometry.rank_boxes import rank_boxes
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry, ValueEntry
from hpckpt.core.io.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.commit.replace import replace_file
from hpckpt.core.safety import input_files
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import lexists

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
COMMON = "common.json"
ITERATION = re.compile(r"iteration_(\d{8})")
SHARD = re.compile(r"(?:.+-)?(?:model|opt)-(\d{7})-(\d{7})\.safetensors")
#: `common.json`'s entries are values named `common.KEY` (the optimizer file has a `global_step`
#: tensor of its own).
VALUE_PREFIX = "common."
#: A storage_data key is the repr of a short tuple: longer is not one MindFormers wrote.
MAX_KEY = 4096


def iteration_of(path: Path) -> Path | None:
    """The iteration directory `path` is, or the newest its tracker names; None when it is neither."""
    if not path.is_dir():
        return None
    if not lexists(path / TRACKER):
        return path if _is_iteration(path) else None
    text = _tracker_text(path / TRACKER)
    if not text.isdigit():
        raise CorruptMetadataError(f"{path / TRACKER}: {text[:40]!r} is not an iteration number")
    found = path / f"iteration_{int(text):08d}"
    if not found.is_dir():
        raise MissingFileError(f"{path / TRACKER} names iteration {int(text)}, but {found.name}/ is missing")
    return found


def _tracker_text(tracker: Path) -> str:
    """What a tracker file says (MindFormers writes the bare number)."""
    return input_files.read_small(tracker, "tracker file", 64).decode("ascii", "replace").strip()


class MindFormersLocator(DataFileLocator):
    """Tensors as in any safetensors checkpoint; values are `common.json`'s entries."""

    def __init__(self, root: Path, common: dict):
        super().__init__(root)
        self._common = common  # common.json, read once with the metadata

    def decode_value(self, entry: ValueEntry) -> Any:
        if entry.encoding != "json-field":
            return super().decode_value(entry)
        key = entry.fqn.removeprefix(VALUE_PREFIX)
        if key not in self._common:
            raise CorruptDataError(f"{entry.file}: no entry {key!r} (changed since it was read?)")
        return self._common[key]


class MindFormersReader:
    name = "mindformers"

    def sniff(self, path: Path) -> bool:
        if not path.is_dir():
            return False
        if lexists(path / TRACKER):
            return any(ITERATION.fullmatch(p.name) for p in path.iterdir())
        return _is_iteration(path)

    def read_index(self, path: Path) -> CheckpointIndex:
        root = iteration_of(path)
        if root is None:
            raise CorruptMetadataError(f"{path}: no MindFormers iteration directory")
        # names relative to what was asked for: a checkpoint root is the tracker and its iteration
        prefix = "" if root == path else f"{root.name}/"
        shards = sorted(p.name for p in root.iterdir() if SHARD.fullmatch(p.name))
        common = _read_json(root / COMMON, "common.json") if lexists(root / COMMON) else None
        locator = MindFormersLocator(path, common or {})
        if lexists(root / METADATA):
            index = self._with_metadata(path, prefix, locator)
        else:  # a single card: whole tensors, as the headers say
            index = index_safetensors_files(path, [prefix + s for s in shards], self.name, locator=locator)
            index.notes.append("no metadata.json (a single card's save): every tensor whole, from the file headers")
        index.format, index.format_version, index.framework = self.name, "2.0", "mindspore"
        if common is not None:
            size = (root / COMMON).stat().st_size
            index.values.update({f"{VALUE_PREFIX}{k}": ValueEntry(f"{VALUE_PREFIX}{k}", prefix + COMMON, 0, size,
                                                                  encoding="json-field") for k in sorted(common)})
            index.metadata_files.append(prefix + COMMON)
        if prefix:
            index.notes.append(f"reading {root.name}, the iteration {TRACKER} names")
            index.metadata_files.insert(0, TRACKER)
        sizes = {int(m.group(2)) for s in shards if (m := SHARD.fullmatch(s))}
        index.world_size = max(sizes) if sizes else index.world_size
        return index

    def _with_metadata(self, path: Path, prefix: str, locator: MindFormersLocator) -> CheckpointIndex:
        doc = _read_json(path / prefix / METADATA, "metadata.json")
        where = f"{path / prefix / METADATA}"
        try:
            state, storage = doc["state_dict_metadata"], doc["storage_data"]
            if not isinstance(state, dict) or not isinstance(storage, dict):
                raise TypeError("state_dict_metadata and storage_data must be objects")
            files_of = {_storage_key(key, where): [e["file_name"] for e in entries] for key, entries in storage.items()}
            tensors: dict[str, TensorEntry] = {}
            for name, item in state.items():
                spelling = item["properties"]["dtype"]
                shape = tuple(int(n) for n in item["global_shape"])
                grid = tuple(int(n) for n in item.get("axis_fragmentations") or (1,) * len(shape))
                chunks = []
                for c in item["chunk"]:
                    shard = tuple(int(n) for n in c["global_offset"])
                    sizes = tuple(int(n) for n in c["local_shape"])
                    holders = files_of.get((name, shard))
                    if not holders:
                        raise CorruptMetadataError(f"{where}: chunk {list(shard)} of {name!r} has no storage_data entry")
                    box = Box(_element_offsets(shard, grid, sizes, f"{where}: {name!r}"), sizes)
                    chunks.append(Chunk(box, prefix + _file_name(holders[0], where), name))
                tensors[name] = TensorEntry(name, dtypes.dtype(spelling), shape, chunks, str(spelling))
        except UnknownFormatError as exc:
            raise UnknownFormatError(f"{where}: {exc.message}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptMetadataError(f"{where}: not MindFormers checkpoint metadata ({type(exc).__name__}: {exc})") from None
        # every file storage_data names, replicas' too: `verify` checks each is there and sound
        files = sorted({prefix + _file_name(f, where) for holders in files_of.values() for f in holders})
        return CheckpointIndex(root=path, format=self.name, format_version="2.0", framework="mindspore",
                               tensors=tensors, values={}, data_files=files, locator=locator,
                               metadata_files=[prefix + METADATA])


def _element_offsets(shard: tuple[int, ...], grid: tuple[int, ...], sizes: tuple[int, ...], where: str) -> tuple[int, ...]:
    """A chunk's element offsets. MindFormers records a chunk by its slice number, not its
    offsets (`global_offset` is `(slice,)`): the slice's place in the grid of fragments
    (`axis_fragmentations`, numbered row-major, the last dimension fastest, as its
    `_tensor_map_with_rank_id` strides them) times the equal local shape of every slice."""
    if len(grid) != len(sizes) or len(shard) != 1 or any(g < 1 for g in grid):
        raise CorruptMetadataError(f"{where}: chunk {list(shard)} does not fit axis_fragmentations {list(grid)}")
    slice_id, total = shard[0], math.prod(grid)
    if not 0 <= slice_id < total:
        raise CorruptMetadataError(f"{where}: slice {slice_id} of {total} (axis_fragmentations {list(grid)})")
    coords = []
    for g in reversed(grid):
        slice_id, c = divmod(slice_id, g)
        coords.append(c)
    return tuple(c * s for c, s in zip(reversed(coords), sizes))


def _is_iteration(path: Path) -> bool:
    """One save: MindFormers' `metadata.json`, or its `common.json` beside its shard files (a
    single card's save, or one named by an `iteration_*` directory)."""
    if _is_mindformers_metadata(path / METADATA):
        return True
    return lexists(path / COMMON) and (bool(ITERATION.fullmatch(path.name))
                                       or any(SHARD.fullmatch(p.name) for p in path.iterdir()))


def _is_mindformers_metadata(path: Path) -> bool:
    """MindFormers' `metadata.json`, not Megatron's (whose keys are `sharded_backend`, ...)."""
    if not lexists(path):
        return False
    head = input_files.read_small(path, "metadata.json", input_files.MAX_INDEX_BYTES)[:4096]
    return b'"state_dict_metadata"' in head or b'"storage_data"' in head


def _read_json(path: Path, what: str) -> dict:
    doc = input_files.load_json(input_files.read_small(path, what, input_files.MAX_INDEX_BYTES), f"{path}: {what}")
    if not isinstance(doc, dict):
        raise CorruptMetadataError(f"{path}: {what} is not a JSON object")
    return doc


def _storage_key(key: str, where: str) -> tuple[str, tuple[int, ...]]:
    """`"('name', (0, 4))"` as `(name, offsets)`: a literal, parsed as one (never evaluated)."""
    if not isinstance(key, str) or len(key) > MAX_KEY:
        raise CorruptMetadataError(f"{where}: storage_data key {str(key)[:60]!r} is not a (name, offset) tuple")
    try:
        name, offset = ast.literal_eval(key)
        offsets = tuple(offset)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise CorruptMetadataError(f"{where}: storage_data key {key[:60]!r} is not a (name, offset) tuple") from None
    if not isinstance(name, str) or not all(type(n) is int for n in offsets):
        raise CorruptMetadataError(f"{where}: storage_data key {key[:60]!r} is not a (name, offset) tuple")
    return name, offsets


def _file_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not SHARD.fullmatch(name):
        raise CorruptMetadataError(f"{where}: storage file {str(name)[:80]!r} is not a MindFormers shard name")
    return name


# -- writing -------------------------------------------------------------------------------------

#: `common.json`'s fields (MindFormers' `CommonInfo`, in its order); those the source lacks are left
#: out (MindFormers' `CommonInfo` has a default for each).
COMMON_FIELDS = ("epoch_num", "step_num", "global_step", "loss_scale", "global_batch_size", "consumed_samples",
                 "ckpt_status")


def model_file(rank: int, world_size: int) -> str:
    return f"model-{rank:07d}-{world_size:07d}.safetensors"


class MindFormersWriter:
    """`FormatWriter` of one MindFormers Checkpoint 2.0 iteration directory (the destination;
    MindFormers' `load_checkpoint` takes it as it is, or under a root with its tracker file).

    Per storing rank `model-{r:07d}-{n:07d}.safetensors` (MindSpore safetensors keyed by parameter
    name; each box once, the remove-redundancy form, or with the plan's `every_replica` on every
    rank holding it, MindFormers' default), `common.json` from the source's `common.*` values, and
    `metadata.json` last, whose layouts describe the target mesh (`WriterOptions.layout`).
    MindFormers keeps a tensor as equal slices on a grid (`axis_fragmentations`): a layout that
    splits a dimension unevenly is refused."""

    def __init__(self, options: WriterOptions, value_lengths=None, payloads=None):
        self._plan: Plan | None = None
        self._common: dict[str, Any] = {}
        self._spec = options.layout  # each tensor's target layout: what `layout` and `rank_group` say

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        self._plan = plan
        self._grids = {t.fqn: _grid(t) for t in plan.tensors}
        skipped = self.dropped_by_name(v.fqn for v in plan.values)
        left_out = {fqn for fqn, _ in skipped}
        self._common = {value.fqn.removeprefix(VALUE_PREFIX): values[value.fqn]
                        for value in plan.values if value.fqn not in left_out}
        files = []
        for rank, items in plan.by_rank.items():
            if rank not in plan.producing:
                continue
            head, offsets = encode_header([(t.fqn, t.dtype, b.box.sizes) for t, b in items], {"format": "ms"})
            boxes = tuple(Placement(t, b, (Extent(at, t.box_nbytes(b)),)) for (t, b), at in zip(items, offsets))
            files.append(FileLayout(model_file(rank, plan.world_size), len(head) + sum(p.nbytes for p in boxes),
                                    ((0, head),), boxes))
        return OutputLayout(tuple(files), skipped=tuple(skipped))

    def expected_files(self, plan: Plan) -> list[str]:
        return sorted(model_file(r, plan.world_size) for r in plan.storing_ranks if r in plan.producing)

    @staticmethod
    def dropped_by_name(values: Iterable[str]) -> list[tuple[str, str]]:
        """`(fqn, reason)` of the values this format leaves out whatever they hold: all but
        common.json's fields. A dry run says them from the names alone, as the run will."""
        reason = ("MindFormers Checkpoint 2.0 holds tensors, and of other values only "
                  f"common.json's fields ({', '.join(COMMON_FIELDS)}) as common.KEY")
        return [(fqn, reason) for fqn in values
                if not (fqn.startswith(VALUE_PREFIX) and fqn.removeprefix(VALUE_PREFIX) in COMMON_FIELDS)]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        plan = self._plan
        assert plan is not None, "layout() first"
        common = {k: _json_value(self._common[k]) for k in COMMON_FIELDS if k in self._common}  # (the rest: defaults)
        return Finished(metadata=((COMMON, json.dumps(common, indent=4).encode()),
                                  (METADATA, json.dumps(self.metadata(), separators=(",", ":")).encode())))

    def metadata(self) -> dict:
        plan = self._plan
        state, storage = {}, {}
        for tensor in plan.tensors:
            grid, local = self._grids[tensor.fqn]
            layout = self._spec.resolve(tensor.fqn, tensor.shape) if self._spec is not None else None
            dtype = tensor.dtype.ms_spelling or tensor.dtype.name
            state[tensor.fqn] = {
                "properties": {"dtype": dtype, "replica_id": 0, "allow_shape_mismatch": False, "allow_to_save": True},
                "global_shape": list(tensor.shape), "axis_fragmentations": list(grid),
                "layout": _layout(layout, len(tensor.shape)), "chunk": []}
            holders = _holders(layout, tensor.shape, grid, local)
            for planned in tensor.boxes:
                shard = _slice_number(planned.box.offsets, grid, local)
                key = str((tensor.fqn, (shard,)))
                if key not in storage:
                    state[tensor.fqn]["chunk"].append({"global_offset": [shard], "local_shape": list(local)})
                # `rank_group`: every rank of the layout holding the slice; MindFormers' loader
                # finds a slice's file through it (or `storage_rank`) from the rank the layout names
                storage.setdefault(key, []).append({"file_name": model_file(planned.rank, plan.world_size),
                                                    "storage_rank": planned.rank,
                                                    "rank_group": holders.get(shard, [planned.rank])})
        return {"state_dict_metadata": state, "storage_data": storage}


def _grid(tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The tensor's boxes as MindFormers keeps them: `(axis_fragmentations, local_shape)`, every
    box the same shape on a grid that tiles the tensor exactly.

    Raises:
        ReshardOptionError: the layout splits a dimension unevenly (or not on a grid).
    """
    shape = tuple(tensor.shape)
    sizes = {b.box.sizes for b in tensor.boxes}
    if sizes == {shape}:  # whole (an empty tensor too), on one rank or replicated
        return (1,) * len(shape), shape
    local = next(iter(sizes)) if len(sizes) == 1 else None
    ok = local is not None and all(s > 0 and n % s == 0 for n, s in zip(shape, local))
    if ok:
        grid = tuple(n // s for n, s in zip(shape, local))
        ok = all(o % s == 0 for b in tensor.boxes for o, s in zip(b.box.offsets, local))
        ok = ok and len({b.box.offsets for b in tensor.boxes}) == math.prod(grid)
    if not ok:
        raise ReshardOptionError(
            f"tensor {tensor.fqn!r} {list(shape)} is split into unequal pieces ({sorted(map(list, sizes))[:3]}): "
            "MindFormers keeps a tensor as equal slices on a grid",
            hint="choose a world size or mesh whose splits divide every dimension they split")
    return grid, local


def _layout(layout, ndim: int) -> dict | None:
    """The target layout as MindSpore's `Layout.to_dict()`: the whole device mesh (its
    replicating axes too) and the tensor_map of the axes that split the tensor, so that each
    rank's slice is the one it holds in the output (MindFormers' loader looks a slice up by the
    rank this layout gives it). None on one rank (a single card's save has no layout). The keys
    in MindFormers' order: its loader unpacks them by position."""
    if layout is None or layout.mesh.size == 1:
        return None
    return {"device_matrix": list(layout.mesh.shape), "tensor_map": to_tensor_map(layout, ndim),
            "interleaved_parallel": False, "alias_name": [f"d{i}" for i in range(layout.mesh.ndim)],
            "rank_list": list(layout.mesh.ranks)}


def _holders(layout, shape: tuple[int, ...], grid: tuple[int, ...], local: tuple[int, ...]) -> dict[int, list[int]]:
    """Slice number -> the ranks holding it under `layout` (none known without one)."""
    if layout is None:
        return {}
    boxes, empty_tensor = rank_boxes(layout, tuple(shape)), 0 in shape
    out: dict[int, list[int]] = {}
    for i, (offsets, sizes) in enumerate(zip(boxes.offsets.tolist(), boxes.sizes.tolist())):
        if empty_tensor or 0 not in sizes:  # (an empty box of a split is no slice)
            out[_slice_number(tuple(offsets), grid, local)] = sorted(int(r) for r in boxes.holders(i))
    return out


def _slice_number(offsets: tuple[int, ...], grid: tuple[int, ...], local: tuple[int, ...]) -> int:
    """The inverse of `_element_offsets`: a box's slice number, row-major over the grid."""
    number = 0
    for o, g, s in zip(offsets, grid, local):
        number = number * g + (o // s if s else 0)
    return number


def update_tracker(dest) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """After an output named `iteration_{:08d}` is committed, point its root at it as MindFormers'
    saver does last: `latest_checkpointed_iteration.txt` beside it, the bare number, replaced whole.
    A tracker that already names a newer iteration is left as it is (said); another output name
    has no root, and nothing is written. Returns `(paths written, warnings)`."""
    found = ITERATION.fullmatch(dest.name)
    if found is None:
        return (), ()
    number, tracker = int(found.group(1)), dest.parent / TRACKER
    try:
        text = _tracker_text(tracker) if lexists(tracker) else ""
        current = int(text) if text.isdigit() else None
        if current is not None and current > number:
            return (), (f"destination: {tracker} names iteration {current}, newer than {dest.name}: left as it is",)
        if is_object(tracker):
            tracker.store.put(tracker.key, str(number).encode())
        else:
            replace_file(tracker, str(number).encode(), fsync=True, fsync_dir=True)
    except (OSError, HpckptError) as exc:  # the output is complete and loads by its own path: said, not undone
        reason = exc.message if isinstance(exc, HpckptError) else f"{tracker}: {exc.strerror or exc}"
        return (), (f"destination: the tracker was not updated ({reason}); {dest.name} is complete, but the "
                    "root's tracker does not name it",)
    return (str(tracker),), ()


def _json_value(value: Any) -> Any:
    """A common.json field as JSON holds it (numbers, strings, null)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):  # a 0-d array
        return value.item()
    return str(value)
