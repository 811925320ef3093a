"""Committing an output to an object store, where there is no rename: the engine fills a local
spool directory as it fills a staging directory, then the objects go up in an order that never
lets a reader take an incomplete checkpoint for a complete one.

1. `ObjectStaging(dest, ...)` refuses a destination that overlaps the source, takes the writer's
   mark `WRITING` with a conditional create (`If-None-Match: *`): a second writer to the same
   prefix finds it and stops (`DestinationLockedError`, exit 17). A mark left by a killed run on
   this host (its pid is gone) is taken over, and the objects it names removed; one from another
   host is taken over only with `--force` (hpckpt cannot tell whether that run is alive).
   An existing output is refused unless `--force`, and then only a checkpoint hpckpt recognises;
   it is removed completion marks first (`.metadata`, an index), so that from then on it is no
   checkpoint at all rather than a mix of old and new.
2. The engine writes the spool (`path`); `write_metadata` adds the metadata files, marking which
   ones say "complete" (`marks`).
3. `commit()` uploads the data files (multipart, several files and parts at once), then the
   sidecars and the manifest, then the completion marks, a directory's with a conditional create;
   then removes the writer's mark. Until the last mark lands, `inspect` and `verify` report the
   prefix as an unfinished write (`leftover`).
4. Leaving without `commit()` removes what was uploaded (and the mark); a kill leaves the mark
   and the next write to the prefix removes what it names.

With a store that ignores conditional writes, two writers are still told apart by reading the
mark back (the later writer's content replaces the earlier's), but not in every interleaving:
docs/object-storage.md.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

from hpckpt.core.commit import formats
from hpckpt.core.commit.destination import refuse_unsafe
from hpckpt.core.commit.durable import check_space, spool_root
from hpckpt.core.commit.leftovers import WRITING, describe_mark, mark_is_alive, read_mark, writing_mark
from hpckpt.core.commit.object_uploads import DEFAULT_MEMORY, UPLOAD_FILES, Uploads
from hpckpt.core.errors import (
    DestinationExistsError,
    DestinationLockedError,
    HpckptError,
    UnsafeDestinationError,
)


def recognised_checkpoint(dest):
    """The index of the checkpoint at `dest`, which `--force` may replace.

    Raises:
        UnsafeDestinationError: what is there is no checkpoint hpckpt recognises.
    """
    try:
        return formats.known().open_index(dest)
    except HpckptError as exc:
        raise UnsafeDestinationError(f"{dest} holds objects hpckpt does not recognise as a checkpoint "
                                     f"({exc.message}); --force replaces only a checkpoint",
                                     hint="remove them, or write somewhere else") from None


def completion_marks_first(dest, names: list[str]) -> tuple[list[str], list[str]]:
    """The objects of the checkpoint at `dest` (`names`, relative) that `--force` removes, as
    (its completion marks, the rest): removed in that order, it is no checkpoint from the first
    deletion on, never a mix of old and new."""
    marks = [n for n in names if n in set(recognised_checkpoint(dest).metadata_files)]
    return marks, [n for n in names if n not in marks]


class ObjectStaging:
    """`core.commit.staging.Staging` for a destination in an object store: same protocol."""

    def __init__(self, dest, *, source=None, force: bool = False, file_output: bool = False, needed: int = 0,
                 memory: int = DEFAULT_MEMORY):
        self.dest, self.force, self.file_output = dest, force, file_output
        self.store = dest.store
        self.sync = False  # the spool is scratch: durability is the store's
        self._marks: list[str] = []
        self._others: list[str] = []
        self._announced: list[str] = []
        self._announcing = threading.Lock()
        self._done = False
        self._held = False
        self.mark = writing_mark(dest, file_output)
        self.token = uuid.uuid4().hex
        refuse_unsafe(dest, source)
        replaced = self._replaced()  # read before the mark is ours: the mark would hide the output
        self._take_mark()
        try:
            self._clear_existing(replaced)
            check_space(dest, needed)  # (in the spool)
            self.path = Path(tempfile.mkdtemp(prefix="hpckpt-spool-", dir=spool_root()))
        except BaseException:
            self._release_mark()
            raise
        # (a single-file output is its own completion mark: streamed, but completed by `commit`)
        self.uploads = Uploads(self.store, self.path, self._key, memory=memory,
                               files=1 if file_output else UPLOAD_FILES, announce=self._announce,
                               held=(dest.name,) if file_output else ())

    # -- the writer's mark ----------------------------------------------------------------------

    def _record(self, names: list[str] | None = None) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                           "started": time.time(), "names": names or []}).encode()

    def _take_mark(self) -> None:
        if self.store.create(self.mark.key, self._record()):
            self._confirm_mark()
            return
        record = read_mark(self.mark) or {}
        if record.get("token") == self.token:  # ours: the create was retried after the store took it
            self._confirm_mark()
            return
        alive = mark_is_alive(record)
        if alive or (alive is None and not self.force):
            raise DestinationLockedError(
                f"{self.dest}: another hpckpt run is writing it ({describe_mark(record)})",
                hint="wait for it to finish" if alive else "if that run is dead, rerun with --force to take it over")
        self._remove_left(record)  # a killed run's: its objects, then its mark
        if not self.store.create(self.mark.key, self._record()):
            raise DestinationLockedError(f"{self.dest}: another hpckpt run took it over just now")
        self._confirm_mark()

    def _confirm_mark(self) -> None:
        """Read the mark back: on a store that ignores conditional writes, the later of two
        writers replaced the earlier's record, and the earlier stops here (or before its marks)."""
        self._held = True
        record = read_mark(self.mark)
        for pause in (0.05, 0.2, 0.5):  # a store that lets a read see a write half-done (s3rver does)
            if record:
                break
            time.sleep(pause)
            record = read_mark(self.mark)
        if not record or record.get("token") != self.token:
            self._held = False
            raise DestinationLockedError(f"{self.dest}: another hpckpt run is writing it "
                                         f"({describe_mark(record or {})})")

    def _remove_left(self, record: dict) -> None:
        self._delete([n for n in record.get("names", []) if isinstance(n, str)])
        self.store.delete([self.mark.key])

    def _release_mark(self) -> None:
        if self._held:
            record = read_mark(self.mark)
            if record and record.get("token") == self.token:
                self.store.delete([self.mark.key])
            self._held = False

    # -- what is there already --------------------------------------------------------------------

    def _key(self, name: str) -> str | None:
        """The object key of an output file `name`, None for a name that would leave the output."""
        if not name or name.startswith("/") or ".." in name.split("/"):
            return None
        return (self.dest.parent / name).key if self.file_output else (self.dest / name).key

    def _existing(self) -> list[str]:
        if self.file_output:
            return [self.dest.name] if self.dest.is_file() else []
        return sorted(n for n in self.store.walk(self.dest.key) if n != WRITING)

    def _replaced(self) -> tuple[list[str], list[str]] | None:
        """The completion marks and other objects of a finished output at `dest` that `--force`
        replaces (None when there is none); refused unless `--force`, and then unless hpckpt
        recognises it as a checkpoint. A prefix under a writer's mark is left to `_take_mark`."""
        existing = self._existing()
        if not existing or read_mark(self.mark) is not None:
            return None
        if not self.force:
            raise DestinationExistsError(f"{self.dest} exists", hint="--force replaces it")
        if self.file_output:
            recognised_checkpoint(self.dest)
            return [], existing + [s for s in formats.known().sidecars_of(self.dest.name)
                                   if (self.dest.parent / s).is_file()]
        return completion_marks_first(self.dest, existing)

    def _clear_existing(self, replaced: tuple[list[str], list[str]] | None) -> None:
        """Remove the output being replaced, completion marks first: from then on it is no
        checkpoint rather than a mix of old and new. Objects a killed write left beyond what its
        mark named go too, with `--force` only."""
        if replaced is not None:
            marks, rest = replaced
            self._delete(marks)
            self._delete(rest)
        left = self._existing()
        if left and not self.force:
            raise DestinationExistsError(f"{self.dest} holds {len(left)} object(s) an unfinished write left "
                                         f"(e.g. {left[0]!r})", hint="--force removes them and writes the output")
        self._delete(left)

    def _delete(self, names: list[str]) -> None:
        keys = [k for k in (self._key(n) for n in names) if k is not None]
        for at in range(0, len(keys), 1000):
            self.store.delete(keys[at:at + 1000])

    # -- the protocol of `Staging` ----------------------------------------------------------------

    def filled(self, name: str, upto: int) -> None:
        """The engine made bytes `[0, upto)` of data file `name` final: it goes up as it grows
        (`core.commit.object_uploads`) while the engine fills the rest."""
        self.uploads.filled(name, upto)

    def _announce(self, name: str) -> None:
        with self._announcing:  # the mark names it before it goes up: a kill leaves nothing unnamed
            self._announced.append(name)
            self.store.put(self.mark.key, self._record(list(self._announced)))

    def write_metadata(self, files, *, marks: bool = True) -> None:
        for name, data in files:
            (self.path / name).write_bytes(data)
            (self._marks if marks else self._others).append(name)

    def commit(self) -> None:
        staged = sorted(str(p.relative_to(self.path)) for p in self.path.rglob("*") if p.is_file())
        last = [n for n in self._marks if n in staged]
        if self.file_output:
            last = [self.dest.name]
        middle = [n for n in self._others if n in staged and n not in last]
        first = [n for n in staged if n not in last and n not in middle]
        self.uploads.finish()  # (no thread rewrites the mark from here on)
        self.store.put(self.mark.key, self._record(staged))  # a killed upload's objects can be found
        self._confirm_mark()
        self.uploads.upload_rest(first)
        for name in middle:
            self.uploads.upload(name)
        self._confirm_mark()  # still ours, right before the output becomes complete
        for name in last:
            if self.file_output:
                if not self.uploads.complete(name):  # (streamed: completed now)
                    self.uploads.upload(name)
            elif self.store.create(self._key(name), (self.path / name).read_bytes()):
                self.uploads.uploaded.append(name)
            else:
                raise DestinationLockedError(f"{self.dest}: another run completed it meanwhile")
        self._done = True
        self._release_mark()

    def __enter__(self) -> "ObjectStaging":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def close(self) -> None:
        self.uploads.cancel()  # no upload may land after the clean-up below
        try:
            if not self._done and self._held:
                try:
                    self._delete(list(self.uploads.uploaded))
                finally:
                    self._release_mark()
        finally:
            shutil.rmtree(self.path, ignore_errors=True)
