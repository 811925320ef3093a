"""HyperParallel `.layout` JSON files: the layout of each param, as every rank recorded it.

A file maps a rank to its params, each with `device_matrix`, `tensor_map`, `full_shape` and
optionally `rank_list` and `uneven_shard_mesh_dims`; several files are merged like
HyperParallel's `combine_layout`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpckpt.core.errors import CorruptMetadataError, GeometryError, PathNotFoundError
from hpckpt.core.geometry.layout.mesh import Mesh
from hpckpt.core.geometry.layout.placements import Replicate
from hpckpt.core.geometry.layout.tensor_layout import TensorLayout, from_tensor_map


@dataclass
class LayoutRecords:
    """What `.layout` files say: layouts, recorded full shapes and every rank mentioned."""

    layouts: dict[str, TensorLayout]
    shapes: dict[str, tuple[int, ...]]
    ranks: list[int]


def load_layout_file(path: str | Path | Sequence[str | Path]) -> dict[str, TensorLayout]:
    """Read HyperParallel `.layout` JSON file(s) into `{param: TensorLayout}`.

    `path` is one file, a directory (every `*.layout` in it) or a list of files; they are merged
    like HyperParallel's `combine_layout`. A param without `device_matrix` is unsharded: it is
    Replicate over the ranks that list it.

    Raises:
        PathNotFoundError: a file or directory does not exist.
        CorruptMetadataError: not JSON of the expected structure, a rank in two files, two
            ranks giving different layouts for one param, or a tensor_map whose length is not
            the full_shape's.
        GeometryError: a layout that cannot apply to its recorded full shape.
    """
    return read_layout_records(path).layouts


def _layout_paths(path: str | Path | Sequence[str | Path]) -> list[Path]:
    paths = [Path(p) for p in ([path] if isinstance(path, (str, Path)) else path)]
    out: list[Path] = []
    for p in paths:
        if not p.exists():
            raise PathNotFoundError(f"{p}: no such file or directory")
        out += sorted(p.glob("*.layout")) if p.is_dir() else [p]
    if not out:
        raise PathNotFoundError(f"no .layout files in {', '.join(map(str, paths))}")
    return out


def read_layout_records(path: str | Path | Sequence[str | Path]) -> LayoutRecords:
    """Read `.layout` file(s) with their full shapes and ranks, which a `LayoutSpec` also needs.

    Raises:
        PathNotFoundError, CorruptMetadataError, GeometryError: see `load_layout_file`.
    """
    per_rank: dict[int, tuple[Path, dict]] = {}
    for p in _layout_paths(path):
        for rank, params in _load_json_object(p).items():
            r = _int_key(rank, p)
            if r in per_rank:
                raise CorruptMetadataError(f"rank {r} appears in both {per_rank[r][0]} and {p}")
            if not isinstance(params, dict):
                raise CorruptMetadataError(f"{p}: rank {r} maps to {type(params).__name__}, expected an object")
            per_rank[r] = (p, params)
    return _merge_ranks(per_rank)


def _load_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptMetadataError(f"{path}: not a readable JSON layout file ({exc})") from None
    if not isinstance(data, dict):
        raise CorruptMetadataError(f"{path}: expected a JSON object keyed by rank")
    return data


def _int_key(key: str, path: Path) -> int:
    try:
        return int(key)
    except ValueError:
        raise CorruptMetadataError(f"{path}: key {key!r} is not a rank number") from None


def _merge_ranks(per_rank: dict[int, tuple[Path, dict]]) -> LayoutRecords:
    """Combine each rank's view; a sharded param must look the same from every rank."""
    layouts: dict[str, TensorLayout] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    holders: dict[str, list[int]] = {}
    for rank in sorted(per_rank):
        path, params = per_rank[rank]
        for name, rec in params.items():
            layout, shape = _parse_param(name, rec, path)
            if shape is not None and shapes.setdefault(name, shape) != shape:
                raise CorruptMetadataError(f"{path}: {name} has full_shape {list(shape)}, another rank says {list(shapes[name])}")
            if layout is None:
                holders.setdefault(name, []).append(rank)
            elif layouts.setdefault(name, layout) != layout:
                raise CorruptMetadataError(f"{path}: rank {rank} gives {name} the layout {layout}, another rank {layouts[name]}")
    for name, ranks in holders.items():
        if name not in layouts:
            layouts[name] = TensorLayout(Mesh((len(ranks),), tuple(ranks)), (Replicate(),))
    for name, layout in layouts.items():
        if name in shapes:
            layout.validate(shapes[name])
    return LayoutRecords(layouts, shapes, sorted(per_rank))


def _parse_param(name: str, rec: object, path: Path) -> tuple[TensorLayout | None, tuple[int, ...] | None]:
    """One param record -> (layout or None when unsharded, full shape or None)."""
    if not isinstance(rec, dict):
        raise CorruptMetadataError(f"{path}: {name} maps to {type(rec).__name__}, expected an object")
    try:
        shape = None if rec.get("full_shape") is None else tuple(int(s) for s in rec["full_shape"])
        if rec.get("device_matrix") is None:
            return None, shape
        if rec.get("interleaved_parallel"):
            raise GeometryError(f"{path}: {name} uses interleaved_parallel, which hpckpt does not support")
        tensor_map = [_json_entry(e) for e in rec["tensor_map"]]
        if shape is not None and len(tensor_map) != len(shape):
            raise ValueError(f"tensor_map {tensor_map} has {len(tensor_map)} entries for full_shape {list(shape)}")
        layout = from_tensor_map(
            [int(s) for s in rec["device_matrix"]], tensor_map, rec.get("rank_list"),
            rec.get("uneven_shard_mesh_dims") or (),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptMetadataError(f"{path}: {name}: malformed layout record ({exc})") from None
    return layout, shape


def _json_entry(entry: object) -> int | tuple[int, ...]:
    return tuple(int(m) for m in entry) if isinstance(entry, list) else int(entry)

