"""Typed options of the library entry points: what to select, and sizes given as text."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """`5GB` (decimal, as Hugging Face counts), `512MiB` (binary) or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


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
