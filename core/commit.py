"""Outputs that are whole or absent: stage beside the destination, make durable, rename into place.

One strategy for every writing command, directory or single file:

1. `Staging(dest, force=...)` refuses an existing destination unless `force`, removes the
   staging directories of `dest` that killed runs left (their process is gone), and creates
   `.NAME.hpckpt-tmp-PID/` next to `dest`.
2. The engine writes the data files into it and makes them durable; then `write_metadata` adds
   the metadata files (their presence is what marks a checkpoint complete), each fsynced.
3. `commit()` fsyncs the staging directory and renames it onto `dest` (a directory), or renames
   each staged file next to `dest` (a file destination: its sidecars first, the file itself
   last), then fsyncs the parent directory. An existing destination replaced with `--force` is
   moved aside first and removed only after the rename.
4. Leaving the `with` block without `commit()` (an error, Ctrl-C) removes the staging directory.

A run killed at any moment leaves no destination, only a staging directory without metadata,
which `verify` refuses and the next run removes. With `sync=False` (`--no-fsync`) nothing is
fsynced: still safe against a killed process (rename is atomic), not against a power failure.

Fan-out (`Fragment`): many jobs write the files of their own ranks straight into one shared
destination directory (each file staged and renamed); each records what it wrote and the
metadata it would write under `.hpckpt-fanout/`; `finalize` writes the metadata once every file
of the plan is there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from hpckpt.core.durable import fsync_path, write_file
from hpckpt.core.errors import CorruptMetadataError, DestinationExistsError, MissingFileError, NotACheckpointError

TMP_MARK = ".hpckpt-tmp-"
FRAGMENT_DIR = ".hpckpt-fanout"


def refuse_existing(dest: Path, force: bool) -> None:
    """Every writing command leaves an existing destination alone unless told to replace it."""
    if dest.exists() and not force:
        raise DestinationExistsError(f"{dest} exists", hint="pass --force to replace it")


_STAGING_NAME = re.compile(rf"^(?:\..+)?{re.escape(TMP_MARK)}(?:old-)?\d+$")


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


def remove_stale_staging(dest: Path) -> None:
    """Remove what killed runs left for `dest`: `.NAME.hpckpt-tmp-PID` (and `-old-PID`) whose
    process is gone. Names are compared exactly, never as glob patterns."""
    prefix = f".{dest.name}{TMP_MARK}"
    try:
        names = os.listdir(dest.parent)
    except FileNotFoundError:
        return
    for name in names:
        tail = name[len(prefix):] if name.startswith(prefix) else None
        pid = tail.removeprefix("old-") if tail is not None else ""
        # ours is stale too: this run has not made its own yet (the pid of a killed run, reused)
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            stale = dest.parent / name
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


class Staging:
    """The staging directory of one output; a context manager, `commit()` at the end.

    `file_output=True`: `dest` is a file; the staged file named `dest.name` is the output and
    any other staged file a sidecar placed next to it.
    """

    def __init__(self, dest: Path, *, force: bool = False, sync: bool = True, file_output: bool = False):
        self.dest = Path(dest)
        self.sync = sync
        self.file_output = file_output
        refuse_existing(self.dest, force)
        if file_output and self.dest.is_dir():  # --force replaces a file with a file, never a directory
            raise DestinationExistsError(f"{self.dest} is a directory; a single-file output cannot replace it",
                                         hint="name a file (model.safetensors, model.pt, model.ckpt), or remove "
                                              "the directory yourself")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(self.dest)
        self.path = self.dest.parent / f".{self.dest.name}{TMP_MARK}{os.getpid()}"
        self.path.mkdir()
        self._done = False

    def write_metadata(self, files: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]]) -> None:
        """The files written last: after every data file is durable."""
        for name, data in files:
            write_file(self.path / name, data, self.sync)

    def commit(self) -> None:
        """Put the staged output in place of `dest`, atomically for a directory."""
        if self.sync:
            fsync_path(self.path)
        if self.file_output:
            staged = sorted(os.listdir(self.path), key=lambda n: n == self.dest.name)  # the output last
            for name in staged:
                os.replace(self.path / name, self.dest.parent / name)
            os.rmdir(self.path)
        else:
            trash = None
            if self.dest.exists():
                trash = self.dest.parent / f".{self.dest.name}{TMP_MARK}old-{os.getpid()}"
                os.rename(self.dest, trash)
            os.rename(self.path, self.dest)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()
        if self.sync:
            fsync_path(self.dest.parent)
        self._done = True

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            shutil.rmtree(self.path, ignore_errors=True)


class Fragment:
    """One fan-out job's share of a directory output: its files go straight into `dest`.

    `commit` records what this job wrote, the metadata the whole output will have (the same
    bytes for every job of one plan) and every data file of the whole plan, under
    `.hpckpt-fanout/`, for `finalize`.
    """

    def __init__(self, dest: Path, *, sync: bool = True):
        self.dest = Path(dest)
        self.sync = sync
        self.fragments = self.dest / FRAGMENT_DIR
        self._made = [p for p in (self.dest, self.fragments) if not p.exists()]  # removed again if this job fails
        self.fragments.mkdir(parents=True, exist_ok=True)
        self.path = self.dest / f"{TMP_MARK}{os.getpid()}"
        self.path.mkdir(exist_ok=True)

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
        if any((self.dest / name).exists() for name, _ in metadata):
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
        record = {"plan": plan, "ranks": list(ranks), "files": names}
        self._publish(self.fragments / f"ranks-{min(ranks)}-{max(ranks)}-{plan[:16]}.json",
                      json.dumps(record, sort_keys=True).encode())

    def __enter__(self) -> "Fragment":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.path.is_dir():
            shutil.rmtree(self.path, ignore_errors=True)
        if exc_type is not None:
            for made in reversed(self._made):  # a failed first job leaves no directory behind
                try:
                    made.rmdir()
                except OSError:
                    break  # another job's files are in it, or it is gone


def finalize(dest: Path) -> int:
    """Write the metadata of a fanned-out output once every data file of its plan is there;
    return the number of data files.

    Raises:
        NotACheckpointError: `dest` holds no fan-out fragments.
        CorruptMetadataError: the fragments come from different plans.
        MissingFileError: some files are missing (the message names one).
    """
    dest = Path(dest)
    fragments = dest / FRAGMENT_DIR
    records = [json.loads(p.read_text()) for p in sorted(fragments.glob("ranks-*.json"))] if fragments.is_dir() else []
    if not records:
        raise NotACheckpointError(f"{dest}: no fan-out fragments to finalize",
                                  hint="run `hpckpt reshard ... --rank R` for every target rank first")
    digests = {r["plan"] for r in records}
    if len(digests) != 1:
        raise CorruptMetadataError(f"{dest}: fragments come from {len(digests)} different plans (different sources or options)")
    (digest,) = digests
    plan = json.loads((fragments / f"plan-{digest[:16]}.json").read_text())
    done = {f for r in records for f in r["files"]}
    missing = [name for name in plan["files"] if name not in done or not (dest / name).is_file()]
    if missing:
        raise MissingFileError(f"{dest}: {len(missing)} file(s) not written yet, e.g. {missing[0]}",
                               hint="run the missing target ranks with --rank, then finalize again")
    for name in plan["metadata"]:
        target = dest / name
        tmp = dest / f"{TMP_MARK}{os.getpid()}-{name}"
        tmp.unlink(missing_ok=True)
        write_file(tmp, (fragments / f"plan-{digest[:16]}{name}").read_bytes())
        os.replace(tmp, target)
    fsync_path(dest)
    shutil.rmtree(fragments)
    return len(plan["files"])
