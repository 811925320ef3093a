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
import os
from pathlib import Path

from hpckpt.core.errors import DestinationLockedError

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
