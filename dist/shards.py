"""What a rank holds of each tensor of its state dict: boxes in global coordinates and the local
tensors behind them, whatever the framework.

Each rank's box comes from the tensor it is given (a DTensor's placements, HyperParallel's
`chunk_info`, a `Sharded` layout), never from a split rule assumed here: torch splits uneven
dims like `torch.chunk` (13 over 4 -> 4,4,4,1), HyperParallel's balanced rule 4,3,3,3, and a
loader that assumed one would misplace rows of the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from hpckpt.core.dtypes import DType
from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import TensorLayout
from hpckpt.dist.layouts import Sharded


@dataclass
class Shards:
    """A tensor as one rank holds it: dtype, global shape and `(box, local tensor)` pairs (one,
    except for HyperParallel ragged shards). `replicated` is True for a plain tensor every rank
    holds whole. `layout`: the layout the boxes come from, when the tensor knows one (a DTensor's
    mesh and placements, a `Sharded`'s; mesh ranks are global ranks), which lets a save's ranks
    agree on a plan without sending their boxes (`core.geometry.layout_plan`)."""

    dtype: DType
    shape: tuple[int, ...]
    pieces: list[tuple[Box, Any]]
    replicated: bool = False
    layout: TensorLayout | None = None


def chunk_info_shards(fqn: str, local: Any, local_shape: tuple[int, ...], info: Any, dtype: DType) -> Shards:
    """HyperParallel's `ChunkInfo(chunk, global_shape, ...)` on a plain local tensor: a shard
    (for every framework: the object is HyperParallel's, not the framework's).

    Raises:
        GeometryError: not HyperParallel's ChunkInfo, or a box that does not fit the local tensor
            or the global shape.
    """
    try:
        chunk = info.chunk
        box = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
        shape = tuple(int(s) for s in info.global_shape)
    except (AttributeError, TypeError, ValueError):
        raise GeometryError(f"{fqn}: its chunk_info is not HyperParallel's ChunkInfo(chunk, global_shape)") from None
    if tuple(local_shape) != box.sizes or not box.inside(shape):
        raise GeometryError(f"{fqn}: chunk_info box {box} does not fit a local tensor {list(local_shape)} "
                            f"of a global {list(shape)}")
    return Shards(dtype, shape, [(box, local)])


def shards_of(fqn: str, value: Any, framework: ModuleType, rank: int) -> Shards:
    """The boxes and local tensors of `value` on `rank` (its global rank).

    Raises:
        GeometryError: a layout hpckpt cannot store as boxes, or one that does not fit the
            local tensor.
    """
    if isinstance(value, Sharded):
        local = value.local
        box = value.box(fqn, rank, framework.shape_of(local))
        return Shards(framework.dtype_of(local, fqn), value.shape, [] if box is None else [(box, local)],
                      layout=value.layout)
    return framework.native_shards(fqn, value)
