"""Tensor layouts: a mesh plus one placement per mesh dim, and the boxes each rank holds.

The resharding engine describes a source or target checkpoint as one `TensorLayout` per tensor.
Several Shards of the same tensor dim split it successively, the first mesh dim being the
outermost split. `from_tensor_map` reads the MindSpore/HyperParallel form of a layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout.mesh import Mesh
from hpckpt.core.geometry.layout.placements import Placement, RaggedShard, Replicate, Shard, split
from hpckpt.core.geometry.layout.ragged import check_ragged, decompose_flat_interval, ragged_interval


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
                check_ragged(p, shape)

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
                start, stop = ragged_interval(p, shape, coord[k])
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


def to_tensor_map(layout: TensorLayout, ndim: int) -> list[int | list[int]]:
    """The MindSpore/HyperParallel `tensor_map` of `layout` for a tensor of `ndim` dims: the
    inverse of `from_tensor_map` (mesh dims counted from the right, -1 where a dim is not split,
    a list where several mesh dims split one, outermost first).

    Raises:
        GeometryError: a placement no tensor_map can say (a RaggedShard).
    """
    order = layout.order or tuple(range(layout.mesh.ndim))
    entries: list[list[int]] = [[] for _ in range(ndim)]
    for k in order:
        p = layout.placements[k]
        if isinstance(p, RaggedShard):
            raise GeometryError(f"a ragged placement ({p}) has no tensor_map")
        if isinstance(p, Shard) and p.dim < ndim:
            entries[p.dim].append(layout.mesh.ndim - 1 - k)
    return [-1 if not e else e[0] if len(e) == 1 else e for e in entries]


def _entry_dims(entry: int | Sequence[int]) -> list[int]:
    """The mesh-dim numbers (from the right) of one tensor_map entry, -1s dropped."""
    items = [entry] if isinstance(entry, int) else list(entry)
    return [int(m) for m in items if int(m) != -1]
