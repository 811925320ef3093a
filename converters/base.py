"""The format adapter protocol: one small object per checkpoint format."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from hpckpt.core.index import CheckpointIndex


class FormatAdapter(Protocol):
    """Reads one checkpoint format into a `CheckpointIndex`.

    Call order: `converters.detect` calls `sniff` on every adapter (cheap: file names and a few
    header bytes, never a whole file); the first that answers True gets `read_index`, which parses
    and validates the metadata and returns an index whose locator reads the data lazily.
    """

    name: str  # stable identifier used in --json output and `--from`
    description: str

    def sniff(self, path: Path) -> bool:
        """Return True when `path` is a checkpoint of this format."""

    def read_index(self, path: Path) -> CheckpointIndex:
        """Parse `path`. Raises typed `HpckptError`s naming the file and entry at fault."""
