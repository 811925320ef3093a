"""An object in a store, addressed like a `pathlib.Path`, so every reader walks a remote
checkpoint with the code it walks a local one with.

Not a `PurePath` subclass on purpose: `Path(object_path)` and every `os` function refuse it
(`os.fspath` raises), so a code path that would read a local file of the same name fails loudly
instead. Object stores have no symlinks and no real directories: a "directory" is a key prefix
that some object lies under, and `resolve()` is lexical.
"""

from __future__ import annotations

import fnmatch
import stat as stat_module
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from hpckpt.core.storage.object_store import ObjectStore


@dataclass(frozen=True)
class ObjectStat:
    """What `stat()` answers for an object: its size; a regular file's mode, for checks that ask."""

    st_size: int
    st_mode: int = stat_module.S_IFREG | 0o444
    st_mtime: float = 0.0


def _normalize(key: str) -> str:
    """Collapse `//`, `.` and `..` (lexically: a store has no symlinks); `..` above the bucket stays
    above it, so `resolve_inside` still refuses it."""
    out: list[str] = []
    for part in key.split("/"):
        if part in ("", "."):
            continue
        if part == ".." and out and out[-1] != "..":
            out.pop()
        else:
            out.append(part)
    return "/".join(out)


class ObjectPath:
    """`store` and a key (no leading or trailing `/`; "" is the bucket itself)."""

    __slots__ = ("store", "key")

    def __init__(self, store: "ObjectStore", key: str = ""):
        self.store, self.key = store, key.strip("/")

    # -- pure path operations ----------------------------------------------------------------

    def __truediv__(self, other: object) -> "ObjectPath":
        text = other.key if isinstance(other, ObjectPath) else str(other)
        if text.startswith("/"):
            raise ValueError(f"{text!r}: an absolute path cannot be joined to {self}")
        return ObjectPath(self.store, f"{self.key}/{text}" if self.key else text)

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.store, self.key.rpartition("/")[0])

    @property
    def parents(self) -> tuple["ObjectPath", ...]:
        out, path = [], self
        while path.key:
            path = path.parent
            out.append(path)
        return tuple(out)

    @property
    def suffix(self) -> str:
        name = self.name
        dot = name.rfind(".")
        return name[dot:] if 0 < dot < len(name) - 1 else ""

    def with_name(self, name: str) -> "ObjectPath":
        return self.parent / name

    def resolve(self, strict: bool = False) -> "ObjectPath":
        return ObjectPath(self.store, _normalize(self.key))

    def relative_to(self, other: "ObjectPath") -> str:
        if not isinstance(other, ObjectPath) or other.store is not self.store:
            raise ValueError(f"{self} is not in {other}")
        if not other.key:
            return self.key
        if self.key == other.key:
            return "."
        if not self.key.startswith(other.key + "/"):
            raise ValueError(f"{self} is not in {other}")
        return self.key[len(other.key) + 1:]

    def is_relative_to(self, other: object) -> bool:
        try:
            self.relative_to(other)  # type: ignore[arg-type]
            return True
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"{self.store.url_root}/{self.key}" if self.key else self.store.url_root

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __fspath__(self) -> str:
        raise TypeError(f"{self} is an object in a store, not a local file")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.store is self.store and other.key == self.key

    def __hash__(self) -> int:
        return hash((id(self.store), self.key))

    def __lt__(self, other: "ObjectPath") -> bool:
        return str(self) < str(other)

    # -- questions for the store (its listing, cached) ---------------------------------------

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_file(self) -> bool:
        return bool(self.key) and self.store.info(self.key) is not None

    def is_dir(self) -> bool:
        return self.store.is_prefix(self.key)

    def is_symlink(self) -> bool:
        return False  # a store has no links: a key names its object

    def stat(self) -> ObjectStat:
        info = self.store.info(self.key) if self.key else None
        if info is None:
            if self.is_dir():
                return ObjectStat(0, stat_module.S_IFDIR | 0o555)
            raise FileNotFoundError(f"{self}: no such object")
        return ObjectStat(info.size, st_mtime=info.mtime)

    def iterdir(self) -> Iterator["ObjectPath"]:
        files, dirs = self.store.listing(self.key)
        for name in sorted({*files, *dirs}):
            yield self / name

    def glob(self, pattern: str) -> Iterator["ObjectPath"]:
        """One level only (`*.safetensors`), which is all the readers ask for."""
        if "/" in pattern or "**" in pattern:
            raise ValueError(f"glob {pattern!r}: only one level is supported for objects")
        for child in self.iterdir():
            if fnmatch.fnmatchcase(child.name, pattern):
                yield child


def is_object(path: object) -> bool:
    """True for an `ObjectPath` (cheap: this module never imports the store's client)."""
    return isinstance(path, ObjectPath)
