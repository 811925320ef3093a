"""Crash-safe output: write into a hidden sibling directory, commit by renaming it into place.

Files are fsynced as they are closed; the metadata is written last (its presence is what marks a
HyperParallel checkpoint complete), then the directory is fsynced and renamed. A run killed at
any moment leaves only `.NAME.hpckpt-tmp-*`, which is not a checkpoint (no metadata) and which
the next run with the same destination removes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpckpt.core.errors import DestinationExistsError

TMP_MARK = ".hpckpt-tmp-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class StagingDir:
    """A staging directory for `dest`; use as a context manager, call `commit()` at the end."""

    def __init__(self, dest: Path, *, force: bool = False):
        self.dest = Path(dest)
        if self.dest.exists() and not force:
            raise DestinationExistsError(f"{self.dest} exists", hint="pass --force to replace it")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.dest.parent.glob(f".{self.dest.name}{TMP_MARK}*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a run that was killed
        self.path = self.dest.parent / f".{self.dest.name}{TMP_MARK}{os.getpid()}"
        self.path.mkdir()
        self._done = False

    def commit(self) -> None:
        """Atomically replace `dest` by the staged directory (metadata must already be there)."""
        _fsync_dir(self.path)
        trash = None
        if self.dest.exists():
            trash = self.dest.parent / f".{self.dest.name}{TMP_MARK}old-{os.getpid()}"
            os.rename(self.dest, trash)
        os.rename(self.path, self.dest)
        _fsync_dir(self.dest.parent)
        self._done = True
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()

    def __enter__(self) -> "StagingDir":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            shutil.rmtree(self.path, ignore_errors=True)
