"""Where output goes: results on stdout (human tables or one JSON document), the rest on stderr.

One state for the whole run, set by the output options wherever they are given (before the
command or after it): `--json`, `--quiet`, `--no-progress`, `--debug`.
"""

from __future__ import annotations

import sys
from typing import Any

from hpckpt.core.sizes import human_bytes  # noqa: F401 (the commands format sizes through _output)

_state: dict[str, Any] = {}


def reset(command: str | None = None, **flags: bool) -> None:
    """Start a run: every flag off but those given (the options before the command)."""
    _state.clear()
    _state.update(json=False, quiet=False, no_progress=False, command=command, warnings=[], emitted=False)
    configure(**flags)


def configure(**flags: bool) -> None:
    """Turn on the flags given as true (an option after the command adds to those before it)."""
    from hpckpt.cli._errors import set_debug

    if not _state:
        reset()
    for key, value in flags.items():
        if key == "debug":
            if value:
                set_debug(True)
        elif value:
            _state[key] = True


def json_mode() -> bool:
    return bool(_state.get("json"))


def quiet() -> bool:
    return bool(_state.get("quiet"))


def command_name() -> str | None:
    return _state.get("command")


def progress_wanted() -> bool:
    """Progress is drawn on a terminal only, and not with --quiet or --no-progress."""
    return not quiet() and not _state.get("no_progress") and sys.stderr.isatty()


def emit_json(document: Any) -> None:
    """Print the run's one JSON document on stdout (key order as documented in the README); the
    warnings the command line itself printed join the document's."""
    if isinstance(document, dict) and "warnings" in document:
        document["warnings"] = [*document["warnings"],
                                *(w for w in _state.get("warnings", []) if w not in document["warnings"])]
    _state["emitted"] = True
    sys.stdout.write(pretty_json(document) + "\n")
    sys.stdout.flush()


def pretty_json(document: Any) -> str:
    """JSON with each top-level key on its own line and each element of a top-level list on its
    own line, every element in compact form: as easy to read as `indent=2` for what commands
    print, and encoded by json's C encoder (`indent` takes its pure-Python one: 0.8 s for the
    10,000 tensors of the inspect benchmark, against 0.03 s)."""
    import json  # here: 3 ms of every start-up otherwise

    def dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))

    if not isinstance(document, dict) or not document:
        return dumps(document)
    lines = []
    for key, value in document.items():
        if isinstance(value, list) and value:
            body = "[\n    " + ",\n    ".join(map(dumps, value)) + "\n  ]"
        else:
            body = dumps(value)
        lines.append(f"  {dumps(key)}: {body}")
    return "{\n" + ",\n".join(lines) + "\n}"


def emitted() -> bool:
    """True once this run printed its JSON document (an error then adds none)."""
    return bool(_state.get("emitted"))


def recorded_warnings() -> list[str]:
    return list(_state.get("warnings", []))


def warn(message: str) -> None:
    """One `warning:` line on stderr, whatever the flags (also in --json mode: stdout holds only
    the document, which lists it under `warnings`)."""
    _state.setdefault("warnings", []).append(message)
    sys.stderr.write(f"warning: {printable(message)}\n")
    sys.stderr.flush()


def result_line(text: str) -> None:
    """A writing command's one-line summary on stdout; --quiet leaves it out (the exit code says)."""
    if not quiet():
        print(printable(text))


def printable(name: str) -> str:
    """A name from a checkpoint, safe on a terminal: control and other unprintable characters
    escaped (`\\x1b`, `\\u202e`), so a hostile name cannot rewrite the line it is printed on."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def warn_skipped(report) -> None:
    """What was not written, or written in another kind, must not go unnoticed: a line per reason,
    naming every entry it applies to."""
    for key, what in (("skipped", "not written"), ("converted", "converted")):
        by_reason: dict[str, list[str]] = {}
        for entry in report.get(key) or []:
            by_reason.setdefault(entry["reason"], []).append(printable(entry["name"]))
        for reason, names in by_reason.items():
            _print_warning(f"{what} ({reason}): {', '.join(names)}")
    # the source reader's notes (a file holding pieces of larger tensors) and the layout's (a
    # placement that does not fit every tensor it applies to, which says so itself)
    for note in report.get("warnings") or []:
        _print_warning(note if note.startswith("layout: ") else f"source: {note}")


def _print_warning(message: str) -> None:
    """A warning the report lists already: printed, not recorded a second time."""
    sys.stderr.write(f"warning: {printable(message)}\n")
    sys.stderr.flush()


def stdout_console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def rate(report) -> str:
    """A write's copy rate in the CLI's one unit convention (binary: GiB/s, or MiB/s and KiB/s
    for the small outputs whose rate would print as 0.00 GiB/s)."""
    seconds = report["seconds"] or 0
    per_second = report["bytes_written"] / seconds if seconds > 0 else 0
    if per_second >= 2**30:
        return f"{per_second / 2**30:.2f} GiB/s"
    return f"{human_bytes(int(per_second))}/s"


def write_table(title: str, columns: list[tuple[str, str]], rows: list[tuple[str, ...]]) -> None:
    """Print an aligned text table on stdout.

    rich's Table measures every cell and takes about 0.6 ms a row, i.e. seconds for the 10,000
    tensors of a large checkpoint; plain padding prints that table in milliseconds. `columns`
    are (header, "left" | "right"). Every cell and the title are escaped (`printable`): they
    quote names from the checkpoint.
    """
    title = printable(title)
    rows = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [len(header) for header, _ in columns]
    for row in rows:
        for i, cell in enumerate(row):
            if len(cell) > widths[i]:
                widths[i] = len(cell)

    def line(cells: tuple[str, ...] | list[str]) -> str:
        parts = [
            cell.rjust(width) if align == "right" else cell.ljust(width)
            for cell, width, (_, align) in zip(cells, widths, columns)
        ]
        return "  ".join(parts).rstrip()

    bold, plain = ("\x1b[1m", "\x1b[0m") if sys.stdout.isatty() else ("", "")
    out = [f"\n{bold}{title}{plain}", bold + line([h for h, _ in columns]) + plain,
           "  ".join("─" * w for w in widths)]
    out.extend(line(row) for row in rows)
    sys.stdout.write("\n".join(out) + "\n")


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
    `advance(n)` (the `core.write.Progress` protocol the writers report to).
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

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def parse_ranks(values: list[str] | None) -> list[int] | None:
    """`--rank 3 --rank 8-15` -> [3, 8, 9, ..., 15]."""
    if not values:
        return None
    ranks: set[int] = set()
    for value in values:
        for part in value.split(","):
            first, _, last = part.partition("-")
            if not first.strip().isdigit() or (last and not last.strip().isdigit()):
                raise ValueError(f"--rank takes numbers or ranges like 0-7, not {part!r}")
            ranks.update(range(int(first), int(last or first) + 1))
    return sorted(ranks)
