"""What the commit room must know of the formats, handed down by `hpckpt.converters`.

Which directory is a checkpoint, which files its metadata lists, which sidecar belongs to which
file: that is format knowledge, and it lives in the converters above core. core never imports
them; instead `hpckpt.converters` registers these functions here when it is imported (every path
that writes imports it to have a writer), and the destination checks and the leftover sweep ask
`known()` for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FormatKnowledge:
    open_index: Callable[[Path], Any]  # the checkpoint's index: its data and metadata files, its format
    detect: Callable[[Path], Any]  # raises HpckptError unless a format reads `path`
    read_sidecar: Callable[[Path], dict]  # a values sidecar's document; HpckptError if it is none
    sidecar_owner: Callable[[str], "str | None"]  # the file a sidecar name belongs to, or None
    sidecars_of: Callable[[str], "tuple[str, ...]"]  # the sidecars hpckpt may write beside a file
    is_own_file: Callable[[str, str], bool]  # (name, format): a file hpckpt keeps in such a checkpoint
    cache_dir: Callable[[], "Path | None"]  # the index cache's directory, when there is one


_known: FormatKnowledge | None = None


def register(knowledge: FormatKnowledge) -> None:
    global _known
    _known = knowledge


def known() -> FormatKnowledge:
    """The registered knowledge. Without it a destination check would answer wrongly, so asking
    before `hpckpt.converters` is imported is a programming error, not a guess."""
    if _known is None:
        raise RuntimeError("hpckpt.core.commit needs the formats: import hpckpt.converters first")
    return _known
