"""Where output goes: results on stdout (human tables or one JSON document), the rest on stderr."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(document: Any) -> None:
    """Print one JSON document on stdout (stable key order, as documented in the README)."""
    sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")


def warn(message: str) -> None:
    """One `warning:` line on stderr (also in --json mode: stdout holds only the document)."""
    sys.stderr.write(f"warning: {printable(message)}\n")
    sys.stderr.flush()


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
            warn(f"{what} ({reason}): {', '.join(names)}")
    for note in report.get("warnings") or []:  # e.g. a source file that holds pieces of larger tensors
        warn(f"source: {printable(note)}")


def stdout_console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def write_table(title: str, columns: list[tuple[str, str]], rows: list[tuple[str, ...]]) -> None:
    """Print an aligned text table on stdout.

    rich's Table measures every cell and takes about 0.6 ms a row, i.e. seconds for the 10,000
    tensors of a large checkpoint; plain padding prints that table in milliseconds. `columns`
    are (header, "left" | "right").
    """
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


class TerminalProgress:
    """rich progress (bytes, rate, ETA) on stderr, only when enabled and stderr is a terminal.

    Use as a context manager around the work; the command calls `start(total)` and `advance(n)`.
    """

    def __init__(self, description: str, enabled: bool = True):
        self.description = description
        self.enabled = enabled
        self._progress = None
        self._task = None

    def __enter__(self) -> "TerminalProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, total: int) -> None:
        if not self.enabled or not sys.stderr.isatty():
            return
        from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self._progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeRemainingColumn(), console=stderr_console(),
                                  transient=True)
        self._progress.start()
        self._task = self._progress.add_task(self.description, total=total)

    def advance(self, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()


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
