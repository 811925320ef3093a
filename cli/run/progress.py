"""A job's progress on the terminal: the bytes of every rank summed, rank 0's phase."""

from __future__ import annotations

from hpckpt.cli._output import json_mode
from hpckpt.cli._progress import TerminalProgress


class JobProgress:
    """Shown while the launcher runs; `show` is called with the ranks' files at each poll."""

    def __init__(self, description: str):
        self._terminal = TerminalProgress(description, enabled=not json_mode())  # a job's --json is for scripts
        self._phase = ""

    def __enter__(self) -> "JobProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self._terminal.stop()

    def show(self, run) -> None:
        terminal = self._terminal
        if not terminal.enabled:
            return
        done, total = run.progress()
        phase = run.phase(0)
        if total == 0:
            if phase and phase != self._phase:
                terminal.phase(f"rank 0: {phase}")
            self._phase = phase
            return
        description = f"{terminal.description}: {phase}" if phase else terminal.description
        terminal.update(done, total, description)
