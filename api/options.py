"""Typed options of the library entry points: what to select, and sizes given as text."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass

from hpckpt.core.sizes import parse_size

__all__ = ["Selection", "parse_size"]  # parse_size lives in core (hpckpt.dist parses sizes too)


@dataclass(frozen=True)
class Selection:
    """Which entries a command works on: those matching any `include` glob (all when there is
    none) and no `exclude` glob. An entry known by several names (before and after renaming) is
    kept when any of them is included and none excluded."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def of(cls, include: Iterable[str] | None = None, exclude: Iterable[str] | None = None) -> "Selection":
        return cls(tuple(include or ()), tuple(exclude or ()))

    @property
    def everything(self) -> bool:
        return not self.include and not self.exclude

    def keeps(self, *names: str) -> bool:
        def hit(globs: tuple[str, ...]) -> bool:
            return any(fnmatch.fnmatchcase(n, g) for n in names for g in globs)

        return (not self.include or hit(self.include)) and not hit(self.exclude)

    def names(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if self.keeps(n)]
