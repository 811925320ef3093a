"""Signals that stop a run, held back while an output is renamed into place.

The command line turns SIGINT, SIGTERM and SIGHUP into `InterruptedRunError` in the main thread
(`cli._signals`). Raised between two renames of a commit, it would leave half an output (a
sidecar without its file, the old output moved aside and the new one not yet in place); so the
renames run inside `critical()`, and a signal that arrives meanwhile is raised when it ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hpckpt.core.errors import InterruptedRunError

_state: dict = {"depth": 0, "pending": None}


def deferring() -> bool:
    """True inside `critical()`: the signal handler records the signal instead of raising."""
    return _state["depth"] > 0


def defer(signum: int) -> None:
    """Record a signal that arrived inside `critical()` (the first one counts)."""
    if _state["pending"] is None:
        _state["pending"] = signum


@contextmanager
def critical() -> Iterator[None]:
    """Run the block whole, then raise `InterruptedRunError` for a signal that came meanwhile."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
    if _state["depth"] == 0 and _state["pending"] is not None:
        pending, _state["pending"] = _state["pending"], None
        raise InterruptedRunError(pending)
