"""Getting bytes onto the disk: writeback started early, fsync of files and directories.

Writeback is started per copied range (`sync_file_range`, Linux) so that the final fsync has only
the tail left to wait for instead of the whole file. What the system refuses while writing (a full
disk, a quota, permissions, an I/O error) becomes one documented error (`write_error`).
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path
from typing import Iterable

import tempfile

from hpckpt.core.errors import NoSpaceError, WriteFailedError
from hpckpt.core.sizes import human_bytes
from hpckpt.core.storage.object_path import is_object

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

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


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system of `path` (or of its nearest
    existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def spool_root(create: bool = True) -> Path:
    """Where an output for an object store is written before it goes up (`HPCKPT_SPOOL_DIR`, else
    the system's temporary directory), created when missing unless told not to."""
    root = Path(os.environ.get("HPCKPT_SPOOL_DIR") or tempfile.gettempdir())
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return root


def _local_room(dest) -> Path:
    """The directory whose file system takes `dest`'s bytes: its parent, or the spool for an object."""
    return spool_root(create=False) if is_object(dest) else dest.parent


def no_space(dest: Path, needed: int, during: bool = False) -> NoSpaceError:
    late = "; the disk filled up during the write" if during else ""
    room = _local_room(dest)
    where = f" (its local spool {room})" if is_object(dest) else ""
    return NoSpaceError(f"no space left on device writing {dest}{where} (needed ~{human_bytes(needed)}, "
                        f"free {human_bytes(free_bytes(room))}{late})",
                        hint="set HPCKPT_SPOOL_DIR to a file system with room; nothing was written to the store"
                        if is_object(dest) else "free some space or choose another destination; nothing was left behind")


def check_space(dest: Path, needed: int) -> None:
    """Fail before writing anything when the output cannot fit: the data files alone need `needed`
    (for an object store, in its local spool).

    Raises:
        NoSpaceError: the file system that takes the bytes has less free space than that.
    """
    if needed > free_bytes(_local_room(dest)):
        raise no_space(dest, needed)


def write_error(exc: OSError, dest: Path, needed: int = 0) -> NoSpaceError | WriteFailedError:
    """The documented error for an OSError raised while writing `dest` (called once the staging
    data is removed, so the free space it reports is what is left)."""
    if exc.errno in NO_SPACE:
        return no_space(dest, needed, during=True)
    where = f" ({exc.filename})" if exc.filename else ""
    return WriteFailedError(f"writing {dest} failed: {exc.strerror or exc}{where}",
                            hint="nothing was left behind; fix the cause and rerun")
