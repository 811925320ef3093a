"""Aligned text tables on stdout: the human form of every listing the commands print."""

from __future__ import annotations

import sys

from hpckpt.cli._output import printable


def write_table(title: str, columns: list[tuple[str, str]], rows: list[tuple[str, ...]]) -> None:
    """Print an aligned text table on stdout.

    rich's Table measures every cell: seconds for the 10,000 tensors of a large checkpoint
    (docs/design-figures.md); plain padding prints that table in milliseconds. `columns`
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
