"""Crash-safe output: write into a hidden sibling directory, commit by renaming it into place.

Data files start their writeback as soon as they are written and are fsynced together before the
metadata is written (its presence is what marks a HyperParallel checkpoint complete); then the
directory is fsynced and renamed. A run killed at any moment leaves only `.NAME.hpckpt-tmp-*`,
which is not a checkpoint (no metadata) and which the next run with the same destination removes.
With `sync=False` (`--no-fsync`) nothing is fsynced: still safe against a killed process (the
rename is atomic), not against a power failure.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import Iterable

from hpckpt.core.errors import DestinationExistsError

TMP_MARK = ".hpckpt-tmp-"


_SYNC_FILE_RANGE_WRITE = 2
try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
except (AttributeError, OSError):  # not Linux
    _sync_file_range = None


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start writing `nbytes` at `offset` of `fd` (0: to the end) now, without
    waiting, so the final fsync overlaps with the copying that follows instead of adding to it."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_files(paths: Iterable[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_existing(dest: Path, force: bool) -> None:
    """Every writing command leaves an existing destination alone unless told to replace it."""
    if dest.exists() and not force:
        raise DestinationExistsError(f"{dest} exists", hint="pass --force to replace it")


def write_durably(path: Path, data: bytes, sync: bool = True) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


class StagingDir:
    """A staging directory for `dest`; use as a context manager, call `commit()` at the end."""

    def __init__(self, dest: Path, *, force: bool = False, sync: bool = True):
        self.dest = Path(dest)
        self.sync = sync
        refuse_existing(self.dest, force)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.dest.parent.glob(f".{self.dest.name}{TMP_MARK}*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a run that was killed
        self.path = self.dest.parent / f".{self.dest.name}{TMP_MARK}{os.getpid()}"
        self.path.mkdir()
        self._done = False

    def commit(self) -> None:
        """Atomically replace `dest` by the staged directory (metadata must already be there)."""
        if self.sync:
            _fsync_dir(self.path)
        trash = None
        if self.dest.exists():
            trash = self.dest.parent / f".{self.dest.name}{TMP_MARK}old-{os.getpid()}"
            os.rename(self.dest, trash)
        os.rename(self.path, self.dest)
        if self.sync:
            _fsync_dir(self.dest.parent)
        self._done = True
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()

    def __enter__(self) -> "StagingDir":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            shutil.rmtree(self.path, ignore_errors=True)
