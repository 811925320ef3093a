"""Shards described by an explicit layout: for tensors that do not carry their own.

A torch DTensor knows its mesh and placements, and HyperParallel tensors carry `chunk_info`;
a MindSpore Parameter or a plain torch tensor knows neither. `sharded(local, shape, ...)` wraps
such a local tensor with the layout it was cut by (a mesh with placements, MindSpore's device
matrix and `tensor_map`, or a `TensorLayout`), and `save`/`load` take the box from the layout
and the job's rank. `load` fills `Sharded.local` in place.

    w = hdist.sharded(local_w, (4096, 1024), mesh=(2, 4), placements="R,S0")
    w = hdist.sharded(param, (4096, 1024), device_matrix=(2, 4), tensor_map=(0, -1))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import Mesh, TensorLayout, from_tensor_map, parse_placements


@dataclass(frozen=True)
class Sharded:
    """A rank's local tensor of a global tensor of `shape`, cut by `layout`."""

    local: Any
    shape: tuple[int, ...]
    layout: TensorLayout

    def box(self, fqn: str, rank: int, local_shape: tuple[int, ...]) -> Box | None:
        """This rank's box (None when the rank is not in the layout's mesh).

        Raises:
            GeometryError: the layout gives several boxes (a ragged layout: use chunk_info), or
                a box another shape than the local tensor's.
        """
        boxes = self.layout.boxes(self.shape, rank)
        if not boxes:
            return None
        if len(boxes) > 1:
            raise GeometryError(f"{fqn}: layout {self.layout} gives rank {rank} {len(boxes)} boxes; "
                                "a ragged shard needs HyperParallel's chunk_info")
        box = boxes[0]
        if tuple(local_shape) != box.sizes:
            raise GeometryError(f"{fqn}: the local tensor is {list(local_shape)}, but layout {self.layout} gives "
                                f"rank {rank} the box {list(box.sizes)} at {list(box.offsets)} of {list(self.shape)}")
        return box


def sharded(local: Any, shape: Sequence[int], *, mesh: Sequence[int] | Mesh | None = None,
            placements: str | Sequence[Any] | None = None, split: str = "balanced",
            device_matrix: Sequence[int] | None = None, tensor_map: Sequence[Any] | None = None,
            rank_list: Sequence[int] | None = None, layout: TensorLayout | None = None) -> Sharded:
    """Wrap `local` (this rank's part of a tensor of global `shape`) with its layout, given as
    `mesh` + `placements` ("R,S0", torch style, one per mesh dim; `split` is the uneven rule:
    "balanced" as HyperParallel, "ceil" as torch), as MindSpore's `device_matrix` + `tensor_map`
    (counted from the right, -1 = not split), or as a `TensorLayout`. `rank_list`: the global
    ranks of the mesh in row-major order (default 0..n-1).

    Raises:
        ValueError: not exactly one way of giving the layout.
    """
    given = sum(x is not None for x in (mesh, device_matrix, layout))
    if given != 1:
        raise ValueError("give the layout once: mesh= with placements=, device_matrix= with tensor_map=, or layout=")
    if layout is None and mesh is not None:
        if placements is None:
            raise ValueError("mesh= needs placements=")
        grid = mesh if isinstance(mesh, Mesh) else Mesh(tuple(mesh), None if rank_list is None else tuple(rank_list))
        chosen = parse_placements(placements, split) if isinstance(placements, str) else tuple(placements)
        layout = TensorLayout(grid, chosen)
    elif layout is None:
        if tensor_map is None:
            raise ValueError("device_matrix= needs tensor_map=")
        layout = from_tensor_map(device_matrix, tensor_map, rank_list)
    shape = tuple(int(s) for s in shape)
    layout.validate(shape)
    return Sharded(local, shape, layout)
