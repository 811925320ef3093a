"""PyTorch DCP values that hold tensors, read as tensors.

`DefaultSavePlanner(flatten_state_dict=False)` stores each top-level entry that is not a tensor
whole, as one torch.save record (a BYTE_IO item): `{"opt": {"m": t, "lr": 0.1}}` is one record
holding a tensor; any planner does the same with a tuple of tensors. Left as one value, every
target would lose those tensors. So a record that holds storages is opened (its zip directory and
small pickle only), its tensors become tensors named as DCP's flattening names them (`opt.m`,
`opt.hist.0`; `core.nesting`), each one chunk located inside the record's byte range, and its
other leaves become values (`opt.lr`). Records without tensors stay one value.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpckpt.core.codecs.torch_records import TensorRecord, is_tensor_record
from hpckpt.core.codecs.torch_zip import load_record
from hpckpt.core.codecs.zip_directory import records_with_storages
from hpckpt.core.errors import CorruptMetadataError, HpckptError
from hpckpt.core.geometry.box import Box
from hpckpt.core.index import Chunk, TensorEntry, ValueEntry
from hpckpt.core.nesting import flatten_nested, holds_tensor
from hpckpt.core.paths import resolve_inside


@dataclass
class Expanded:
    """The entries of a checkpoint once records holding tensors are flattened."""

    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    values: dict[str, ValueEntry] = field(default_factory=dict)
    planner: dict[str, tuple] = field(default_factory=dict)
    records: dict[tuple[str, str], TensorRecord] = field(default_factory=dict)  # (file, chunk key) -> tensor
    leaves: dict[str, Any] = field(default_factory=dict)  # value name -> its decoded leaf


def _trees_holding_tensors(root: Path, values: dict[str, ValueEntry], skip: set[tuple[str, str]]) -> dict[str, Any]:
    """name -> decoded record of every value whose record holds a storage. A record that cannot
    be read stays a value: decoding it reports the problem where values are shown or checked."""
    by_file: dict[str, list[ValueEntry]] = defaultdict(list)
    for entry in values.values():
        if (entry.file, f"{entry.offset}:{entry.length}") not in skip:
            by_file[entry.file].append(entry)
    trees = {}
    for file, entries in by_file.items():
        try:
            path = resolve_inside(root, file)
            flags = records_with_storages(path, [(e.offset, e.length) for e in entries])
        except HpckptError:
            continue
        for entry, holds in zip(entries, flags):
            if holds:
                try:
                    tree = load_record(path, entry.offset, entry.length)
                except HpckptError:
                    continue
                if holds_tensor(tree, is_tensor_record, tuples=True):
                    trees[entry.fqn] = tree
    return trees


def expand(root: Path, order: list[str], tensors: dict[str, TensorEntry], values: dict[str, ValueEntry],
           planner: dict[str, tuple], transformed: set[tuple[str, str]]) -> Expanded:
    """Entries in `order` (metadata order), each value whose record holds tensors replaced by
    its leaves; `planner` gains each leaf's key path, as DCP's flattening records it.

    Raises:
        CorruptMetadataError: a leaf's name is also the name of another entry.
    """
    trees = _trees_holding_tensors(root, values, transformed)
    out = Expanded(planner=dict(planner))
    taken = {fqn: fqn for fqn in order if fqn not in trees}  # name -> the entry that holds it
    for fqn in order:
        if fqn in tensors:
            out.tensors[fqn] = tensors[fqn]
        elif fqn not in trees:
            out.values[fqn] = values[fqn]
        else:
            _add_leaves(root, fqn, trees[fqn], values[fqn], taken, out)
    return out


def _add_leaves(root: Path, fqn: str, tree: Any, record: ValueEntry, taken: dict[str, str], out: Expanded) -> None:
    base, key = tuple(out.planner.pop(fqn, (fqn,))), f"{record.offset}:{record.length}"
    for name, leaf in flatten_nested({fqn: tree}, is_tensor_record, tuples=True):
        if name in taken:
            first = "a top-level entry" if taken[name] == name else f"a leaf of {taken[name]!r}"
            raise CorruptMetadataError(f"{root}: two entries are named {name!r}: {first} and a leaf of {fqn!r}")
        taken[name] = fqn
        try:
            out.planner[name] = base + _key_path(tree, name[len(fqn) + 1:])
        except LookupError:  # not expected: flattening named a path that is not there
            out.planner[name] = (name,)
        if is_tensor_record(leaf):
            chunk = Chunk(Box((0,) * len(leaf.shape), leaf.shape), file=record.file, key=f"{key}/{name}")
            out.records[(record.file, chunk.key)] = leaf
            out.tensors[name] = TensorEntry(name, leaf.dtype, leaf.shape, [chunk], dtype_spelling=leaf.dtype.torch)
        else:
            out.leaves[name] = leaf
            out.values[name] = ValueEntry(name, record.file, record.offset, record.length, encoding="torch_save")


def _key_path(tree: Any, rest: str) -> tuple:
    """The keys leading to the leaf that flattening named `rest` below `tree` (dict keys may hold
    dots, so every key that fits is tried)."""
    if not rest:
        return ()
    if isinstance(tree, Mapping):
        keys = list(tree)
    elif isinstance(tree, (list, tuple)):
        keys = list(range(len(tree)))
    else:
        raise LookupError(rest)
    for k in sorted((k for k in keys if rest == str(k) or rest.startswith(f"{k}.")), key=lambda k: -len(str(k))):
        try:
            return (k, *_key_path(tree[k], rest[len(str(k)) + 1:]))
        except LookupError:
            continue
    raise LookupError(rest)
