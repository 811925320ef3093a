"""What a rank holds of each tensor of its state dict: boxes in global coordinates and the local
tensors behind them. The only module of `hpckpt.dist` that knows DTensor and HyperParallel's
`chunk_info`; the rest of hpckpt sees numpy arrays.

Each rank's box comes from the tensor it is given, never from a split rule: torch's DTensor
splits uneven dims like `torch.chunk` (13 over 4 -> 4,4,4,1), HyperParallel's balanced rule
4,3,3,3, and a loader that assumed one would misplace rows of the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hpckpt.core.box import Box, full_box
from hpckpt.core.dtypes import DType, dtype as parse_dtype
from hpckpt.core.errors import GeometryError


@dataclass
class Shards:
    """A tensor as one rank holds it: dtype, global shape and `(box, local tensor)` pairs (one,
    except for HyperParallel ragged shards). `replicated` is True for a plain tensor every rank
    holds whole."""

    dtype: DType
    shape: tuple[int, ...]
    pieces: list[tuple[Box, torch.Tensor]]
    replicated: bool = False


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def hp_dtype(t: torch.Tensor, fqn: str) -> DType:
    try:
        return parse_dtype(str(t.dtype))
    except Exception:
        raise GeometryError(f"{fqn}: dtype {t.dtype} has no checkpoint dtype") from None


def shards_of(fqn: str, value: torch.Tensor) -> Shards:
    """The boxes and local tensors of `value` on this rank.

    Raises:
        GeometryError: a placement hpckpt cannot store as a box (Partial: unreduced values; a
            strided shard: not one box), or a `chunk_info` that does not fit the tensor.
    """
    if isinstance(value, DTensor):
        return _dtensor(fqn, value)
    info = getattr(value, "chunk_info", None)
    if info is not None:
        return _chunk_info(fqn, value, info)
    local = value.detach()
    shape = tuple(local.shape)
    return Shards(hp_dtype(local, fqn), shape, [(full_box(shape), local)], replicated=True)


def _dtensor(fqn: str, value: DTensor) -> Shards:
    for p in value.placements:
        if type(p) not in (Shard, Replicate):  # (subclasses: strided shards, masked partials)
            raise GeometryError(
                f"{fqn}: a DTensor placed {p} cannot be saved as boxes of the global tensor",
                hint="Partial values are not reduced yet (redistribute to Replicate or Shard first); "
                     "strided shards are not one box")
    local = value.to_local().detach()
    shape = tuple(value.shape)
    if value.device_mesh.get_coordinate() is None:  # this rank is not in the tensor's mesh
        return Shards(hp_dtype(local, fqn), shape, [])
    sizes, offsets = compute_local_shape_and_global_offset(shape, value.device_mesh, value.placements)
    sizes, offsets = tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)
    if tuple(local.shape) != sizes:
        raise GeometryError(f"{fqn}: the local shard is {list(local.shape)}, its placements give {list(sizes)}")
    if any(s == 0 for s in sizes):
        offsets = tuple(min(o, n) for o, n in zip(offsets, shape))
    return Shards(hp_dtype(local, fqn), shape, [(Box(offsets, sizes), local)])


def _chunk_info(fqn: str, value: torch.Tensor, info: Any) -> Shards:
    """HyperParallel's `ChunkInfo(chunk, global_shape, ...)` on a plain tensor: a shard."""
    try:
        chunk = info.chunk
        box = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
        shape = tuple(int(s) for s in info.global_shape)
    except (AttributeError, TypeError, ValueError):
        raise GeometryError(f"{fqn}: its chunk_info is not HyperParallel's ChunkInfo(chunk, global_shape)") from None
    local = value.detach()
    if tuple(local.shape) != box.sizes or not box.inside(shape):
        raise GeometryError(f"{fqn}: chunk_info box {box} does not fit a local tensor {list(local.shape)} "
                            f"of a global {list(shape)}")
    return Shards(hp_dtype(local, fqn), shape, [(box, local)])


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's elements in hpckpt's storage dtype (raw bits for bfloat16
    and float8, which numpy lacks); strides kept, nothing copied."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        return t.view(torch.uint8).numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}[t.dtype]
        return t.view(signed).numpy().view(np.dtype(f"<u{t.dtype.itemsize}"))
    return t.numpy()


def from_numpy(array: np.ndarray, like: torch.dtype) -> torch.Tensor:
    """The tensor over `array`'s bytes with dtype `like` (the inverse of `as_numpy`)."""
    t = torch.from_numpy(np.ascontiguousarray(array) if array.ndim else np.array(array))
    return t if t.dtype == like else t.view(like)  # the same bits: raw uint16 -> bfloat16
