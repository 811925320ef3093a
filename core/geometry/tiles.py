"""Cutting a row-major box into tiles that are each one contiguous run of bytes.

The engine copies tile by tile so that memory stays within the budget whatever the tensor's size,
and a tile that is also one contiguous run in its source can go through the kernel
(`copy_file_range`) untouched.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from hpckpt.core.geometry.box import Box


def contiguous_tiles(sizes: tuple[int, ...], itemsize: int, budget: int) -> Iterator[Box]:
    """Split a C-ordered array of `sizes` into tiles of at most `budget` bytes (at least one
    element), each a contiguous byte run: whole trailing dims, a block along one dim, single
    indices before it."""
    ndim = len(sizes)
    if ndim == 0 or math.prod(sizes) == 0:
        if ndim == 0:
            yield Box((), ())
        return
    inner, k = itemsize, ndim
    while k > 0 and inner * sizes[k - 1] <= budget:
        inner *= sizes[k - 1]
        k -= 1
    if k == 0:
        yield Box((0,) * ndim, sizes)
        return
    step = max(1, budget // inner)
    outer = sizes[: k - 1]
    for index in np.ndindex(*outer) if outer else [()]:
        for start in range(0, sizes[k - 1], step):
            n = min(step, sizes[k - 1] - start)
            yield Box(tuple(int(i) for i in index) + (start,) + (0,) * (ndim - k),
                      (1,) * len(outer) + (n,) + tuple(sizes[k:]))


def linear(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The row-major element index of `offsets` in an array of `shape`."""
    position = 0
    for o, n in zip(offsets, shape):
        position = position * n + o
    return position


def contiguous_in(region: Box, shape: tuple[int, ...]) -> bool:
    """True when `region` (local coordinates) is one contiguous run of a C-ordered `shape`."""
    d = region.ndim - 1
    while d >= 0 and region.offsets[d] == 0 and region.sizes[d] == shape[d]:
        d -= 1
    return d < 0 or all(s == 1 for s in region.sizes[:d])
