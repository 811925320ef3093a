"""What unfinished hpckpt runs leave beside a destination, named so that it is never read as a
checkpoint: staging directories `.NAME.hpckpt-tmp-PID`, an old output moved aside
(`-old-PID`), lock files, sidecars linked before their file; in an object store, the writer's
mark `.hpckpt-writing`. `leftover` explains one (with the
command that removes it) for `inspect` and `verify`; `remove_stale_staging` is what the next run
on the same destination removes (dead pids only, names compared exactly).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import time
from pathlib import Path

from hpckpt.core.commit import formats
from hpckpt.core.commit.lock import LOCK_SUFFIX, holder
from hpckpt.core.storage.object_path import is_object


TMP_MARK = ".hpckpt-tmp-"
FRAGMENT_DIR = ".hpckpt-fanout"
DIST_MARK = "dist"  # `.NAME.hpckpt-tmp-dist`: the staging directory all ranks of a live save share

# `.NAME.hpckpt-tmp-dist` is removed by the next live save's coordinator (it holds the lock), not
# by offline runs: its writers are processes of another job, perhaps on other machines.
# `.NAME.hpckpt-tmp-PID` (staging), `.NAME.hpckpt-tmp-old-PID` (moved aside), and inside a fan-out
# directory `.hpckpt-tmp-PID` (a job's staging) and `.hpckpt-tmp-PID-FILE` (a file being published)
STAGING_NAME = re.compile(rf"^(?:\..+)?{re.escape(TMP_MARK)}(?:(old-)?(\d+)(?:-.+)?|{DIST_MARK})$", re.DOTALL)


def staging_directory(path: Path) -> Path | None:
    """The hpckpt staging directory `path` is (or lies in), or None: what a run that did not
    finish leaves behind must never be read as a checkpoint."""
    for part in (path, *path.parents):
        if STAGING_NAME.match(part.name):
            return part
    return None


def _alive(pid: int) -> bool:
    """True when a process `pid` exists (its staging directory may be in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(pid: int | None) -> str:
    if pid is None:
        return "pid unknown"
    return f"pid {pid}, {'still running' if _alive(pid) else 'no longer running'}"


def _remove_hint(path: Path, pid: int | None) -> str:
    if pid is not None and _alive(pid):
        return "; that run is still writing it: wait for it to finish"
    return f"; remove it with `rm {'-r ' if path.is_dir() else ''}{shlex.quote(str(path))}` or rerun the command"


def leftover(path: Path) -> str | None:
    """What an unfinished (or running) hpckpt run left at `path`, said in one line with the
    command that removes it, for `inspect` and `verify`; None for anything else."""
    if is_object(path):
        return _object_leftover(path)
    path = Path(path).absolute()
    staging = staging_directory(path)
    if staging is not None:
        match = STAGING_NAME.match(staging.name)
        pid = int(match.group(2)) if match.group(2) else None
        if pid is None:
            return (f"{staging} is the staging directory of an unfinished distributed save (hpckpt.dist); the next "
                    f"save to the same path removes it, or remove it with `rm -r {shlex.quote(str(staging))}`")
        what = ("the previous output, moved aside by an hpckpt run that replaced it" if match.group(1) else
                "the staging directory of an unfinished hpckpt run" if staging.is_dir() else
                "a temporary file of an unfinished hpckpt run")
        return f"{staging} is {what} ({_run(pid)}){_remove_hint(staging, pid)}"
    if path.name.startswith(".") and path.name.endswith(LOCK_SUFFIX) and path.is_file():
        pid = holder(path)
        return f"{path} is the lock file of an hpckpt run ({_run(pid)}){_remove_hint(path, pid)}"
    owner = sidecar_owner_path(path)
    if owner is not None and path.is_file() and not owner.exists():
        kind = "manifest" if path.name.endswith(".hpckpt-manifest.jsonl") else "values sidecar"
        return (f"{path} is the {kind} of {owner}, which does not exist (an hpckpt run that did not "
                f"finish, or the file was removed); remove it with `rm {shlex.quote(str(path))}` or rerun the command")
    return None


# -- what a write to an object store leaves: its writer's mark (`core.commit.object_staging`) ------

#: The writer's mark: inside a directory output, beside a file output (`.NAME` + this).
WRITING = ".hpckpt-writing"


def writing_mark(dest, file_output: bool):
    """Where the writer's mark of `dest` (an `ObjectPath`) lies."""
    return dest.parent / f".{dest.name}{WRITING}" if file_output else dest / WRITING


def read_mark(mark) -> dict | None:
    """The mark's record (`host`, `pid`, `token`, `names`, `started`) as it is now, None when there
    is none, {} when it cannot be read as one."""
    raw = mark.store.read_fresh(mark.key)
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def mark_is_alive(record: dict) -> bool | None:
    """Whether the run that wrote the mark is alive: None when it ran on another host."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return None
    return _alive(record["pid"])


def describe_mark(record: dict) -> str:
    started = record.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    alive = mark_is_alive(record)
    state = "on another host" if alive is None else "still running" if alive else "no longer running"
    return f"host {record.get('host', '?')!s:.64}, pid {record.get('pid', '?')!s:.12}, started {when}, {state}"


def _object_leftover(path) -> str | None:
    """What an unfinished write left at `path` (an `ObjectPath`): its writer's mark, if any."""
    for file_output in (False, True):
        if file_output and not path.key:
            continue
        mark = writing_mark(path, file_output)
        record = read_mark(mark) if mark.is_file() else None  # (the listing first: no GET for a finished output)
        if record is not None:
            return (f"{path} is an unfinished hpckpt write ({describe_mark(record)}); the next write to it "
                    f"removes what it left, or rerun the command with --force")
    return None


def sidecar_owner_path(path: Path) -> Path | None:
    """The file the sidecar `path` belongs to (as the converters registered it), or None."""
    name = formats.known().sidecar_owner(path.name)
    return path.with_name(name) if name else None


def sidecars_of(name: str) -> tuple[str, ...]:
    """The sidecars hpckpt may write beside the file `name` (as the converters registered them)."""
    return formats.known().sidecars_of(name)


# -- what killed runs left --------------------------------------------------------------------


def _leftovers_of(dest: Path) -> list[tuple[Path, bool, int]]:
    """`(path, moved aside, pid)` of the staging names of `dest` in its directory; names are
    compared exactly, never as glob patterns."""
    prefix = f".{dest.name}{TMP_MARK}"
    try:
        names = os.listdir(dest.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        if name.startswith(prefix):
            tail = name[len(prefix):]
            pid = tail.removeprefix("old-")
            if pid.isdigit() and pid.isascii():
                found.append((dest.parent / name, pid != tail, int(pid)))
    return found


def _dead(pid: int) -> bool:
    # ours is stale too: this run has not made its own yet (the pid of a killed run, reused)
    return pid == os.getpid() or not _alive(pid)


def remove_leftover(path: Path) -> None:
    """A staging directory, a file or a link, gone (already gone is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def remove_stale_staging(dest: Path, file_output: bool = False) -> None:
    """Remove what killed runs left for `dest` (their process is gone): staging directories and
    the sidecars of a single-file output they had linked into place; an old output a killed run
    had moved aside to replace it, with nothing in its place yet, is put back."""
    stale = [(path, aside) for path, aside, pid in _leftovers_of(dest) if _dead(pid)]
    for path, aside in sorted(stale, key=lambda s: s[1]):  # staging first: its sidecars go before the old come back
        if aside:
            put_back(path, dest, file_output)
        elif file_output and path.is_dir():
            unplace_sidecars(path, dest)
        if os.path.lexists(path):
            remove_leftover(path)


def unplace_sidecars(staging: Path, dest: Path) -> None:
    """The sidecars a run linked next to `dest` before it could rename the file in (its staging
    directory still holds the file): the same inode in both places."""
    if not (staging / dest.name).exists():
        return
    for name in os.listdir(staging):
        placed = dest.parent / name
        if name != dest.name and os.path.lexists(placed) and os.path.samefile(placed, staging / name):
            placed.unlink()


def put_back(trash: Path, dest: Path, file_output: bool) -> None:
    """The old output, moved aside to `trash`, back in place when no new one took it."""
    if os.path.lexists(dest):
        return  # the new output is in place: the old one goes
    if not file_output:
        os.rename(trash, dest)
        return
    if (trash / dest.name).exists():
        for name in sorted(os.listdir(trash), key=lambda n: n == dest.name):  # sidecars first, the file last
            if not os.path.lexists(dest.parent / name):  # (a sidecar not moved yet is the old one)
                os.rename(trash / name, dest.parent / name)


def remove_stale_temporaries(directory: Path) -> None:
    """Inside a fan-out directory: the staging directories and half-published files of jobs
    that were killed (`.hpckpt-tmp-PID`, `.hpckpt-tmp-PID-NAME`)."""
    for folder in (directory, directory / FRAGMENT_DIR):
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            match = STAGING_NAME.match(name)
            if name.startswith(TMP_MARK) and match and match.group(2) and not match.group(1) \
                    and _dead(int(match.group(2))):
                remove_leftover(folder / name)


# -- what a stopped job left for its destination -------------------------------------------------


def beside(dest: Path) -> list[Path]:
    """Every leftover of unfinished runs named after `dest` in its directory: staging directories
    (a live save's shared one too), an old output moved aside, the lock file."""
    if is_object(dest):
        return []
    dest = Path(dest).absolute()
    found = [path for path, _aside, _pid in _leftovers_of(dest)]
    for name in (f".{dest.name}{TMP_MARK}{DIST_MARK}", f".{dest.name}{LOCK_SUFFIX}"):
        if os.path.lexists(dest.parent / name):
            found.append(dest.parent / name)
    return sorted(found)


def missing_with_leftovers(dest: Path) -> tuple[str, str] | None:
    """For a destination that does not exist: `(message, hint)` naming what unfinished runs left
    beside it and the command that removes it, or None when nothing was left."""
    found = beside(dest)
    if not found:
        return None
    live = [p for p in found if p.name.endswith(LOCK_SUFFIX) and (pid := holder(p)) is not None and _alive(pid)]
    names = ", ".join(p.name for p in found)
    message = f"{dest}: no such file or directory; an unfinished hpckpt run left {names} beside it"
    if live:
        return message, f"that run (pid {holder(live[0])}) is still running: wait for it to finish"
    return message, "remove them with `rm -r " + " ".join(shlex.quote(str(p)) for p in found) + "`, or rerun the command"
