"""Getting bytes onto the disk: writeback started early, fsync of files and directories.

Writeback is started per copied range (`sync_file_range`, Linux) so that the final fsync has only
the tail left to wait for instead of the whole file.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Iterable

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


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths: Iterable[Path]) -> None:
    for path in paths:
        fsync_path(path)


def write_file(path: Path, data: bytes, sync: bool = True) -> None:
    """Create `path` (it must not exist) holding `data`; fsynced unless `sync` is False."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
