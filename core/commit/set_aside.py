"""Replacing a destination that several processes fill in place (`hpckpt run reshard`'s workers
write their shares straight into it as fan-out fragments): the old output is set aside first and
removed only once the new one is finalized, or put back if the run fails.

The aside name is the one `Staging` gives an output it moves aside (`.NAME.hpckpt-tmp-old-PID`),
so what a killed run leaves is explained by `leftover` and put back by the next run. A prefix
in an object store has no rename: `--force` removes the old output first (`_prepare_prefix`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpckpt.core.commit.destination import refuse_existing, refuse_staging_name
from hpckpt.core.commit.leftovers import TMP_MARK
from hpckpt.core.commit.lock import DestinationLock, ReplaceLock
from hpckpt.core.commit.object_staging import completion_marks_first
from hpckpt.core.errors import DestinationExistsError
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import as_path


class SetAside:
    """`prepare()` before any share is written; then `finished()` or `undo()`, by one process."""

    def __init__(self, dest: Path, force: bool):
        self.dest, self.force = as_path(dest), force
        self.aside: Path | None = None  # the old destination, while it is being replaced
        self.created = False  # this run makes the destination: a failed run removes it

    def prepare(self) -> None:
        """Refuse a destination that may not be replaced; set an existing one aside (no run may be
        reading it)."""
        if is_object(self.dest):
            self._prepare_prefix()
            return
        refuse_staging_name(self.dest)
        if not os.path.lexists(self.dest):
            self.created = True
            return
        refuse_existing(self.dest, self.force)
        with DestinationLock(self.dest):
            replacing = ReplaceLock(self.dest)
            try:
                aside = self.dest.parent / f".{self.dest.name}{TMP_MARK}old-{os.getpid()}"
                os.rename(self.dest, aside)
                self.aside, self.created = aside, True
            finally:
                replacing.release()

    def _prepare_prefix(self) -> None:
        """In an object store there is no rename to set an output aside with: with `--force`, a
        checkpoint there is removed first, completion marks first (from then on the prefix holds
        no checkpoint, and a failed run cannot put it back); anything else is refused."""
        store = self.dest.store
        store.refresh(self.dest.key)
        if self.dest.is_dir():
            if not self.force:
                raise DestinationExistsError(f"{self.dest} exists", hint="--force replaces it")
            marks, rest = completion_marks_first(self.dest, sorted(store.walk(self.dest.key)))
            for names in (marks, rest):
                store.delete([(self.dest / name).key for name in names])
        elif self.dest.is_file():
            raise DestinationExistsError(f"{self.dest} exists and is an object, not a prefix",
                                         hint="write to a new prefix")
        self.created = True

    def finished(self) -> None:
        """The new output is complete: the old one goes."""
        if self.aside is not None:
            shutil.rmtree(self.aside)
            self.aside = None

    def undo(self) -> None:
        """After a failure: nothing of this run left, the old output back."""
        if is_object(self.dest):
            store = self.dest.store
            if self.created:  # a new prefix: everything under it is this run's
                store.delete([(self.dest / name).key for name in store.walk(self.dest.key)])
            return
        if self.created and os.path.lexists(self.dest):
            with DestinationLock(self.dest):  # every share has let its lock go
                shutil.rmtree(self.dest)
        if self.aside is not None:
            os.rename(self.aside, self.dest)
            self.aside = None
