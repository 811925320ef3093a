"""One run per destination: an advisory lock file `.NAME.hpckpt-lock` beside it, holding the pid.

`flock` is released by the kernel when its process dies (kill -9 included), so a lock is never
stale; the file a killed run leaves is taken over by the next run. An exclusive lock (a whole
output, `finalize`) excludes every other run; shared locks (fan-out jobs writing their own ranks
into one directory) exclude only exclusive ones. The exclusive holder unlinks the file when it is
done; a run that locked a file unlinked meanwhile locks again (the inode check), so two runs never
hold locks on two different files of one name.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpckpt.core.errors import DestinationLockedError
from hpckpt.core.storage.object_path import is_object

LOCK_SUFFIX = ".hpckpt-lock"


def lock_path(dest: Path) -> Path:
    """The lock file of the destination `dest`: hidden, beside it, named after it."""
    return dest.parent / f".{dest.name}{LOCK_SUFFIX}"


def holder(path: Path) -> int | None:
    """The pid written in the lock file `path`, or None (empty, unreadable, gone)."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


class DestinationLock:
    """The lock on one destination, taken by `acquire()` (or `with`), given up by `release()`."""

    def __init__(self, dest: Path, *, shared: bool = False):
        self.dest = Path(dest)
        self.path = lock_path(self.dest)
        self.shared = shared
        self._fd: int | None = None

    def acquire(self) -> "DestinationLock":
        """Take the lock now or fail: never wait for another run.

        Raises:
            DestinationLockedError: another live process holds it (the message names its pid).
        """
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise self._locked() from None
            if self._same_file(fd):
                self._fd = fd
                self._write_pid(fd)
            else:
                os.close(fd)  # the holder we waited on removed that file: lock the new one
        return self

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    @staticmethod
    def _write_pid(fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _locked(self) -> DestinationLockedError:
        pid = holder(self.path)
        who = f"pid {pid}" if pid is not None else "another process"
        return DestinationLockedError(
            f"{self.dest} is being written by another hpckpt run ({who}; lock file {self.path})",
            hint="wait for it to finish, or stop it; two runs never write one destination")

    def release(self) -> None:
        """Give the lock up; an exclusive holder removes the file first (a shared one leaves it
        to the others and to the exclusive run that follows)."""
        if self._fd is None:
            return
        if not self.shared:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "DestinationLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- a source being read, a destination being replaced ------------------------------------------
#
# A run reading a checkpoint holds a SHARED `flock` on the checkpoint itself (its directory, or
# its single file) for the whole run; a run that replaces an existing destination with `--force`
# holds an EXCLUSIVE one on it until the old output is gone. Neither waits: whoever comes second
# stops with `DestinationLockedError`. Nothing is created beside the source (it may be read-only,
# and hpckpt writes only its destination); where `flock` is not supported (some network file
# systems) the run goes on without it.

_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


class _Held(Exception):
    """Another process holds a conflicting lock."""


def _checkpoint_root(path: Path) -> Path:
    """The checkpoint a source path names: the directory for `DIR/.metadata` (and an index file
    inside a directory checkpoint), else the path itself."""
    if path.is_file() and (path.name.endswith("metadata") or path.name.endswith(".index.json")):
        return path.parent
    return path


def _take(path: Path, operation: int) -> int | None:
    """An fd on `path` (opened read-only) holding `flock(operation)`; None when `path` cannot be
    opened (missing, unreadable: the run reports that itself) or does not support `flock`.

    Raises:
        _Held: another process holds a conflicting lock.
    """
    for _ in range(8):  # replaced between open and flock: lock the new one
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise _Held() from None
            if exc.errno in _UNSUPPORTED:
                return None
            raise
        try:
            st = os.stat(path)
        except OSError:
            os.close(fd)
            return None
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)
    return None


@contextmanager
def reading(src: str | Path) -> Iterator[None]:
    """Hold a shared lock on the source `src` while the block reads it (nested blocks share it).

    Raises:
        DestinationLockedError: another hpckpt run is replacing `src` (`--force`).
    """
    try:
        local = isinstance(src, (str, os.PathLike)) and not is_object(src)  # a store has no locks to take
        fd = _take(_checkpoint_root(Path(src)), fcntl.LOCK_SH) if local else None
    except _Held:
        raise DestinationLockedError(f"{src} is being replaced by another hpckpt run",
                                     hint="wait for that run to finish, then run this one again") from None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


class ReplaceLock:
    """The exclusive lock a run holds on the existing destination it replaces, until the old
    output is gone (`release()`)."""

    def __init__(self, dest: Path):
        self.dest = Path(dest)
        try:
            self._fd = _take(self.dest, fcntl.LOCK_EX)
        except _Held:
            raise DestinationLockedError(f"{self.dest} is being read by another hpckpt run; it cannot be replaced now",
                                         hint="wait for that run to finish, or write somewhere else") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def holds_source(function):
    """`function(src, ...)` runs holding `reading(src)`: taken before it reads any metadata."""

    @functools.wraps(function)
    def wrapper(src, *args, **kwargs):
        with reading(src):
            return function(src, *args, **kwargs)

    return wrapper
