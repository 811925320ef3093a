"""Outputs that are whole or absent: stage beside the destination, make durable, rename into place.

One strategy for every writing command, directory or single file (a fan-out of several jobs into one
directory: `fan_out.py`; a live save's ranks share `Staging(shared=True)`; a rank-local save:
`rank_local.py`; `hpckpt run reshard`: `set_aside.py`):

1. `Staging(dest, source=..., force=...)` refuses a destination that is, lies in or holds the
   source, or is (or lies in) a staging name; an existing one unless `force`, and with `force`
   anything hpckpt does not recognise as a checkpoint or output of its own (or an empty
   directory), and a checkpoint directory holding entries that are neither its files nor
   hpckpt's (`_unaccounted`); missing parents unless `parents`.
   It takes the destination's lock (`core.commit.lock`: a second run stops at once; replacing an
   existing destination, also an exclusive lock on it: a run reading it stops this one), removes what
   killed runs left for this destination (their pid is gone), checks the free space and creates
   `.NAME.hpckpt-tmp-PID/` next to `dest`.
2. The engine writes the data files into it and makes them durable; then `write_metadata` adds
   the metadata files (their presence is what marks a checkpoint complete), each fsynced.
3. `commit()` fsyncs the staging directory and renames it onto `dest` (a directory), then fsyncs
   the parent directory. An existing destination replaced with `--force` is moved aside to
   `.NAME.hpckpt-tmp-old-PID` first and removed only after the rename. Signals wait until the
   renames are done (`core.commit.interrupts`).
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

"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from hpckpt.core.commit.destination import (
    ensure_parent,
    remove_made,
    refuse_existing,
    refuse_existing_sidecars,
    refuse_staging_name,
    refuse_unsafe,
)
from hpckpt.core.commit.durable import check_space, fsync_path, write_file
from hpckpt.core.commit.interrupts import critical
from hpckpt.core.commit.leftovers import (
    DIST_MARK,
    TMP_MARK,
    put_back,
    remove_leftover,
    sidecars_of,
    unplace_sidecars,
    remove_stale_staging,
)
from hpckpt.core.commit.lock import DestinationLock, ReplaceLock
from hpckpt.core.storage.object_path import is_object


# -- one output -------------------------------------------------------------------------------


def staging_for(dest, *, source=None, force: bool = False, sync: bool = True, file_output: bool = False,
                parents: bool = False, needed: int = 0, shared: bool = False, memory: int | None = None):
    """`Staging` for a local destination, `ObjectStaging` (`core.commit.object_staging`) for an
    object in a store: one protocol, `path` to fill, `write_metadata`, `commit`. `memory`: what
    an upload may hold at once (its parts in flight), default the store's."""
    if is_object(dest):
        from hpckpt.core.commit.object_staging import ObjectStaging

        sized = {} if memory is None else {"memory": memory}
        return ObjectStaging(dest, source=source, force=force, file_output=file_output, needed=needed, **sized)
    return Staging(dest, source=source, force=force, sync=sync, file_output=file_output, parents=parents,
                   needed=needed, shared=shared)


def shared_staging(dest: Path) -> Path:
    """The staging directory every rank of a live save writes into (`hpckpt.dist`,
    `Staging(shared=True)`): its name cannot hold a pid, since the other ranks must find it."""
    return dest.parent / f".{dest.name}{TMP_MARK}{DIST_MARK}"


class Staging:
    """The staging directory of one output; a context manager, `commit()` at the end.

    `file_output=True`: `dest` is a file; the staged file named `dest.name` is the output and
    any other staged file a sidecar placed next to it. `source` (a path, None for arrays in
    memory) is what `dest` must not overlap; `needed` the bytes of the data files, checked
    against the free space before anything is written.
    """

    #: told how much of each data file the engine has made final (`core.io.write.fill`): nothing
    #: to do before the rename here; `ObjectStaging` uploads it as it grows
    filled = None

    def __init__(self, dest: Path, *, source: Path | None = None, force: bool = False, sync: bool = True,
                 file_output: bool = False, parents: bool = False, needed: int = 0, shared: bool = False):
        self.dest = Path(dest)
        self.sync = sync
        self.file_output = file_output
        self.force = force
        self.path = shared_staging(self.dest) if shared else self.dest.parent / f".{self.dest.name}{TMP_MARK}{os.getpid()}"
        self.trash = self.dest.parent / f".{self.dest.name}{TMP_MARK}old-{os.getpid()}"
        self._done = False
        refuse_staging_name(self.dest)
        refuse_unsafe(self.dest, source)
        refuse_existing(self.dest, force, file_output)
        self._made = ensure_parent(self.dest, parents)
        try:
            self._lock = DestinationLock(self.dest).acquire()
        except BaseException:
            remove_made(self._made)
            raise
        self._replacing: ReplaceLock | None = None
        try:
            remove_stale_staging(self.dest, file_output)
            if shared and os.path.lexists(self.path):  # a live save that did not finish (we hold the lock)
                remove_leftover(self.path)
            refuse_existing(self.dest, force, file_output)  # an old output put back counts
            if os.path.lexists(self.dest):  # (`force`): no run may be reading it while it is replaced
                self._replacing = ReplaceLock(self.dest)
            if file_output:
                refuse_existing_sidecars(self.dest, [], force)
            check_space(self.dest, needed)
            self.path.mkdir()
        except BaseException:
            if self._replacing is not None:
                self._replacing.release()
            self._lock.release()
            remove_made(self._made)
            raise

    def write_metadata(self, files: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]], *,
                       marks: bool = True) -> None:
        """The files written last: after every data file is durable. (`marks`: whether they are
        what says "complete", or only sidecars such as the manifest; it matters only where there is
        no rename, `ObjectStaging`.)"""
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
        refuse_existing_sidecars(self.dest, sidecars, self.force)
        old = [n for n in dict.fromkeys((name, *sidecars_of(name), *sidecars)) if os.path.lexists(parent / n)]
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
            unplace_sidecars(self.path, self.dest)
        shutil.rmtree(self.path, ignore_errors=True)
        if os.path.lexists(self.trash):
            put_back(self.trash, self.dest, self.file_output)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        """Release the destination: the staged output removed unless committed, an old output
        moved aside put back (or, after the commit, removed), the locks let go. What `with`
        does at its end; a writer whose commit spans calls of another protocol (torch's
        StorageWriter) calls it itself."""
        try:
            if not self._done:
                self._undo()
            if os.path.lexists(self.trash):
                remove_leftover(self.trash)
        finally:
            if self._replacing is not None:  # the old output is gone (or back in place)
                self._replacing.release()
            self._lock.release()
            if not self._done:  # (the parents --parents made: a failed run leaves nothing)
                remove_made(self._made)


def _link(staged: Path, placed: Path) -> None:
    """Hard-link a staged sidecar into place (the staging directory keeps it, so that the next
    run can tell it is ours); a file system without hard links gets it renamed."""
    try:
        os.link(staged, placed)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        os.rename(staged, placed)
