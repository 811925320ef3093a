"""Replacing one small file whole: what every reader of it sees is the old content or all of the
new, never a part. The only way hpckpt renames a single file into place outside a staged commit.

The caller says how durable the new content must be: `fsync` (the file's bytes reach the disk
before the rename), `fsync_dir` (the rename itself survives a power failure). Exchange files that
live only as long as a job need neither; a manifest written next to a checkpoint needs both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from hpckpt.core.commit.durable import fsync_path


def replace_file(path: Path, content: bytes | Callable[[BinaryIO], None], *, fsync: bool, fsync_dir: bool = False,
                 aside: Path | None = None, mode: int = 0o644) -> None:
    """Write `content` (bytes, or a function that writes into the open file) under the temporary
    name `aside` beside `path` (default `.NAME.PID.tmp`), then rename it over `path`. The
    temporary file is removed if anything fails, a signal included.

    Raises:
        OSError: the write or the rename failed (nothing replaced).
    """
    path = Path(path)
    aside = aside or path.with_name(f".{path.name}.{os.getpid()}.tmp")
    aside.unlink(missing_ok=True)
    try:
        with os.fdopen(os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(aside, path)
    except BaseException:
        aside.unlink(missing_ok=True)
        raise
    if fsync_dir:
        fsync_path(path.parent)


def write_json(path: Path, document: Any, *, aside: Path | None = None, **dumps: Any) -> None:
    """`document` as JSON at `path`, replaced whole and not fsynced: the files through which
    processes of one job talk (readers poll them, and a crash ends the job anyway). Created as
    `open()` creates a file (the umask decides), as these files always were."""
    replace_file(path, json.dumps(document, **dumps).encode(), fsync=False, aside=aside, mode=0o666)


def read_json(path: Path) -> Any | None:
    """The document, or None when the file is not there (yet), not readable or not JSON."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
