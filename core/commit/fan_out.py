"""Fan-out: many jobs write the files of their own ranks straight into one shared destination
directory (new, empty, or one the jobs of the fan-out began: `refuse_not_fan_out`), each file
staged and renamed, the jobs sharing the lock (`Fragment`). Each records what it wrote (each
file's size and mtime) and the metadata it would write under `.hpckpt-fanout/`; `finalize` takes
the lock alone, checks that every file of the plan is there unchanged and writes the metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from hpckpt.core.commit import manifest
from hpckpt.core.commit.destination import (
    ensure_parent,
    refuse_not_fan_out,
    refuse_staging_name,
    refuse_unsafe,
)
from hpckpt.core.commit.durable import check_space, fsync_path, write_error, write_file
from hpckpt.core.commit.interrupts import critical
from hpckpt.core.commit.leftovers import FRAGMENT_DIR, TMP_MARK, remove_stale_temporaries
from hpckpt.core.commit.lock import DestinationLock
from hpckpt.core.commit.replace import replace_file
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    DestinationExistsError,
    HpckptError,
    MissingFileError,
    NotACheckpointError,
    PathNotFoundError,
)
from hpckpt.core.storage.object_path import is_object


def file_identity(path) -> list:
    """What `finalize` compares to tell that a file is the one its job wrote: its size and
    mtime, or in an object store its size and entity tag."""
    if is_object(path):
        info = path.store.info(path.key)
        if info is None:
            raise FileNotFoundError(f"{path}: no such object")
        return [info.size, info.etag]
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def plan_digest(metadata: tuple[tuple[str, bytes], ...]) -> str:
    """Names the plan a fragment belongs to: the metadata the whole output will have."""
    digest = hashlib.sha256()
    for name, data in metadata:
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()


def _read(path) -> bytes:
    return path.store.read_all(path.key) if is_object(path) else path.read_bytes()


class Fragment:
    """One fan-out job's share of a directory output: its files go straight into `dest`.

    `commit` records what this job wrote, the metadata the whole output will have (the same
    bytes for every job of one plan) and every data file of the whole plan, under
    `.hpckpt-fanout/`, for `finalize`.
    """

    #: told how much of each file the engine has made final: nothing to do here (`ObjectFragment`
    #: uploads them as they grow)
    filled = None

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
        replace_file(path, data, fsync=self.sync, aside=path.with_name(f"{TMP_MARK}{os.getpid()}-{path.name}"))

    def commit(self, ranks: tuple[int, ...], metadata: tuple[tuple[str, bytes], ...], expected: list[str],
               digests=None, header: dict | None = None) -> None:
        """Move this job's staged files into `dest` and record them with the plan they belong to;
        with `digests` (`manifest.FileDigest`s of its files) and the manifest's `header` (without
        files), `finalize` writes the manifest of the whole output.

        Raises:
            DestinationExistsError: `dest` is a finished output already.
        """
        if metadata and (self.dest / metadata[-1][0]).exists():  # the file written last marks it finished
            raise DestinationExistsError(f"{self.dest} is already a finished checkpoint")
        plan = plan_digest(metadata)
        plan_file = self.fragments / f"plan-{plan[:16]}.json"
        if not plan_file.exists():
            for name, data in metadata:
                self._publish(self.fragments / f"plan-{plan[:16]}{name}", data)
            self._publish(plan_file, json.dumps({"plan": plan, "files": expected,
                                                 "metadata": [name for name, _ in metadata],
                                                 "manifest": header}).encode())
        names = sorted(os.listdir(self.path))
        for name in names:
            os.replace(self.path / name, self.dest / name)
        os.rmdir(self.path)
        record = {"plan": plan, "ranks": list(ranks), "files": names,
                  "identity": {name: file_identity(self.dest / name) for name in names}}
        if digests is not None:
            record["digests"] = [[f.name, f.size, f.digest] for f in digests]
            self._publish(self.fragments / f"lines-{min(ranks)}-{max(ranks)}-{plan[:16]}.jsonl",
                          b"".join(manifest.file_line(f) for f in digests))
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
        PathNotFoundError: `dest` does not exist (checked before its lock is taken beside it).
        NotACheckpointError: `dest` holds no fan-out fragments.
        CorruptMetadataError: the fragments come from different plans.
        MissingFileError: some files are missing (the message names one).
        CorruptDataError: a file was changed (truncated, replaced) after its job wrote it.
        DestinationLockedError: a job is still writing into `dest`.
    """
    dest = Path(dest)
    if not dest.exists():
        raise PathNotFoundError(f"{dest}: no such directory (the fanned-out output to finalize)",
                                hint="give the directory the `hpckpt reshard ... --rank R` runs wrote into")
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
        return json.loads(_read(path))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptMetadataError(f"{path}: not a fan-out record hpckpt wrote ({exc})",
                                   hint="rerun the fan-out jobs (`hpckpt reshard ... --rank R`)") from None


def gather(dest) -> tuple[dict, list[dict], str]:
    """The plan and the jobs' records of a fan-out at `dest`, once every planned file is there
    as its job wrote it: `(plan, records, plan digest)` (the errors are `finalize`'s)."""
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
    return plan, records, digest


def _finalize(dest: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    plan, records, digest = gather(dest)
    fragments = dest / FRAGMENT_DIR
    staged = []  # written (and fsynced) under temporary names first: that can take a while
    try:
        staged += _fan_out_manifest(dest, plan, records, digest)
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
    return tuple(plan["files"]), tuple(target.name for _, target in staged)


def _fan_out_manifest(dest: Path, plan: dict, records: list[dict], key: str) -> list[tuple[Path, Path]]:
    """Write the manifest of a fanned-out output (under a temporary name, renamed with the
    metadata) from the jobs' digests; returns `(temporary, final)` path pairs: none when the jobs
    hashed nothing."""
    data = manifest_of(dest, plan, records, key)
    if data is None:
        return []
    tmp = dest / f"{TMP_MARK}{os.getpid()}-{manifest.NAME}"
    tmp.unlink(missing_ok=True)
    write_file(tmp, data)
    return [(tmp, dest / manifest.NAME)]


def manifest_of(dest, plan: dict, records: list[dict], key: str) -> bytes | None:
    """The manifest of a fanned-out output, from the jobs' digests (None when they hashed nothing)."""
    header = plan.get("manifest")
    if not isinstance(header, dict) or not all("digests" in r for r in records):
        return None
    files: dict[str, list] = {}
    for record in records:
        for name, size, hexdigest in record["digests"]:
            files[name] = [size, hexdigest]
    lines: dict[str, bytes] = {}
    for path in sorted((dest / FRAGMENT_DIR).glob(f"lines-*-{key[:16]}.jsonl")):
        for line in _read(path).splitlines(keepends=True):
            lines[json.loads(line)["file"]] = line  # a rank rerun wrote its file (and line) again
    doc = dict(header, command=manifest.command_line())
    doc["files"] = {}
    for name in sorted(files):
        entry = json.loads(lines[name])
        doc["files"][name] = {"bytes": files[name][0], "digest": files[name][1], "boxes": len(entry["boxes"])}
    return manifest.encode(doc, ()) + b"".join(lines[name] for name in sorted(files))


def _check_unchanged(dest: Path, records: list[dict]) -> None:
    """Every recorded file is still the one a job wrote (size and mtime as recorded by one of
    the jobs that wrote it: a rank rerun writes its file again)."""
    recorded: dict[str, list[list[int]]] = {}
    for record in records:
        for name, identity in record.get("identity", {}).items():
            recorded.setdefault(name, []).append(identity)
    for name, identities in sorted(recorded.items()):
        now = file_identity(dest / name)
        if now not in identities:
            size = identities[-1][0]
            change = f"{now[0]} bytes, written with {size}" if now[0] != size else "modified after it was written"
            raise CorruptDataError(f"{dest / name}: changed since its fan-out job wrote it ({change})",
                                   hint="rerun the target ranks that write it with --rank, then finalize again")
