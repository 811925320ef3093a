"""Placements: how one mesh dim splits a tensor (`Shard`, `Replicate`, `RaggedShard`), and the 1-D split rules.

PyTorch DTensor style, one placement per mesh dim. `Shard(dim, rule)` splits tensor dim `dim`
with a 1-D split rule: "balanced" is HyperParallel's default (the first `len % n` parts are one
larger, like `numpy.array_split`), "ceil" is PyTorch's (`torch.chunk`: parts of `ceil(len / n)`,
trailing parts may be empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from hpckpt.core.errors import GeometryError

RULES = ("balanced", "ceil")


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


def check_rule(rule: str) -> str:
    """Return `rule` if it is a split rule, so a typo fails where the rule is given.

    Raises:
        ValueError: the rule is not one of `RULES`.
    """
    if rule not in RULES:
        raise ValueError(f"unknown split rule {rule!r}; expected one of {', '.join(RULES)}")
    return rule


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
        check_rule(self.rule)
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
    """HyperParallel's flat, non-uniform sharding over one mesh dim (its boxes: `ragged.py`).

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
