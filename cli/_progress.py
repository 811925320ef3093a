"""The progress display on stderr: a spinner line per phase, then the byte bar (rich, drawn only
on a terminal)."""

from __future__ import annotations

from hpckpt.cli._output import human_bytes, printable, progress_wanted, stderr_console


class _ByteTask:
    """Columns shown only on the byte bar, blank on a phase's spinner line."""

    def render(self, task):
        from rich.text import Text

        return Text("") if task.fields.get("phase") else super().render(task)  # type: ignore[misc]


def _columns():
    """Spinner, text, then bar, bytes and rate in binary units (rich's own rate is decimal)."""
    from rich.progress import (BarColumn, DownloadColumn, ProgressColumn, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rich.text import Text

    class Bar(_ByteTask, BarColumn):
        pass

    class Bytes(_ByteTask, DownloadColumn):
        pass

    class Rate(ProgressColumn):
        def render(self, task):
            speed = task.finished_speed or task.speed
            if task.fields.get("phase") or speed is None:
                return Text("")
            return Text(f"{human_bytes(int(speed))}/s", style="progress.data.speed")

    class Timing(ProgressColumn):
        """A phase shows how long it has taken, the byte bar how long it has left."""

        def __init__(self):
            super().__init__()
            self.elapsed, self.remaining = TimeElapsedColumn(), TimeRemainingColumn()

        def render(self, task):
            return (self.elapsed if task.fields.get("phase") else self.remaining).render(task)

    return (SpinnerColumn(finished_text="[green]done[/green]"), TextColumn("[progress.description]{task.description}"),
            Bar(), Bytes(binary_units=True), Rate(), Timing())


class TerminalProgress:
    """Progress on stderr: a spinner line per phase before the copy ("reading metadata of SRC",
    "planning"), each with its elapsed time, then the byte bar. Only on a terminal, and never
    with --quiet or --no-progress (--json keeps it: the document goes to stdout).

    Use as a context manager around the work; call `phase(text)`, then `start(total)` and
    `advance(n)` (the `core.io.write.Progress` protocol the writers report to).
    """

    def __init__(self, description: str, enabled: bool = True):
        self.description = description
        self.enabled = enabled and progress_wanted()
        self._progress = None
        self._task = None
        self._phase = None

    def __enter__(self) -> "TerminalProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _started(self):
        if self._progress is None and self.enabled:
            from rich.progress import Progress

            self._progress = Progress(*_columns(), console=stderr_console(), transient=True)
            self._progress.start()
        return self._progress

    def _end_phase(self) -> None:
        if self._phase is not None:
            task, text = self._phase
            self._progress.update(task, total=1, completed=1, description=text)
            self._phase = None

    def phase(self, text: str) -> None:
        """A step whose length is unknown (metadata, planning): a spinner until the next step."""
        if self._started() is None:
            return
        self._end_phase()
        from rich.markup import escape

        text = escape(printable(text))  # the column renders markup: `[red]` in a path stays text
        self._phase = self._progress.add_task(text + "…", total=None, phase=True), text

    def start(self, total: int) -> None:
        if self._started() is None:
            return
        self._end_phase()
        self._task = self._progress.add_task(self.description, total=total)

    def advance(self, n: int) -> None:
        if self._task is not None:
            self._progress.advance(self._task, n)

    def update(self, completed: int, total: int, description: str) -> None:
        """Set the byte bar to a count kept elsewhere (a job's ranks, summed), starting it first."""
        if self._task is None:
            self.start(total)
        if self._task is not None:
            self._progress.update(self._task, total=total, completed=completed, description=description)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
