"""The device mesh a layout places tensors on: its shape and the global rank at each position."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpckpt.core.errors import GeometryError


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
