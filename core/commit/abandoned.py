"""What a stopped `hpckpt run` job left for its destination, removed by the command that launched
it once every process of the job is gone (Ctrl-C, SIGTERM, a failed rank), as an offline command
removes its own staging: the live save's shared staging directory, the staging of dead runs, the
lock file, and a fan-out the job had begun in a destination that did not exist before it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpckpt.core.commit.destination import recognised
from hpckpt.core.commit.leftovers import DIST_MARK, FRAGMENT_DIR, TMP_MARK, beside, remove_leftover, remove_stale_staging
from hpckpt.core.commit.lock import DestinationLock
from hpckpt.core.errors import DestinationLockedError
from hpckpt.core.storage.object_path import is_object


def remove_abandoned(dest: Path, existed: bool) -> list[Path]:
    """Remove what the stopped job left for `dest` and return it. Nothing is touched while another
    live run holds the destination's lock; `existed`: `dest` was there before the job (then only
    what lies beside it is removed, never `dest`)."""
    if is_object(dest):
        return []  # (the next write removes a dead writer's mark and uploads: core.commit.object_staging)
    dest = Path(dest).absolute()
    before = beside(dest)
    try:
        lock = DestinationLock(dest).acquire()
    except DestinationLockedError:
        return []
    removed = []
    try:
        shared = dest.parent / f".{dest.name}{TMP_MARK}{DIST_MARK}"
        if os.path.lexists(shared):
            remove_leftover(shared)
        remove_stale_staging(dest)
        if not existed and dest.is_dir() and (dest / FRAGMENT_DIR).is_dir() and not recognised(dest):
            shutil.rmtree(dest, ignore_errors=True)  # a fan-out this job began: no other run's data in it
            removed.append(dest)
    finally:
        lock.release()  # (an exclusive holder removes the lock file)
    return [*(p for p in before if not os.path.lexists(p)), *removed]
