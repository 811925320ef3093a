"""Fan-out into an object store: the jobs of `hpckpt reshard --rank` (or `hpckpt run reshard`'s
workers) each upload their own files straight to their final keys and record them under
`PREFIX/.hpckpt-fanout/`, the records the local fan-out writes (`fan_out.py`), with each
object's entity tag in place of an mtime. `finalize_objects` checks them with the local
fan-out's checks (`fan_out.gather`: every planned file there, as its job wrote it), uploads the
manifest, then `.metadata` last with a conditional create, and removes the records.

From a job's first step the prefix holds `.hpckpt-fanout/job-ID.json` (its host and pid), so
`inspect` reports the prefix as a fan-out in progress and other jobs of it join instead of
refusing a non-empty prefix; a job that fails removes what it uploaded and its record; a killed
one leaves its objects, which a rerun of its ranks replaces, and its record, which `finalize`
removes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import uuid
from pathlib import Path

from hpckpt.core.commit import manifest
from hpckpt.core.commit.destination import refuse_unsafe
from hpckpt.core.commit.durable import check_space, spool_root
from hpckpt.core.commit.fan_out import file_identity, gather, manifest_of, plan_digest
from hpckpt.core.commit.leftovers import FRAGMENT_DIR, WRITING
from hpckpt.core.commit.object_uploads import Uploads
from hpckpt.core.errors import DestinationExistsError


def refuse_not_fan_out(dest) -> None:
    """A fan-out writes into a new prefix, or one that jobs of the same fan-out began.

    Raises:
        DestinationExistsError: `dest` is a finished checkpoint, or holds other objects.
    """
    hint = ("fan-out jobs write into a new prefix, or one that jobs of the same reshard began: "
            "choose another destination, or remove it yourself")
    if dest.is_file():
        raise DestinationExistsError(f"{dest} exists and is an object, not a prefix", hint=hint)
    files, dirs = dest.store.listing(dest.key)
    if ".metadata" in files:
        raise DestinationExistsError(f"{dest} is already a finished checkpoint", hint=hint)
    if FRAGMENT_DIR in dirs:
        return
    if files or dirs:
        what = "a write in progress" if WRITING in files else f"{len(files) + len(dirs)} entries"
        raise DestinationExistsError(f"{dest} exists and is not a fan-out in progress (it holds {what} and no "
                                     f"{FRAGMENT_DIR}/)", hint=hint)


class ObjectFragment:
    """`fan_out.Fragment` for a prefix in a store: same protocol (`path` to fill, `commit`)."""

    def __init__(self, dest, *, source=None, needed: int = 0, memory: int | None = None):
        self.dest, self.store = dest, dest.store
        self.sync = False  # the spool is scratch: durability is the store's
        self.fragments = dest / FRAGMENT_DIR
        self._committed = False
        refuse_unsafe(dest, source)
        self.store.refresh(dest.key)  # other jobs write here: nothing cached is current
        refuse_not_fan_out(dest)
        self._job = self.fragments / f"job-{uuid.uuid4().hex}.json"
        self.store.put(self._job.key, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
        try:
            check_space(dest, needed)  # (in the spool)
            self.path = Path(tempfile.mkdtemp(prefix="hpckpt-spool-", dir=spool_root()))
        except BaseException:
            self.store.delete([self._job.key])
            raise
        self.uploads = Uploads(self.store, self.path, lambda name: (dest / name).key,
                               **({} if memory is None else {"memory": memory}))
        self.filled = self.uploads.filled  # files go up as the engine writes them
    def commit(self, ranks: tuple[int, ...], metadata: tuple[tuple[str, bytes], ...], expected: list[str],
               digests=None, header: dict | None = None) -> None:
        """Upload this job's files and record them with the plan they belong to (as `Fragment`)."""
        if metadata and (self.dest / metadata[-1][0]).is_file():
            raise DestinationExistsError(f"{self.dest} is already a finished checkpoint")
        plan = plan_digest(metadata)
        names = sorted(os.listdir(self.path))
        self.uploads.upload_rest(names)
        if not (self.fragments / f"plan-{plan[:16]}.json").is_file():
            for name, data in metadata:
                self.store.put((self.fragments / f"plan-{plan[:16]}{name}").key, data)
            self.store.put((self.fragments / f"plan-{plan[:16]}.json").key, json.dumps(
                {"plan": plan, "files": expected, "metadata": [name for name, _ in metadata],
                 "manifest": header}).encode())
        record = {"plan": plan, "ranks": list(ranks), "files": names,
                  "identity": {name: file_identity(self.dest / name) for name in names}}
        tag = f"{min(ranks)}-{max(ranks)}-{plan[:16]}"
        if digests is not None:
            record["digests"] = [[f.name, f.size, f.digest] for f in digests]
            self.store.put((self.fragments / f"lines-{tag}.jsonl").key,
                           b"".join(manifest.file_line(f) for f in digests))
        self.store.put((self.fragments / f"ranks-{tag}.json").key, json.dumps(record, sort_keys=True).encode())
        self._committed = True

    def __enter__(self) -> "ObjectFragment":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.uploads.cancel()  # (nothing lands after the clean-up below)
        try:
            keys = [self._job.key]
            if not self._committed:
                keys += [(self.dest / name).key for name in self.uploads.uploaded]
            self.store.delete(keys)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)


def finalize_objects(dest) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`fan_out.finalize` for a prefix in a store: the checks of `gather`, then the manifest,
    then the metadata files, the last (the completion mark) with a conditional create; then the
    records go.

    Raises:
        DestinationExistsError: another run finalized it meanwhile.
    """
    store = dest.store
    store.refresh(dest.key)
    plan, records, digest = gather(dest)
    written = []
    data = manifest_of(dest, plan, records, digest)
    if data is not None:
        store.put((dest / manifest.NAME).key, data)
        written.append(manifest.NAME)
    names = list(plan["metadata"])
    for i, name in enumerate(names):
        content = store.read_all((dest / FRAGMENT_DIR / f"plan-{digest[:16]}{name}").key)
        if i < len(names) - 1:
            store.put((dest / name).key, content)
        elif not store.create((dest / name).key, content):
            raise DestinationExistsError(f"{dest}: another run finalized it meanwhile")
        written.append(name)
    prefix = dest / FRAGMENT_DIR
    store.delete([(prefix / name).key for name in store.walk(prefix.key)])
    return tuple(plan["files"]), tuple(written)
