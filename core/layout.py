"""Layouts: which box of a global tensor each rank of a device mesh holds.

The resharding engine describes a source or target checkpoint as one `TensorLayout` per tensor:
a `Mesh` (shape plus the global ranks in row-major order, last mesh dim fastest) and one placement
per mesh dim, PyTorch DTensor style:

* `Shard(dim, rule)`: split tensor dim `dim` over that mesh dim. `rule="balanced"` is
  HyperParallel's default (the first `len % n` parts are one larger, like `numpy.array_split`);
  `rule="ceil"` is PyTorch's (`torch.chunk`: parts of `ceil(len / n)`, trailing parts may be
  empty). Several Shards of the same tensor dim split it successively, the first mesh dim being
  the outermost split.
* `Replicate()`: every rank along that mesh dim holds the same data.
* `RaggedShard(dims, local_units)`: HyperParallel's non-uniform flat sharding; each rank holds a
  flat row-major interval, recorded as the minimal ordered sequence of N-D boxes (spec 5.4).

Empty boxes (size 0 on some dim) are returned like any other, because HyperParallel records
them as chunks. Converters read MindSpore/HyperParallel `tensor_map`s and `.layout` JSON files,
`LayoutSpec` resolves a target layout per tensor from a world size, rules or layout files, and
`infer` recognises the layout that produced a saved tensor's chunk boxes.

Placement text (`parse_placements`, one token per mesh dim): `R`, `S<d>` or `S(<d>)`, optionally
`S<d>:ceil` / `S<d>:balanced`, and `Ragged(<dims>;<units>)`. Rules files are TOML, see
`RULES_FILE_EXAMPLE`.

Errors: an impossible layout raises `GeometryError`; malformed `.layout` files raise
`CorruptMetadataError`; wrong arguments and malformed placement/mesh strings or rule files
(usage errors) raise `ValueError`.
"""

from __future__ import annotations

import fnmatch
import json
import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from hpckpt.core.box import Box, full_box
from hpckpt.core.errors import CorruptMetadataError, GeometryError, PathNotFoundError

RULES = ("balanced", "ceil")

# --------------------------------------------------------------------------------------------
# 1-D split rules


def split(length: int, parts: int, index: int, rule: str = "balanced") -> tuple[int, int]:
    """Return `(start, size)` of part `index` when `length` elements are cut into `parts`.

    Args:
        length: number of elements to split (>= 0).
        parts: number of parts (>= 1).
        index: which part, `0 <= index < parts`.
        rule: "balanced" (HyperParallel: first `length % parts` parts one larger) or "ceil"
            (PyTorch `torch.chunk`: parts of `ceil(length / parts)`, trailing parts may be empty).

    Raises:
        ValueError: an argument is out of range or the rule is unknown.
    """
    if length < 0 or parts < 1 or not 0 <= index < parts:
        raise ValueError(f"split: need length >= 0, parts >= 1, 0 <= index < parts; got {length}, {parts}, {index}")
    if rule == "balanced":
        q, r = divmod(length, parts)
        return index * q + min(index, r), q + (1 if index < r else 0)
    if rule == "ceil":
        chunk = -(-length // parts)
        start = min(index * chunk, length)
        return start, min(start + chunk, length) - start
    raise ValueError(f"unknown split rule {rule!r}; expected one of {', '.join(RULES)}")


def _check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown split rule {rule!r}; expected one of {', '.join(RULES)}")
    return rule


# --------------------------------------------------------------------------------------------
# Placements


@dataclass(frozen=True)
class Shard:
    """Split tensor dim `dim` over one mesh dim with the given rule ("balanced" or "ceil").

    Raises:
        ValueError: unknown rule.
        GeometryError: negative dim.
    """

    dim: int
    rule: str = "balanced"

    def __post_init__(self) -> None:
        _check_rule(self.rule)
        if self.dim < 0:
            raise GeometryError(f"Shard({self.dim}): the tensor dim must be >= 0")

    def __str__(self) -> str:
        return f"S{self.dim}" if self.rule == "balanced" else f"S{self.dim}:{self.rule}"


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh dim holds the same data."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class RaggedShard:
    """HyperParallel's flat, non-uniform sharding over one mesh dim (spec 5.4).

    `dims` is the prefix `(0, ..., p-1)` of tensor dims viewed as cells; rank `j` on the mesh dim
    gets `local_units[j]` units of `prod(shape[:p]) / sum(local_units)` cells each, in order.

    Raises:
        GeometryError: dims not a non-empty prefix, negative units, or units summing to 0.
    """

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "local_units", tuple(int(u) for u in self.local_units))
        if not self.dims or self.dims != tuple(range(len(self.dims))):
            raise GeometryError(f"RaggedShard dims {self.dims} must be the prefix (0, 1, ..., p-1)")
        if any(u < 0 for u in self.local_units) or sum(self.local_units) <= 0:
            raise GeometryError(f"RaggedShard units {self.local_units} must be >= 0 with a positive sum")

    def __str__(self) -> str:
        return f"Ragged({','.join(map(str, self.dims))};{','.join(map(str, self.local_units))})"


Placement = Union[Shard, Replicate, RaggedShard]


# --------------------------------------------------------------------------------------------
# Mesh


@dataclass(frozen=True)
class Mesh:
    """A device mesh: its shape and the global ranks in row-major order (last dim fastest).

    Raises:
        GeometryError: no dims, a dim < 1, or `ranks` of the wrong length or with duplicates.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...] | None = None
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise GeometryError(f"mesh shape {list(shape)}: needs at least one dim, each >= 1")
        ranks = tuple(range(math.prod(shape))) if self.ranks is None else tuple(int(r) for r in self.ranks)
        if len(ranks) != math.prod(shape):
            raise GeometryError(f"mesh {list(shape)} has {math.prod(shape)} positions but {len(ranks)} ranks")
        if len(set(ranks)) != len(ranks) or any(r < 0 for r in ranks):
            raise GeometryError(f"mesh ranks must be distinct and >= 0: {list(ranks)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_index", {r: i for i, r in enumerate(ranks)})

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._index

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """Return the mesh coordinate of a global rank (row-major, last mesh dim fastest).

        Raises:
            ValueError: the rank is not in the mesh.
        """
        if rank not in self._index:
            raise ValueError(f"rank {rank} is not in mesh {self}")
        i = self._index[rank]
        coord = []
        for n in reversed(self.shape):
            i, c = divmod(i, n)
            coord.append(c)
        return tuple(reversed(coord))

    def __str__(self) -> str:
        text = "x".join(map(str, self.shape))
        return text if self.ranks == tuple(range(self.size)) else f"{text}@{list(self.ranks)}"


# --------------------------------------------------------------------------------------------
# Tensor layout


@dataclass(frozen=True)
class TensorLayout:
    """A mesh plus one placement per mesh dim: tells the boxes every rank holds.

    `order` (rarely needed) lists the mesh dims in the order their Shards apply, outermost first;
    the default is mesh order. Only `from_tensor_map` with a tuple entry that is not in mesh
    order needs it; an order that changes nothing is normalised to None.

    Raises:
        GeometryError: placements count differs from the mesh dims, a bad RaggedShard
            combination, or `order` is not a permutation of the mesh dims.
        ValueError: an element of `placements` is not a placement.
    """

    mesh: Mesh
    placements: tuple[Placement, ...]
    order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        bad = [p for p in self.placements if not isinstance(p, (Shard, Replicate, RaggedShard))]
        if bad:
            raise ValueError(f"not a placement: {bad[0]!r}")
        self._check_structure()
        if self.order is not None:
            order = tuple(int(k) for k in self.order)
            if sorted(order) != list(range(self.mesh.ndim)):
                raise GeometryError(f"order {list(order)} is not a permutation of mesh dims 0..{self.mesh.ndim - 1}")
            object.__setattr__(self, "order", None if self._order_is_trivial(order) else order)

    def _check_structure(self) -> None:
        """Shape-independent checks, done at construction so a bad layout fails early."""
        if len(self.placements) != self.mesh.ndim:
            raise GeometryError(f"{len(self.placements)} placements for a {self.mesh.ndim}-D mesh {self.mesh}")
        ragged = [k for k, p in enumerate(self.placements) if isinstance(p, RaggedShard)]
        if not ragged:
            return
        if len(ragged) > 1 or any(not isinstance(p, Replicate) for k, p in enumerate(self.placements) if k != ragged[0]):
            raise GeometryError("a RaggedShard layout needs exactly one RaggedShard and Replicate on every other mesh dim")
        k = ragged[0]
        if len(self.placements[k].local_units) != self.mesh.shape[k]:
            raise GeometryError(
                f"RaggedShard has {len(self.placements[k].local_units)} units for mesh dim {k} of size {self.mesh.shape[k]}"
            )

    def _order_is_trivial(self, order: tuple[int, ...]) -> bool:
        """True when every tensor dim is still split in mesh order (so `order` changes nothing)."""
        for dim in {p.dim for p in self.placements if isinstance(p, Shard)}:
            seq = [k for k in order if isinstance(self.placements[k], Shard) and self.placements[k].dim == dim]
            if seq != sorted(seq):
                return False
        return True

    def validate(self, shape: Sequence[int]) -> None:
        """Check that this layout can apply to a tensor of global `shape`.

        Raises:
            GeometryError: a Shard dim the tensor does not have, or RaggedShard preconditions
                (prefix dims present, prefix cells divisible by the units' sum) not met.
        """
        self._check_structure()
        shape = tuple(shape)
        for p in self.placements:
            if isinstance(p, Shard) and p.dim >= len(shape):
                raise GeometryError(f"{p} on a {len(shape)}-D tensor {list(shape)}")
            if isinstance(p, RaggedShard):
                _check_ragged(p, shape)

    def boxes(self, shape: Sequence[int], rank: int) -> list[Box]:
        """Return the boxes `rank` holds of a tensor of global `shape` ([] when not in the mesh).

        Raises:
            GeometryError: the layout cannot apply to `shape` (see `validate`).
        """
        shape = tuple(shape)
        self.validate(shape)
        if rank not in self.mesh:
            return []
        return self._boxes(shape, self.mesh.coordinate(rank))

    def all_boxes(self, shape: Sequence[int]) -> dict[int, list[Box]]:
        """Return `{rank: boxes}` for every rank of the mesh, in mesh order.

        Raises:
            GeometryError: the layout cannot apply to `shape`.
        """
        shape = tuple(shape)
        self.validate(shape)
        return {r: self._boxes(shape, self.mesh.coordinate(r)) for r in self.mesh.ranks}

    def unique_boxes(self, shape: Sequence[int]) -> list[Box]:
        """Return the distinct boxes in rank order: what a de-duplicating save records.

        Raises:
            GeometryError: the layout cannot apply to `shape`.
        """
        seen: dict[Box, None] = {}
        for boxes in self.all_boxes(shape).values():
            seen.update(dict.fromkeys(boxes))
        return list(seen)

    def replica_groups(self, shape: Sequence[int]) -> list[list[int]]:
        """Group the mesh's ranks by identical box lists (groups in order of their first rank).

        Every rank is in exactly one group; ranks holding nothing (a RaggedShard with 0 units)
        form a group too.

        Raises:
            GeometryError: the layout cannot apply to `shape`.
        """
        groups: dict[tuple[Box, ...], list[int]] = {}
        for rank, boxes in self.all_boxes(shape).items():
            groups.setdefault(tuple(boxes), []).append(rank)
        return list(groups.values())

    def _boxes(self, shape: tuple[int, ...], coord: tuple[int, ...]) -> list[Box]:
        for k, p in enumerate(self.placements):
            if isinstance(p, RaggedShard):
                start, stop = _ragged_interval(p, shape, coord[k])
                return decompose_flat_interval(shape, start, stop)
        starts, sizes = [0] * len(shape), list(shape)
        for k in self.order or range(self.mesh.ndim):
            p = self.placements[k]
            if isinstance(p, Shard):
                offset, sizes[p.dim] = split(sizes[p.dim], self.mesh.shape[k], coord[k], p.rule)
                starts[p.dim] += offset
        return [Box(tuple(starts), tuple(sizes))]

    def __str__(self) -> str:
        text = f"[{', '.join(map(str, self.placements))}] on {self.mesh}"
        return text if self.order is None else f"{text} order={list(self.order)}"


# --------------------------------------------------------------------------------------------
# RaggedShard geometry


def _check_ragged(p: RaggedShard, shape: tuple[int, ...]) -> None:
    if len(p.dims) > len(shape):
        raise GeometryError(f"{p} needs tensor dims {list(p.dims)} but the tensor is {list(shape)}")
    cells, units = math.prod(shape[: len(p.dims)]), sum(p.local_units)
    if cells % units:
        raise GeometryError(f"{p}: {cells} prefix cells of {list(shape)} are not divisible by {units} units")


def _ragged_interval(p: RaggedShard, shape: tuple[int, ...], j: int) -> tuple[int, int]:
    """Flat row-major `[start, stop)` of rank `j` along the ragged mesh dim."""
    ndims = len(p.dims)
    elems_per_unit = math.prod(shape[:ndims]) // sum(p.local_units) * math.prod(shape[ndims:])
    first = sum(p.local_units[:j])
    return first * elems_per_unit, (first + p.local_units[j]) * elems_per_unit


def decompose_flat_interval(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Cut the flat row-major interval `[start, stop)` of a tensor into N-D boxes, in order.

    Recursively: a partial leading row, one block of whole rows, a partial trailing row. This is
    how HyperParallel records RaggedShard chunks, so the boxes match its metadata exactly.

    Raises:
        ValueError: the interval is not inside the tensor.
    """
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat interval [{start}, {stop}) is not inside a tensor of shape {list(shape)}")
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    return _decompose(shape, start, stop)


def _decompose(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if len(shape) == 1:
        return [Box((start,), (stop - start,))]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:
        return _in_row(shape, first, start - first * row, stop - first * row)
    out: list[Box] = []
    lo = first
    if start % row:
        out += _in_row(shape, first, start % row, row)
        lo += 1
    hi = stop // row
    if hi > lo:
        out.append(Box((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:]))
    if stop % row:
        out += _in_row(shape, hi, 0, stop % row)
    return out


def _in_row(shape: tuple[int, ...], index: int, start: int, stop: int) -> list[Box]:
    """Boxes of `[start, stop)` inside row `index` of axis 0, lifted to the full tensor."""
    return [Box((index,) + b.offsets, (1,) + b.sizes) for b in _decompose(shape[1:], start, stop)]


# --------------------------------------------------------------------------------------------
# MindSpore / HyperParallel tensor_map


def from_tensor_map(
    mesh_shape: Sequence[int],
    tensor_map: Sequence[int | Sequence[int]],
    rank_list: Sequence[int] | None = None,
    uneven_mesh_dims: Iterable[int] = (),
) -> TensorLayout:
    """Build a layout from a MindSpore/HyperParallel `tensor_map` (one entry per tensor dim).

    An entry `m` names mesh dim `len(mesh_shape) - 1 - m` (counted from the right); -1 means not
    split; a tuple splits the tensor dim successively along several mesh dims, first = outermost.
    `uneven_mesh_dims` (mesh dim indices, counted from the left like HyperParallel's
    `uneven_shard_mesh_dims`) use the ceil rule; all others are balanced.

    Raises:
        GeometryError: an entry names no mesh dim, or a mesh dim is used twice.
    """
    mesh = Mesh(tuple(mesh_shape), None if rank_list is None else tuple(rank_list))
    uneven = set(uneven_mesh_dims)
    placements: list[Placement] = [Replicate()] * mesh.ndim
    order: list[int] = []
    for dim, entry in enumerate(tensor_map):
        for m in _entry_dims(entry):
            k = mesh.ndim - 1 - m
            if not 0 <= m < mesh.ndim:
                raise GeometryError(f"tensor_map {list(tensor_map)}: entry {m} names no dim of mesh {list(mesh.shape)}")
            if k in order:
                raise GeometryError(f"tensor_map {list(tensor_map)}: mesh dim {k} is used twice")
            placements[k] = Shard(dim, "ceil" if k in uneven else "balanced")
            order.append(k)
    order += [k for k in range(mesh.ndim) if k not in order]
    return TensorLayout(mesh, tuple(placements), tuple(order))


def _entry_dims(entry: int | Sequence[int]) -> list[int]:
    """The mesh-dim numbers (from the right) of one tensor_map entry, -1s dropped."""
    items = [entry] if isinstance(entry, int) else list(entry)
    return [int(m) for m in items if int(m) != -1]


# --------------------------------------------------------------------------------------------
# Text syntax: meshes and placements

_SHARD = re.compile(r"S(?:HARD)?(?:(\d+)|\(\s*(\d+)\s*\))(?::(\w+))?", re.IGNORECASE)
_RAGGED = re.compile(r"RAGGED\(\s*([\d,\s]+);([\d,\s]+)\)", re.IGNORECASE)


def parse_mesh(text: str) -> Mesh:
    """Parse "2x4" (also "2,4", "8", "(2, 4)") into a Mesh with the default ranks.

    Raises:
        ValueError: not a list of positive integers.
    """
    body = re.sub(r"\s+", "", text).strip("()[]").lower()
    if not re.fullmatch(r"\d+(?:[x×,*]\d+)*", body):
        raise ValueError(f"bad mesh {text!r}: expected sizes like '8' or '2x4'")
    sizes = tuple(int(p) for p in re.split(r"[x×,*]", body))
    if not all(sizes):
        raise ValueError(f"bad mesh {text!r}: every size must be >= 1")
    return Mesh(sizes)


def parse_placements(text: str, rule: str = "balanced") -> tuple[Placement, ...]:
    """Parse placements, one per mesh dim, e.g. "R,S0", "[S(0), S1:ceil]", "Ragged(0,1;7,8,0,15)".

    Tokens: `R` (Replicate); `S<d>` or `S(<d>)` (Shard of tensor dim d with `rule`), optionally
    suffixed `:balanced` or `:ceil` to override `rule`; `Ragged(<dims>;<units>)` (RaggedShard).
    `str()` of a placement tuple element round-trips with the default rule.

    Raises:
        ValueError: an unknown token or split rule.
    """
    _check_rule(rule)
    tokens = _split_top_level(text.strip().removeprefix("[").removesuffix("]"))
    if not tokens:
        raise ValueError(f"bad placements {text!r}: expected e.g. 'R,S0'")
    return tuple(_parse_token(t, rule) for t in tokens)


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses (Ragged(...) contains commas).

    Raises:
        ValueError: an empty token, as in "R,,S0".
    """
    if not text.strip():
        return []
    out, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += ch
    out.append(current.strip())
    if not all(out):
        raise ValueError(f"bad placements {text!r}: empty entry")
    return out


def _parse_token(token: str, rule: str) -> Placement:
    if token.upper() in ("R", "REPLICATE", "REPLICATE()"):
        return Replicate()
    m = _SHARD.fullmatch(token)
    if m:
        return Shard(int(m.group(1) or m.group(2)), _check_rule((m.group(3) or rule).lower()))
    m = _RAGGED.fullmatch(token)
    if m:
        dims, units = ([int(x) for x in g.split(",") if x.strip()] for g in m.groups())
        return RaggedShard(tuple(dims), tuple(units))
    raise ValueError(f"bad placement {token!r}: expected R, S<dim>, S(<dim>), S<dim>:ceil or Ragged(<dims>;<units>)")


# --------------------------------------------------------------------------------------------
# HyperParallel `.layout` JSON files


@dataclass
class _LayoutRecords:
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
    return _read_layout_records(path).layouts


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


def _read_layout_records(path: str | Path | Sequence[str | Path]) -> _LayoutRecords:
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


def _merge_ranks(per_rank: dict[int, tuple[Path, dict]]) -> _LayoutRecords:
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
    return _LayoutRecords(layouts, shapes, sorted(per_rank))


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


# --------------------------------------------------------------------------------------------
# TOML rule files


def _read_toml(path: str | Path) -> dict:
    """Parse a TOML file.

    Raises:
        PathNotFoundError: the file does not exist.
        ValueError: not valid TOML.
    """
    import tomllib

    p = Path(path)
    if not p.is_file():
        raise PathNotFoundError(f"{p}: no such file")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: not valid TOML ({exc})") from None


RULES_FILE_EXAMPLE = """\
# hpckpt layout rules: the target layout of each tensor, chosen by its FQN.
mesh = "2x4"          # device mesh, row-major, ranks 0..7; the command line's mesh overrides it
split = "balanced"    # rule of S<d> without a suffix: "balanced" (HyperParallel) or "ceil" (PyTorch)
default = "R,S0"      # placements of tensors no rule matches (omitted: replicate everywhere)

[[rule]]                                  # rules are tried in order; the first match wins
match = "*.embed_tokens.weight"           # fnmatch glob on the whole FQN
placements = "S0,R"

[[rule]]
regex = 'model\\.layers\\.\\d+\\.mlp\\..*'     # or a regular expression matching the whole FQN
placements = "R,S1:ceil"                  # a ":ceil"/":balanced" suffix overrides `split` for one placement

[[rule]]
match = "*.lm_head.weight"
split = "ceil"                            # a rule may also set `split` for all its placements
placements = "S1,S0"

[[rule]]
match = "*norm.weight"
placements = "R,R"
"""
"""A documented rules file. One placement per mesh dim; a 0-d tensor is always replicated and a
Shard of a dim the tensor does not have (S1 on a bias) becomes Replicate for that mesh dim."""

_TOP_KEYS = {"mesh", "default", "split", "rule"}
_RULE_KEYS = {"match", "regex", "placements", "split"}


def load_rules(path: str | Path) -> list[tuple[str, tuple[Placement, ...]]]:
    """Read the `[[rule]]` tables of a layout rules file as `(pattern, placements)` in file order.

    A pattern is an fnmatch glob on the FQN, or `re:<regex>` (full match) for a `regex` key.
    Placements are parsed with the rule's `split`, else the file's, else "balanced".

    Raises:
        PathNotFoundError: the file does not exist.
        ValueError: invalid TOML, unknown keys, or bad placements.
    """
    return _rules_from(_read_toml(path), str(path))


def _rules_from(doc: dict, where: str) -> list[tuple[str, tuple[Placement, ...]]]:
    check_table_keys(doc, _TOP_KEYS, where)
    file_rule = _check_rule(doc.get("split", "balanced"))
    rules = doc.get("rule", [])
    if not isinstance(rules, list):
        raise ValueError(f"{where}: 'rule' must be an array of tables ([[rule]])")
    out = []
    for i, r in enumerate(rules):
        what = f"{where}: rule {i + 1}"
        check_table_keys(r, _RULE_KEYS, what)
        if ("match" in r) == ("regex" in r) or "placements" not in r:
            raise ValueError(f"{what}: needs 'placements' and exactly one of 'match' or 'regex'")
        if not all(isinstance(v, str) for v in r.values()):
            raise ValueError(f"{what}: every value must be a string")
        pattern = r["match"] if "match" in r else "re:" + r["regex"]
        if pattern.startswith("re:"):
            _compile(pattern[3:], what)
        out.append((pattern, parse_placements(r["placements"], r.get("split", file_rule))))
    return out


def check_table_keys(table: object, allowed: set[str], where: str, error: type[Exception] = ValueError) -> None:
    """A TOML table of a rules file holds only known keys: a misspelt key must not pass silently.
    (Layout and name rules files both use it; `error` is each one's exception.)"""
    if not isinstance(table, dict):
        raise error(f"{where}: expected a table")
    unknown = set(table) - allowed
    if unknown:
        raise error(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")


def _compile(regex: str, where: str) -> re.Pattern:
    try:
        return re.compile(regex)
    except re.error as exc:
        raise ValueError(f"{where}: bad regex {regex!r} ({exc})") from None


def pattern_matches(pattern: str, fqn: str) -> bool:
    """True when a rule pattern (fnmatch glob, or `re:<regex>` matched in full) matches `fqn`."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], fqn) is not None
    return fnmatch.fnmatchcase(fqn, pattern)


# --------------------------------------------------------------------------------------------
# LayoutSpec: target layout per tensor


class LayoutSpec:
    """Resolves `(fqn, shape) -> TensorLayout` for every tensor of a checkpoint.

    Precedence: an exact entry of `layouts` (from `.layout` files), then the first matching
    rule, then `default`, then Replicate everywhere. Before use, placements are fitted to the
    tensor: a 0-d tensor is always replicated, and a Shard or RaggedShard of a dim the tensor
    does not have falls back to Replicate for that mesh dim (so "S1" can be a default for a
    model with 1-D biases). In FSDP mode a tensor whose dim 0 is empty is replicated as well.

    Raises:
        ValueError: neither a mesh nor layouts to take one from.
        GeometryError: `default` or a rule has not one placement per mesh dim.
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        default: Sequence[Placement] | None = None,
        rules: Sequence[tuple[str, Sequence[Placement]]] = (),
        layouts: Mapping[str, TensorLayout] | None = None,
        *,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        fsdp: bool = False,
    ):
        self.layouts = dict(layouts or {})
        if mesh is None and not self.layouts:
            raise ValueError("a LayoutSpec needs a mesh (or a world size), or layouts to take ranks from")
        self.mesh = mesh or _union_mesh(self.layouts.values())
        self.default = tuple(default) if default is not None else (Replicate(),) * self.mesh.ndim
        self.rules = [(pattern, tuple(p)) for pattern, p in rules]
        self.shapes = dict(shapes or {})
        self.fsdp = fsdp
        for placements in [self.default] + [p for _, p in self.rules]:
            TensorLayout(self.mesh, placements)  # fail now, not at the first tensor

    @classmethod
    def for_world_size(cls, world_size: int, rule: str = "balanced") -> "LayoutSpec":
        """FSDP-style target: a 1-D mesh of `world_size` ranks, Shard(0) with `rule` for all.

        Raises:
            ValueError: world size < 1 or unknown rule.
        """
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        return cls(Mesh((world_size,)), (Shard(0, _check_rule(rule)),), fsdp=True)

    @classmethod
    def from_toml(cls, path: str | Path, mesh: Mesh | None = None) -> "LayoutSpec":
        """Load a rules file; `mesh` overrides the file's `mesh` key.

        Raises:
            PathNotFoundError: the file does not exist.
            ValueError: invalid file, or no mesh in the file nor given.
        """
        doc = _read_toml(path)
        rules = _rules_from(doc, str(path))
        if mesh is None and "mesh" not in doc:
            raise ValueError(f"{path}: no 'mesh' key and no mesh given")
        mesh = mesh or parse_mesh(str(doc["mesh"]))
        default = parse_placements(doc["default"], doc.get("split", "balanced")) if "default" in doc else None
        return cls(mesh, default, rules)

    @classmethod
    def from_layout_files(cls, path: str | Path | Sequence[str | Path]) -> "LayoutSpec":
        """Target layouts from HyperParallel `.layout` files; other tensors are replicated
        over every rank the files mention.

        Raises:
            PathNotFoundError, CorruptMetadataError, GeometryError: see `load_layout_file`.
        """
        rec = _read_layout_records(path)
        return cls(Mesh((len(rec.ranks),), tuple(rec.ranks)), layouts=rec.layouts, shapes=rec.shapes)

    def resolve(self, fqn: str, shape: Sequence[int]) -> TensorLayout:
        """Return the layout of tensor `fqn` of global `shape`, validated against it.

        Raises:
            GeometryError: the chosen layout cannot apply to `shape` (wrong placements count,
                RaggedShard preconditions), or `shape` differs from a `.layout` full_shape.
        """
        shape = tuple(shape)
        if fqn in self.layouts:
            if fqn in self.shapes and self.shapes[fqn] != shape:
                raise GeometryError(f"{fqn}: the layout file says shape {list(self.shapes[fqn])}, the tensor is {list(shape)}")
            layout = self.layouts[fqn]
        else:
            placements = next((p for pattern, p in self.rules if pattern_matches(pattern, fqn)), self.default)
            layout = TensorLayout(self.mesh, self._fit(placements, shape))
        layout.validate(shape)
        return layout

    def _fit(self, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> tuple[Placement, ...]:
        if not shape or (self.fsdp and shape[0] < 1):
            return (Replicate(),) * len(placements)
        return tuple(Replicate() if _beyond(p, len(shape)) else p for p in placements)


def _beyond(p: Placement, ndim: int) -> bool:
    """True when `p` splits a tensor dim that an `ndim`-D tensor does not have."""
    if isinstance(p, Shard):
        return p.dim >= ndim
    return isinstance(p, RaggedShard) and len(p.dims) > ndim


def _union_mesh(layouts: Iterable[TensorLayout]) -> Mesh:
    ranks = sorted({r for layout in layouts for r in layout.mesh.ranks})
    return Mesh((len(ranks),), tuple(ranks))


# --------------------------------------------------------------------------------------------
# Inference from saved chunk boxes


@dataclass(frozen=True)
class InferredLayout:
    """What a saved tensor's chunk boxes reveal about the layout that wrote them.

    `kind` is "replicated" (one full box), "sharded" (a grid of per-dim splits, each matching a
    rule) or "irregular" (`detail` "ragged": consecutive flat row-major intervals, as RaggedShard
    writes; else "unknown"). For "sharded", `dims`, `parts` and `rules` are per split tensor dim;
    a rule is "balanced", "ceil" or "even" (both rules give these boxes).
    """

    kind: str
    dims: tuple[int, ...] = ()
    parts: tuple[int, ...] = ()
    rules: tuple[str, ...] = ()
    detail: str = ""

    def to_layout(self) -> TensorLayout | None:
        """A layout that produces the same distinct boxes (mesh = the parts), or None if irregular."""
        if self.kind == "replicated":
            return TensorLayout(Mesh((1,)), (Replicate(),))
        if self.kind != "sharded":
            return None
        placements = tuple(Shard(d, "balanced" if r == "even" else r) for d, r in zip(self.dims, self.rules))
        return TensorLayout(Mesh(self.parts), placements)

    def __str__(self) -> str:
        if self.kind == "sharded":
            return ", ".join(f"S{d}/{n} {r}" for d, n, r in zip(self.dims, self.parts, self.rules))
        return f"irregular ({self.detail})" if self.kind == "irregular" else self.kind


def infer(entry_shape: Sequence[int], chunk_boxes: Iterable[Box], world_size: int | None = None) -> InferredLayout | None:
    """Recognise the layout behind a tensor's chunk boxes (duplicates are ignored).

    De-duplication may merge trailing empty parts, so their count is taken as `world_size` when
    that fits (one split dim), else one more than the non-empty parts.

    Args:
        entry_shape: the tensor's global shape.
        chunk_boxes: the boxes of its saved chunks, in any order.
        world_size: ranks that saved the checkpoint, if known.

    Returns:
        The inferred layout, or None when there are no boxes or a box lies outside the tensor.
    """
    shape = tuple(entry_shape)
    boxes = list(dict.fromkeys(chunk_boxes))
    if not boxes or not all(b.inside(shape) for b in boxes):
        return None
    if len(boxes) == 1 and boxes[0] == full_box(shape):
        return InferredLayout("replicated")
    per_dim = [sorted({(b.offsets[d], b.sizes[d]) for b in boxes}) for d in range(len(shape))]
    if math.prod(len(iv) for iv in per_dim) != len(boxes):
        return _irregular(shape, boxes)
    split_dims = [d for d, iv in enumerate(per_dim) if len(iv) > 1]
    if not split_dims:  # one box, not the full tensor
        return _irregular(shape, boxes)
    found = []
    for d in split_dims:
        match = _match_split(shape[d], per_dim[d], world_size if len(split_dims) == 1 else None)
        if match is None:
            return _irregular(shape, boxes)
        found.append(match)
    return InferredLayout("sharded", tuple(split_dims), tuple(n for n, _ in found), tuple(r for _, r in found))


@functools.lru_cache(maxsize=4096)
def _all_splits_cached(length: int, parts: int, rule: str) -> tuple[tuple[int, int], ...]:
    return tuple(split(length, parts, i, rule) for i in range(parts))


def _all_splits(length: int, parts: int, rule: str) -> list[tuple[int, int]]:
    """Every part of a split; cached, since a checkpoint's tensors share a few (length, parts)."""
    return list(_all_splits_cached(length, parts, rule))


def _match_split(length: int, intervals: list[tuple[int, int]], world_size: int | None) -> tuple[int, str] | None:
    """Find `(parts, rule)` whose split of `length` gives exactly these intervals."""
    nonempty = [iv for iv in intervals if iv[1] > 0]
    if len(nonempty) == len(intervals):
        candidates = [len(intervals)]
    else:
        if len(intervals) - len(nonempty) > 1 or intervals[-1] != (length, 0):
            return None  # both rules put empty parts at the end, at offset `length`
        k = len(nonempty)
        candidates = ([world_size] if world_size and world_size > k else []) + [k + 1]
    for n in candidates:
        expected = nonempty + [(length, 0)] * (n - len(nonempty))
        ok = [r for r in RULES if _all_splits(length, n, r) == expected]
        if ok:
            return n, ("even" if len(ok) == 2 else ok[0])
    return None


def _irregular(shape: tuple[int, ...], boxes: list[Box]) -> InferredLayout:
    """Tell RaggedShard-style boxes (flat intervals tiling the tensor) from anything else."""
    intervals = []
    for b in boxes:
        if b.is_empty:
            continue
        if not _flat_contiguous(b, shape):
            return InferredLayout("irregular", detail="unknown")
        start = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(b.offsets))
        intervals.append((start, start + b.volume))
    intervals.sort()
    end = 0
    for start, stop in intervals:
        if start != end:
            return InferredLayout("irregular", detail="unknown")
        end = stop
    return InferredLayout("irregular", detail="ragged" if end == math.prod(shape) else "unknown")


def _flat_contiguous(b: Box, shape: tuple[int, ...]) -> bool:
    """True when a box is one flat row-major interval: sizes 1, then any, then full dims."""
    d = 0
    while d < len(shape) - 1 and b.sizes[d] == 1:
        d += 1
    return all(b.sizes[e] == shape[e] and b.offsets[e] == 0 for e in range(d + 1, len(shape)))


def inferred_layouts(index) -> dict[str, str]:
    """fqn -> the layout a `CheckpointIndex`'s chunks reveal ("S0/4 balanced", "replicated",
    "irregular (ragged)"); remembered on each entry, so a snapshot can keep it."""
    out = {}
    for fqn, entry in index.tensors.items():
        if entry.layout_hint is None:
            found = infer(entry.shape, entry.boxes, index.world_size)
            entry.layout_hint = str(found) if found is not None else "invalid"
        out[fqn] = entry.layout_hint
    return out
