"""A rank-local save (`hpckpt.dist.save(..., coordination="none")`): every rank publishes its own
part of one checkpoint directory, and no rank waits for another.

There is no staging directory to rename whole, so the order of the steps carries the guarantee
a reader relies on: a part whose metadata file is present is complete.
1. this rank's metadata file and whatever else the caller names (`forget`) are removed first:
   a rank killed from here on leaves its part absent, never an old part beside new files;
2. the data files are written into a private directory beside them (`.hpckpt-tmp-PID`, which
   `leftover` explains and the next run removes), fsynced, and renamed into place one by one;
3. the metadata file is written there, fsynced and renamed in last;
4. files of the previous save of this rank that this one did not write (`previous`) are removed,
   and the directory is fsynced.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from hpckpt.core.commit.durable import fsync_path
from hpckpt.core.commit.replace import replace_file


def publish_rank_part(path: Path, metadata_name: str, write: Callable[[Path], tuple[list[str], bytes]], *,
                      forget: Iterable[str] = (), previous: Iterable[str] = ()) -> None:
    """Publish one rank's part of the checkpoint directory `path` (steps above). `write(directory)`
    writes the rank's data files (fsynced) into `directory` and returns their names and the bytes
    of its metadata file `metadata_name`."""
    path.mkdir(parents=True, exist_ok=True)
    for name in (metadata_name, *forget):
        (path / name).unlink(missing_ok=True)
    private = path / f".hpckpt-tmp-{os.getpid()}"
    private.mkdir(exist_ok=True)
    try:
        names, metadata = write(private)
        for name in names:
            os.replace(private / name, path / name)
        replace_file(path / metadata_name, metadata, fsync=True, aside=private / metadata_name)
        for old in previous:
            if old not in names:
                (path / old).unlink(missing_ok=True)
        fsync_path(path)
    finally:
        shutil.rmtree(private, ignore_errors=True)
