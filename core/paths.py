"""Resolving the relative paths a checkpoint's metadata names, without leaving the checkpoint."""

from __future__ import annotations

import os
import functools
from pathlib import Path

from hpckpt.core.errors import MissingFileError, UnsafePathError


def resolve_inside(root: Path, relative: str, siblings: bool = False) -> Path:
    """Return `root/relative`, refusing absolute paths and paths that climb out of `root`.

    With `siblings` (HyperParallel's incremental saves), `../NAME/FILE` is followed too when
    `NAME` is another checkpoint directory beside `root` (`baseline_of`).

    Cached: readers ask for the same few files once per chunk, and resolving costs `lstat`s (the
    cache is keyed on the absolute root: a relative one means another directory after a chdir).

    Raises:
        UnsafePathError: `relative` is absolute or resolves outside `root` (e.g. `../x`) and,
            with `siblings`, outside every checkpoint beside it.
    """
    if isinstance(root, Path) and not root.is_absolute():
        root = Path(os.path.abspath(root))
    return _resolve_inside(root, relative, siblings)


@functools.lru_cache(maxsize=65536)
def _resolve_inside(root: Path, relative: str, siblings: bool) -> Path:
    if not relative or os.path.isabs(relative) or relative.startswith(("\\", "/")):
        raise UnsafePathError(f"path {relative!r} in the metadata is not relative to the checkpoint")
    if "\0" in relative or len(relative.encode("utf-8", "surrogatepass")) > 4096 or any(
            len(part.encode("utf-8", "surrogatepass")) > 255 for part in relative.split("/")):
        raise UnsafePathError(f"path {relative[:80]!r}{'...' if len(relative) > 80 else ''} in the metadata "
                              "cannot name a file (a NUL byte, or longer than a file system allows)")
    root_resolved = root.resolve()
    try:
        target = (root_resolved / relative).resolve()
    except (RuntimeError, OSError):  # a symlink loop (RuntimeError up to Python 3.12, ELOOP after)
        raise MissingFileError(f"{root / relative}: is a symlink loop, not a file") from None
    if siblings and relative.startswith("../") and baseline_of(root, relative) is not None:
        return target
    if target != root_resolved and root_resolved not in target.parents:
        raise UnsafePathError(
            f"path {relative!r} in the metadata leaves the checkpoint directory {root}",
            hint="incremental saves can point at an earlier checkpoint: copy those files into this directory",
        )
    return target


#: What marks a directory as a checkpoint an incremental save may point into.
BASELINE_MARK = ".metadata"


def baseline_of(root: Path, relative: str) -> Path | None:
    """The sibling checkpoint directory `../NAME/...` points into, or None when it does not:
    `NAME` must be another directory directly beside `root` (not `root` itself, not a link to
    elsewhere) holding a checkpoint (`BASELINE_MARK`), and the path, resolved, must stay inside it."""
    parts = relative.split("/")
    if len(parts) < 3 or parts[0] != ".." or parts[1] in ("", ".", "..") or any(p in ("", ".", "..") for p in parts[2:]):
        return None
    here = root.resolve()
    sibling = here.parent / parts[1]
    try:
        if sibling.is_symlink() or not sibling.is_dir() or sibling == here:
            return None
        if not (sibling / BASELINE_MARK).is_file():
            return None
        target = (sibling / "/".join(parts[2:])).resolve()
    except (RuntimeError, OSError):
        return None
    return sibling if sibling in target.parents else None


def cache_directory(name: str = "") -> Path | None:
    """Where hpckpt keeps what it listed or measured (`name` under it): `HPCKPT_CACHE_DIR`,
    else `$XDG_CACHE_HOME/hpckpt/NAME` (`~/.cache/hpckpt/NAME`); None with `HPCKPT_NO_CACHE`."""
    if os.environ.get("HPCKPT_NO_CACHE"):
        return None
    if os.environ.get("HPCKPT_CACHE_DIR"):
        return Path(os.environ["HPCKPT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpckpt" / name
