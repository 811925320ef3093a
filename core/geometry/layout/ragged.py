"""RaggedShard geometry: a rank's flat row-major interval, and the N-D boxes that cover it.

HyperParallel's RaggedShard gives each rank a flat interval of the tensor and records
it as the minimal ordered sequence of N-D boxes; `decompose_flat_interval` cuts them the same way,
so the boxes match its metadata exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout.placements import RaggedShard


def check_ragged(p: RaggedShard, shape: tuple[int, ...]) -> None:
    """Refuse a RaggedShard that cannot apply to `shape`, before any interval is computed.

    Raises:
        GeometryError: the tensor lacks the prefix dims, or their cells are not divisible by
            the units' sum.
    """
    if len(p.dims) > len(shape):
        raise GeometryError(f"{p} needs tensor dims {list(p.dims)} but the tensor is {list(shape)}")
    cells, units = math.prod(shape[: len(p.dims)]), sum(p.local_units)
    if cells % units:
        raise GeometryError(f"{p}: {cells} prefix cells of {list(shape)} are not divisible by {units} units")


def ragged_interval(p: RaggedShard, shape: tuple[int, ...], j: int) -> tuple[int, int]:
    """Return the flat row-major `[start, stop)` of rank `j` along the ragged mesh dim."""
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
