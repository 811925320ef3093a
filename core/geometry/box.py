"""Boxes: N-D half-open integer regions `[offsets, offsets + sizes)` in global coordinates.

A 0-d tensor is the empty box `((), ())`, which has volume 1 and intersects itself, exactly as
HyperParallel and PyTorch DCP treat scalars.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True, unsafe_hash=True)
class Box:
    """A region of a tensor; pure ints so that plans are printable, comparable and hashable.

    Treat as immutable (it is hashed). Not declared frozen because a frozen dataclass is slower
    to build (docs/design-figures.md), and checkpoints have hundreds of thousands of chunks.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    @property
    def is_empty(self) -> bool:
        return self.volume == 0

    def intersect(self, other: "Box") -> "Box | None":
        """Return the overlap of two boxes, or None when they share no element."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        if self.is_empty or other.is_empty:
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))

    def inside(self, shape: tuple[int, ...]) -> bool:
        """True when the box lies within a tensor of global `shape` (same rank, no negatives)."""
        if len(shape) != len(self.sizes) or len(self.offsets) != len(self.sizes):
            return False
        for o, s, n in zip(self.offsets, self.sizes, shape):
            if o < 0 or s < 0 or o + s > n:
                return False
        return True

    def relative_to(self, outer: "Box") -> "Box":
        """Return this box in the local coordinates of `outer` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes))

    def __str__(self) -> str:
        if not self.sizes:
            return "[]"
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def full_box(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), tuple(shape))

