"""Outputs that are whole or absent: stage beside the destination, make durable, rename into place.

One strategy for every writing command, directory or single file:

1. `Staging(dest, source=..., force=...)` refuses a destination that is, lies in or holds the
   source, or is (or lies in) a staging name; an existing one unless `force`, and with `force`
   anything hpckpt does not recognise as a checkpoint or output of its own (or an empty
   directory), and a checkpoint directory holding entries that are neither its files nor
   hpckpt's (`_unaccounted`); missing parents unless `parents`.
   It takes the destination's lock (`core.lock`: a second run stops at once; replacing an
   existing destination, also an exclusive lock on it: a run reading it stops this one), removes what
   killed runs left for this destination (their pid is gone), checks the free space and creates
   `.NAME.hpckpt-tmp-PID/` next to `dest`.
2. The engine writes the data files into it and makes them durable; then `write_metadata` adds
   the metadata files (their presence is what marks a checkpoint complete), each fsynced.
3. `commit()` fsyncs the staging directory and renames it onto `dest` (a directory), then fsyncs
   the parent directory. An existing destination replaced with `--force` is moved aside to
   `.NAME.hpckpt-tmp-old-PID` first and removed only after the rename. Signals wait until the
   renames are done (`core.interrupts`).
4. Leaving the `with` block without `commit()` (an error, Ctrl-C, SIGTERM) removes the staging
   directory, puts a destination moved aside back, and releases the lock.

A single file with sidecars (`NAME.safetensors` + `NAME.values.json`) is committed so that after
a kill at any moment there is the old output, the new one, or no `NAME` at all: the old file
(then its sidecars) is moved aside, the new sidecars are hard-linked into place, the new file is
renamed in last. A sidecar without its file is refused by `inspect` and `verify` (`leftover`);
the next run removes the sidecars a killed run linked (the same inode as in its staging directory,
which still holds `NAME`) and puts back an old output it had begun to move aside.

A run killed at any moment leaves no destination, only names `leftover` explains (with the
command that removes them) and the next run with the same destination removes (an old output
moved aside, with nothing in its place yet, is put back). With `sync=False`
(`--no-fsync`) nothing is fsynced: still safe against a killed process (rename is atomic), not
against a power failure.

Fan-out (`Fragment`): many jobs write the files of their own ranks straight into one shared
destination directory (new, empty, or one jobs of the fan-out began: `refuse_not_fan_out`) (each file staged and renamed; the jobs share the lock); each records what
it wrote (with each file's size and mtime) and the metadata it would write under `.hpckpt-fanout/`;
`finalize` takes the lock alone, checks that every file of the plan is there unchanged and writes
the metadata.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
from pathlib import Path

from hpckpt.core.durable import check_space, fsync_path, write_error, write_file
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    DestinationExistsError,
    HpckptError,
    MissingFileError,
    NotACheckpointError,
    PathNotFoundError,
    UnsafeDestinationError,
)
from hpckpt.core.interrupts import critical
from hpckpt.core.lock import LOCK_SUFFIX, DestinationLock, ReplaceLock, holder

TMP_MARK = ".hpckpt-tmp-"
FRAGMENT_DIR = ".hpckpt-fanout"

# `.NAME.hpckpt-tmp-PID` (staging), `.NAME.hpckpt-tmp-old-PID` (moved aside), and inside a fan-out
# directory `.hpckpt-tmp-PID` (a job's staging) and `.hpckpt-tmp-PID-FILE` (a file being published)
_STAGING_NAME = re.compile(rf"^(?:\..+)?{re.escape(TMP_MARK)}(old-)?(\d+)(?:-.+)?$", re.DOTALL)


def staging_directory(path: Path) -> Path | None:
    """The hpckpt staging directory `path` is (or lies in), or None: what a run that did not
    finish leaves behind must never be read as a checkpoint."""
    for part in (path, *path.parents):
        if _STAGING_NAME.match(part.name):
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
    path = Path(path).absolute()
    staging = staging_directory(path)
    if staging is not None:
        match = _STAGING_NAME.match(staging.name)
        pid = int(match.group(2))
        what = ("the previous output, moved aside by an hpckpt run that replaced it" if match.group(1) else
                "the staging directory of an unfinished hpckpt run" if staging.is_dir() else
                "a temporary file of an unfinished hpckpt run")
        return f"{staging} is {what} ({_run(pid)}){_remove_hint(staging, pid)}"
    if path.name.startswith(".") and path.name.endswith(LOCK_SUFFIX) and path.is_file():
        pid = holder(path)
        return f"{path} is the lock file of an hpckpt run ({_run(pid)}){_remove_hint(path, pid)}"
    owner = _sidecar_owner(path)
    if owner is not None and path.is_file() and not os.path.lexists(owner):
        return (f"{path} is the values sidecar of {owner}, which does not exist (an hpckpt run that did not "
                f"finish, or the file was removed); remove it with `rm {shlex.quote(str(path))}` or rerun the command")
    return None


def _sidecar_owner(path: Path) -> Path | None:
    from hpckpt.converters.values_sidecar import owner_of  # converters import this module

    name = owner_of(path.name)
    return path.with_name(name) if name else None


def _sidecars_of(name: str) -> tuple[str, ...]:
    from hpckpt.converters.values_sidecar import sidecars_of

    return sidecars_of(name)


# -- what may be written where ----------------------------------------------------------------


def refuse_unsafe(dest: Path, source: Path | None) -> None:
    """A destination that is the source, lies inside it or contains it is refused, `--force` or
    not: writing it would change or delete the checkpoint being read (real paths compared).

    Raises:
        UnsafeDestinationError: it is.
    """
    if source is None:
        return
    src, out = Path(os.path.realpath(source)), Path(os.path.realpath(dest))
    hint = "write the output somewhere else"
    if out == src:
        raise UnsafeDestinationError(f"{dest} is the source {source}", hint=hint)
    if src.is_dir() and out.is_relative_to(src):
        raise UnsafeDestinationError(f"{dest} lies inside the source {source}: writing there would change the "
                                     "checkpoint being read", hint=hint)
    if src.is_relative_to(out):
        raise UnsafeDestinationError(f"{dest} contains the source {source}: replacing it would delete the "
                                     "checkpoint being read", hint=hint)


def refuse_staging_name(dest: Path) -> None:
    """A destination that is (or lies in) an hpckpt staging name is refused: `verify` would never
    accept it and the next run for its destination would remove it.

    Raises:
        UnsafeDestinationError: it is.
    """
    staging = staging_directory(Path(dest).absolute())
    if staging is not None:
        where = "is" if staging == Path(dest).absolute() else f"lies in {staging}, which is"
        raise UnsafeDestinationError(f"{dest} {where} an hpckpt staging name (`.NAME{TMP_MARK}PID`): what is written "
                                     "there is never read as a checkpoint and is removed by a later run",
                                     hint="choose a name without `.hpckpt-tmp-`")


def refuse_not_fan_out(dest: Path) -> None:
    """Fan-out jobs write into a new or empty directory, or one their own jobs began (it holds
    `.hpckpt-fanout/`); never into any other existing file or directory, whose files a job's
    would replace.

    Raises:
        DestinationExistsError: it is something else.
    """
    if not os.path.lexists(dest):
        return
    hint = ("fan-out jobs write into a new or empty directory, or one that jobs of the same reshard began: "
            "choose another destination, or remove it yourself")
    if not dest.is_dir():
        raise DestinationExistsError(f"{dest} exists and is not a directory", hint=hint)
    names = os.listdir(dest)
    if names and FRAGMENT_DIR not in names and _recognised(dest):
        raise DestinationExistsError(f"{dest} is already a finished checkpoint", hint=hint)
    if names and FRAGMENT_DIR not in names:
        raise DestinationExistsError(f"{dest} exists and is not a fan-out in progress (it holds {len(names)} "
                                     f"{'entry' if len(names) == 1 else 'entries'} and no {FRAGMENT_DIR}/)",
                                     hint=hint)


def refuse_existing(dest: Path, force: bool, file_output: bool = False) -> None:
    """Every writing command leaves an existing destination alone unless told to replace it, and
    with `force` replaces only what hpckpt recognises (`_foreign`).

    Raises:
        DestinationExistsError: it exists and `force` is off, or a single-file output would
            replace a directory.
        UnsafeDestinationError: `force` is on and it is not something hpckpt may replace.
    """
    if not os.path.lexists(dest):
        return
    if not force:
        raise DestinationExistsError(f"{dest} exists", hint="pass --force to replace it")
    if file_output and dest.is_dir():  # --force replaces a file with a file, never a directory
        raise DestinationExistsError(f"{dest} is a directory; a single-file output cannot replace it",
                                     hint="name a file (model.safetensors, model.pt, model.ckpt), or remove "
                                          "the directory yourself")
    _refuse_foreign(dest)


def _refuse_existing_sidecars(dest: Path, staged: list[str], force: bool) -> None:
    """A sidecar already beside a single-file destination is part of what would be replaced."""
    for name in dict.fromkeys((*_sidecars_of(dest.name), *staged)):
        path = dest.parent / name
        if os.path.lexists(path) and name != dest.name:
            if not force:
                raise DestinationExistsError(f"{path} exists", hint="pass --force to replace it")
            _refuse_foreign(path)


def _refuse_foreign(path: Path) -> None:
    what = _foreign(path)
    if what is not None:
        raise UnsafeDestinationError(f"refusing to replace {path}: {what}",
                                     hint="--force replaces only checkpoints and hpckpt's own outputs: remove it "
                                          "yourself, or choose another destination")


def _foreign(path: Path) -> str | None:
    """Why `path` is not something `--force` may replace, or None: a checkpoint or file hpckpt
    reads, a values sidecar, what an hpckpt run left, or an empty directory."""
    if staging_directory(path.absolute()) is not None:
        return None
    if path.is_dir():
        names = os.listdir(path)
        if not names or FRAGMENT_DIR in names:
            return None
        if not _recognised(path):
            return f"it holds {len(names)} {'entry' if len(names) == 1 else 'entries'} and no checkpoint"
        return _unaccounted(path, names)
    if path.is_file():
        if _sidecar_owner(path) is not None:
            return None if _is_sidecar(path) else "it is not a values sidecar hpckpt wrote"
        return None if _recognised(path) else (f"it is a file of {path.stat().st_size} bytes and no checkpoint "
                                               "hpckpt recognises")
    return "it is neither a regular file nor a directory"


def _unaccounted(path: Path, names: list[str]) -> str | None:
    """Why the checkpoint directory `path` may not be replaced whole, or None: its metadata cannot
    be read, or it holds entries (`names`, its top level) that are neither the files its
    metadata refers to nor hpckpt's own (`.hpckpt.json`, locks, staging names, sidecars)."""
    from hpckpt.converters import open_index  # converters import this module

    try:
        index = open_index(path)
    except (HpckptError, OSError) as exc:
        return f"its metadata cannot be read ({getattr(exc, 'message', exc)}), so what it holds is unknown"
    own = {Path(name).parts[0] for name in (*index.data_files, *index.metadata_files) if Path(name).parts}
    strays = sorted(name for name in names if name not in own and not _hpckpt_own(path, name, own, index.format))
    if not strays:
        return None
    shown = ", ".join(strays[:3]) + (f" and {len(strays) - 3} more" if len(strays) > 3 else "")
    return f"{shown} {'is' if len(strays) == 1 else 'are'} not part of its checkpoint"


def _hpckpt_own(directory: Path, name: str, listed: set[str], fmt: str) -> bool:
    """A top-level entry of a checkpoint directory that hpckpt itself writes or leaves there."""
    from hpckpt.converters import hpckpt_json, index_cache
    from hpckpt.converters.hf_sharded import SIDECAR_NAME
    from hpckpt.converters.values_sidecar import owner_of

    if name in (hpckpt_json.NAME, FRAGMENT_DIR) or _STAGING_NAME.match(name):
        return True
    if name.startswith(".") and name.endswith(LOCK_SUFFIX):
        return True
    if owner_of(name) in listed or (name == SIDECAR_NAME and fmt.startswith("hf-")):  # values sidecars
        return True
    cache = index_cache.cache_dir()  # the index cache, when HPCKPT_CACHE_DIR puts it there
    try:
        return cache is not None and Path(os.path.realpath(cache)).is_relative_to(os.path.realpath(directory / name))
    except OSError:
        return False


def _recognised(path: Path) -> bool:
    from hpckpt.converters import detect  # converters import this module

    try:
        detect(path)
    except CorruptMetadataError:
        return True  # a checkpoint of a format hpckpt reads, broken
    except HpckptError:
        return False
    return True


def _is_sidecar(path: Path) -> bool:
    from hpckpt.converters import values_sidecar

    try:
        values_sidecar.read(path)
    except HpckptError:
        return False
    return True


def ensure_parent(dest: Path, parents: bool) -> None:
    """The directory the destination goes in exists, or is created when `parents` says so.

    Raises:
        PathNotFoundError: it is missing (and `parents` is off), or a file is in the way.
    """
    parent = dest.parent
    if parent.is_dir():
        return
    existing = parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PathNotFoundError(f"cannot write {dest}: {existing} is not a directory")
    if not parents:
        raise PathNotFoundError(f"{parent}: no such directory (the destination's parent)",
                                hint="create it, or pass --parents to have it created")
    parent.mkdir(parents=True, exist_ok=True)


# -- what killed runs left --------------------------------------------------------------------


def _leftovers_of(dest: Path) -> list[tuple[Path, bool, int]]:
    """`(path, moved aside, pid)` of the staging names of `dest` in its directory; names are
    compared exactly, never as glob patterns."""
    prefix = f".{dest.name}{TMP_MARK}"
    try:
        names = os.listdir(dest.parent)
    except FileNotFoundError:
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


def _remove(path: Path) -> None:
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
            _put_back(path, dest, file_output)
        elif file_output and path.is_dir():
            _unplace_sidecars(path, dest)
        if os.path.lexists(path):
            _remove(path)


def _unplace_sidecars(staging: Path, dest: Path) -> None:
    """The sidecars a run linked next to `dest` before it could rename the file in (its staging
    directory still holds the file): the same inode in both places."""
    if not (staging / dest.name).exists():
        return
    for name in os.listdir(staging):
        placed = dest.parent / name
        if name != dest.name and os.path.lexists(placed) and os.path.samefile(placed, staging / name):
            placed.unlink()


def _put_back(trash: Path, dest: Path, file_output: bool) -> None:
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
            match = _STAGING_NAME.match(name)
            if name.startswith(TMP_MARK) and match and not match.group(1) and _dead(int(match.group(2))):
                _remove(folder / name)


# -- one output -------------------------------------------------------------------------------


class Staging:
    """The staging directory of one output; a context manager, `commit()` at the end.

    `file_output=True`: `dest` is a file; the staged file named `dest.name` is the output and
    any other staged file a sidecar placed next to it. `source` (a path, None for arrays in
    memory) is what `dest` must not overlap; `needed` the bytes of the data files, checked
    against the free space before anything is written.
    """

    def __init__(self, dest: Path, *, source: Path | None = None, force: bool = False, sync: bool = True,
                 file_output: bool = False, parents: bool = False, needed: int = 0):
        self.dest = Path(dest)
        self.sync = sync
        self.file_output = file_output
        self.force = force
        self.path = self.dest.parent / f".{self.dest.name}{TMP_MARK}{os.getpid()}"
        self.trash = self.dest.parent / f".{self.dest.name}{TMP_MARK}old-{os.getpid()}"
        self._done = False
        refuse_staging_name(self.dest)
        refuse_unsafe(self.dest, source)
        refuse_existing(self.dest, force, file_output)
        ensure_parent(self.dest, parents)
        self._lock = DestinationLock(self.dest).acquire()
        self._replacing: ReplaceLock | None = None
        try:
            remove_stale_staging(self.dest, file_output)
            refuse_existing(self.dest, force, file_output)  # an old output put back counts
            if os.path.lexists(self.dest):  # (`force`): no run may be reading it while it is replaced
                self._replacing = ReplaceLock(self.dest)
            if file_output:
                _refuse_existing_sidecars(self.dest, [], force)
            check_space(self.dest, needed)
            self.path.mkdir()
        except BaseException:
            if self._replacing is not None:
                self._replacing.release()
            self._lock.release()
            raise

    def write_metadata(self, files: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]]) -> None:
        """The files written last: after every data file is durable."""
        for name, data in files:
            write_file(self.path / name, data, self.sync)

    def commit(self) -> None:
        """Put the staged output in place of `dest`: atomically for a directory; for a file, so
        that no state after a kill verifies as anything but the old or the new output."""
        if self.sync:
            fsync_path(self.path)
        with critical():
            if self.file_output:
                self._commit_file()
            else:
                self._commit_directory()
            if self.sync:
                fsync_path(self.dest.parent)
            self._done = True

    def _commit_directory(self) -> None:
        if os.path.lexists(self.dest):
            os.rename(self.dest, self.trash)
        os.rename(self.path, self.dest)

    def _commit_file(self) -> None:
        parent, name = self.dest.parent, self.dest.name
        sidecars = sorted(n for n in os.listdir(self.path) if n != name)
        _refuse_existing_sidecars(self.dest, sidecars, self.force)
        old = [n for n in dict.fromkeys((name, *_sidecars_of(name), *sidecars)) if os.path.lexists(parent / n)]
        if old:
            self.trash.mkdir()
            for n in old:  # the file first: a sidecar left without it belongs to nothing
                os.rename(parent / n, self.trash / n)
        for n in sidecars:
            _link(self.path / n, parent / n)
        os.replace(self.path / name, self.dest)
        shutil.rmtree(self.path)

    def _undo(self) -> None:
        """After a failure: no staged data, no sidecar of ours in place, the old output back."""
        if self.file_output and self.path.is_dir():
            _unplace_sidecars(self.path, self.dest)
        shutil.rmtree(self.path, ignore_errors=True)
        if os.path.lexists(self.trash):
            _put_back(self.trash, self.dest, self.file_output)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if not self._done:
                self._undo()
            if os.path.lexists(self.trash):
                _remove(self.trash)
        finally:
            if self._replacing is not None:  # the old output is gone (or back in place)
                self._replacing.release()
            self._lock.release()


def _link(staged: Path, placed: Path) -> None:
    """Hard-link a staged sidecar into place (the staging directory keeps it, so that the next
    run can tell it is ours); a file system without hard links gets it renamed."""
    try:
        os.link(staged, placed)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        os.rename(staged, placed)


# -- fan-out ----------------------------------------------------------------------------------


def _identity(path: Path) -> list[int]:
    """What `finalize` compares to tell that a file is the one its job wrote."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


class Fragment:
    """One fan-out job's share of a directory output: its files go straight into `dest`.

    `commit` records what this job wrote, the metadata the whole output will have (the same
    bytes for every job of one plan) and every data file of the whole plan, under
    `.hpckpt-fanout/`, for `finalize`.
    """

    def __init__(self, dest: Path, *, source: Path | None = None, sync: bool = True, parents: bool = False,
                 needed: int = 0):
        self.dest = Path(dest)
        self.sync = sync
        self.fragments = self.dest / FRAGMENT_DIR
        self.path = self.dest / f"{TMP_MARK}{os.getpid()}"
        refuse_staging_name(self.dest)
        refuse_unsafe(self.dest, source)
        refuse_not_fan_out(self.dest)
        ensure_parent(self.dest, parents)
        self._lock = DestinationLock(self.dest, shared=True).acquire()
        try:
            refuse_not_fan_out(self.dest)  # again under the lock: a run replacing it may have finished
            self._made = [p for p in (self.dest, self.fragments) if not p.exists()]  # removed again if this job fails
            self.fragments.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.dest)
            check_space(self.dest, needed)
            self.path.mkdir(exist_ok=True)
        except BaseException:
            self._lock.release()
            raise

    def _publish(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f"{TMP_MARK}{os.getpid()}-{path.name}")
        tmp.unlink(missing_ok=True)
        write_file(tmp, data, self.sync)
        os.replace(tmp, path)

    def commit(self, ranks: tuple[int, ...], metadata: tuple[tuple[str, bytes], ...], expected: list[str]) -> None:
        """Move this job's staged files into `dest` and record them with the plan they belong to.

        Raises:
            DestinationExistsError: `dest` is a finished output already.
        """
        if metadata and (self.dest / metadata[-1][0]).exists():  # the file written last marks it finished
            raise DestinationExistsError(f"{self.dest} is already a finished checkpoint")
        digest = hashlib.sha256()
        for name, data in metadata:
            digest.update(name.encode() + b"\0" + data)
        plan = digest.hexdigest()
        plan_file = self.fragments / f"plan-{plan[:16]}.json"
        if not plan_file.exists():
            for name, data in metadata:
                self._publish(self.fragments / f"plan-{plan[:16]}{name}", data)
            self._publish(plan_file, json.dumps({"plan": plan, "files": expected,
                                                 "metadata": [name for name, _ in metadata]}).encode())
        names = sorted(os.listdir(self.path))
        for name in names:
            os.replace(self.path / name, self.dest / name)
        os.rmdir(self.path)
        record = {"plan": plan, "ranks": list(ranks), "files": names,
                  "identity": {name: _identity(self.dest / name) for name in names}}
        self._publish(self.fragments / f"ranks-{min(ranks)}-{max(ranks)}-{plan[:16]}.json",
                      json.dumps(record, sort_keys=True).encode())

    def __enter__(self) -> "Fragment":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.path.is_dir():
                shutil.rmtree(self.path, ignore_errors=True)
            if exc_type is not None:
                for made in reversed(self._made):  # a failed first job leaves no directory behind
                    try:
                        made.rmdir()
                    except OSError:
                        break  # another job's files are in it, or it is gone
        finally:
            self._lock.release()


def finalize(dest: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Write the metadata of a fanned-out output once every data file of its plan is there, as
    its job wrote it; return the names of its data files and of the metadata files written.

    Raises:
        NotACheckpointError: `dest` holds no fan-out fragments.
        CorruptMetadataError: the fragments come from different plans.
        MissingFileError: some files are missing (the message names one).
        CorruptDataError: a file was changed (truncated, replaced) after its job wrote it.
        DestinationLockedError: a job is still writing into `dest`.
    """
    dest = Path(dest)
    try:
        with DestinationLock(dest):
            remove_stale_temporaries(dest)
            return _finalize(dest)
    except OSError as exc:
        if isinstance(exc, HpckptError):
            raise
        raise write_error(exc, dest) from None


def _record(path: Path):
    """A fan-out record: hpckpt wrote it, but it lies in a directory anyone may have changed."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptMetadataError(f"{path}: not a fan-out record hpckpt wrote ({exc})",
                                   hint="rerun the fan-out jobs (`hpckpt reshard ... --rank R`)") from None


def _finalize(dest: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    fragments = dest / FRAGMENT_DIR
    records = [_record(p) for p in sorted(fragments.glob("ranks-*.json"))] if fragments.is_dir() else []
    if not records:
        raise NotACheckpointError(f"{dest}: no fan-out fragments to finalize",
                                  hint="run `hpckpt reshard ... --rank R` for every target rank first")
    digests = {r["plan"] for r in records}
    if len(digests) != 1:
        raise CorruptMetadataError(f"{dest}: fragments come from {len(digests)} different plans (different sources or options)")
    (digest,) = digests
    plan = _record(fragments / f"plan-{digest[:16]}.json")
    done = {f for r in records for f in r["files"]}
    missing = [name for name in plan["files"] if name not in done or not (dest / name).is_file()]
    if missing:
        raise MissingFileError(f"{dest}: {len(missing)} file(s) not written yet, e.g. {missing[0]}",
                               hint="run the missing target ranks with --rank, then finalize again")
    _check_unchanged(dest, records)
    staged = []  # written (and fsynced) under temporary names first: that can take a while
    try:
        for name in plan["metadata"]:
            tmp = dest / f"{TMP_MARK}{os.getpid()}-{name}"
            tmp.unlink(missing_ok=True)
            staged.append((tmp, dest / name))
            write_file(tmp, (fragments / f"plan-{digest[:16]}{name}").read_bytes())
    except BaseException:  # an error or a signal: no metadata in place, no temporary left
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    with critical():  # only the renames: a signal waits for them, never for the writes
        for tmp, target in staged:
            os.replace(tmp, target)
        fsync_path(dest)
    shutil.rmtree(fragments)
    return tuple(plan["files"]), tuple(plan["metadata"])


def _check_unchanged(dest: Path, records: list[dict]) -> None:
    """Every recorded file is still the one a job wrote (size and mtime as recorded by one of
    the jobs that wrote it: a rank rerun writes its file again)."""
    recorded: dict[str, list[list[int]]] = {}
    for record in records:
        for name, identity in record.get("identity", {}).items():
            recorded.setdefault(name, []).append(identity)
    for name, identities in sorted(recorded.items()):
        now = _identity(dest / name)
        if now not in identities:
            size = identities[-1][0]
            change = f"{now[0]} bytes, written with {size}" if now[0] != size else "modified after it was written"
            raise CorruptDataError(f"{dest / name}: changed since its fan-out job wrote it ({change})",
                                   hint="rerun the target ranks that write it with --rank, then finalize again")
