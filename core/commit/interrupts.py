"""Signals that stop a run, held back while an output is renamed into place.

The command line turns SIGINT, SIGTERM and SIGHUP into `InterruptedRunError` in the main thread
(`cli._signals`). Raised between two renames of a commit, it would leave half an output (a
sidecar without its file, the old output moved aside and the new one not yet in place); so the
renames run inside `critical()`, and a signal that arrives meanwhile waits for them: once they are
done the output is complete, so the run finishes (exit 0) with a warning that the signal came
too late to stop it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_state: dict = {"depth": 0, "pending": None}


def deferring() -> bool:
    """True inside `critical()`: the signal handler records the signal instead of raising."""
    return _state["depth"] > 0


def defer(signum: int) -> None:
    """Record a signal that arrived inside `critical()` (the first one counts)."""
    if _state["pending"] is None:
        _state["pending"] = signum


@contextmanager
def critical(when: str = "while it was renamed into place") -> Iterator[None]:
    """Run the block whole. A signal that came meanwhile is acted on when it ends: the block
    completed (the output is in place) -> the run goes on to succeed, with one `warning:` line
    on stderr; the block failed -> its error stops the run (a signal before the block is raised
    by the handler at once, as anywhere else)."""
    _state["depth"] += 1
    try:
        yield
    except BaseException:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            _state["pending"] = None  # the block's own error stops the run
        raise
    _state["depth"] -= 1
    if _state["depth"] == 0 and _state["pending"] is not None:
        pending, _state["pending"] = _state["pending"], None
        sys.stderr.write(f"warning: {_name(pending)} came after the output was complete ({when}); nothing was "
                         "undone\n")
        sys.stderr.flush()


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
