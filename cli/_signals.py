"""Ctrl-C, SIGTERM and SIGHUP stop a run within a second: one error line, exit 128 + signal.

Installed first thing when the `hpckpt` process starts (`install_early`, before the imports of
`cli.app`): until a command runs nothing has been written, so a signal prints its line and exits
at once, also in the middle of an import. While a command runs (`raising`) a signal raises
`InterruptedRunError` in the main thread instead, so that the `with` blocks owning staging data
remove it (`core.commit.staging.Staging`; the engine's workers stop first); the signals after it are ignored while
that cleanup runs, and one arriving while an output is renamed into place waits for the renames
(`core.commit.interrupts`). A signal the parent ignores (`nohup`, a background job) stays ignored.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from hpckpt.core.commit import interrupts  # both small: nothing heavier is imported before the handlers
from hpckpt.core.errors import InterruptedRunError

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_state = {"raised": False}


def _line(signum: int) -> bytes:
    return f"error: interrupted ({signal.Signals(signum).name})\n".encode()


def _exit_now(signum: int, frame: object) -> None:
    """Before a command runs: nothing to clean up."""
    os.write(2, _line(signum))
    os._exit(128 + signum)


def _raise(signum: int, frame: object) -> None:
    """While a command runs: unwind the main thread (once), or wait for the renames in progress."""
    if _state["raised"]:
        return
    _state["raised"] = True
    if interrupts.deferring():
        interrupts.defer(signum)
        return
    raise InterruptedRunError(signum)


def _install(handler) -> dict:
    previous = {}
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    return previous


def _started_as_command() -> bool:
    """The `hpckpt` console script, or `python -m hpckpt`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script == "hpckpt" or getattr(spec, "name", "") == "hpckpt.__main__"


def install_early() -> None:
    """In the `hpckpt` process (not in a program that imports the CLI): exit on a signal."""
    if _started_as_command() and threading.current_thread() is threading.main_thread():
        _install(_exit_now)


@contextmanager
def raising() -> Iterator[None]:
    """Signals raise `InterruptedRunError` in the main thread while the block runs; the previous
    handlers are back afterwards (a program that runs the CLI in-process keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state["raised"] = False
    previous = _install(_raise)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
