"""Replacing a destination that several processes fill in place (`hpckpt run reshard`'s workers
write their shares straight into it as fan-out fragments): the old output is set aside first and
removed only once the new one is finalized, or put back if the run fails.

The aside name is the one `Staging` gives an output it moves aside (`.NAME.hpckpt-tmp-old-PID`),
so what a killed run leaves is explained by `leftover` and put back by the next run.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpckpt.core.commit.destination import refuse_existing, refuse_staging_name
from hpckpt.core.commit.leftovers import TMP_MARK
from hpckpt.core.commit.lock import DestinationLock, ReplaceLock


class SetAside:
    """`prepare()` before any share is written; then `finished()` or `undo()`, by one process."""

    def __init__(self, dest: Path, force: bool):
        self.dest, self.force = Path(dest), force
        self.aside: Path | None = None  # the old destination, while it is being replaced
        self.created = False  # this run makes the destination: a failed run removes it

    def prepare(self) -> None:
        """Refuse a destination that may not be replaced; set an existing one aside (no run may be
        reading it)."""
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

    def finished(self) -> None:
        """The new output is complete: the old one goes."""
        if self.aside is not None:
            shutil.rmtree(self.aside)
            self.aside = None

    def undo(self) -> None:
        """After a failure: nothing of this run left, the old output back."""
        if self.created and os.path.lexists(self.dest):
            with DestinationLock(self.dest):  # every share has let its lock go
                shutil.rmtree(self.dest)
        if self.aside is not None:
            os.rename(self.aside, self.dest)
            self.aside = None
