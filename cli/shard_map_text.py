"""`inspect --map NAME`: one tensor's stored boxes drawn in the terminal, for a cluster's login
node where no browser runs. The tensor's two most-split dims become a grid of at most 24 x 40
cells (2 characters wide); each cell shows the rank whose box covers its centre, as a colour (the
legend below) and, where several ranks hold that box, their count; `.` marks a cell no box
covers, `##` one that different boxes cover."""

from __future__ import annotations

import colorsys
import fnmatch

import numpy as np

from hpckpt.api.inspect import chunk_ranks

MAX_ROWS, MAX_COLUMNS, MAX_TENSORS, MAX_LEGEND = 24, 40, 8, 32  # a cell is 2 characters wide
GAP, OVERLAP = -2, -3


def colour(rank: int) -> str:
    """The page's colour of a rank (`cli/html/shard_map.js`), as rich's `#rrggbb`."""
    if rank < 0:
        return "#9aa3ad"
    r, g, b = colorsys.hls_to_rgb(((210 + rank * 137.508) % 360) / 360, (48 + (rank % 3) * 8) / 100, 0.62)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def _shown_dims(shape: tuple[int, ...], offsets: np.ndarray) -> tuple[int | None, int | None]:
    """Rows and columns: the two dims split into the most pieces, in tensor order."""
    if len(shape) <= 1:
        return (None, 0) if shape else (None, None)
    pieces = [len(np.unique(offsets[:, d])) if len(offsets) else 1 for d in range(len(shape))]
    two = sorted(sorted(range(len(shape)), key=lambda d: (-pieces[d], d))[:2])
    return two[0], two[1]


def grid(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, ranks: np.ndarray):
    """`(owner, holders, dims)`: per cell the rank covering its centre (GAP, OVERLAP), how many
    ranks hold that box, and the `(row dim, column dim)` drawn."""
    rows_dim, cols_dim = _shown_dims(shape, offsets)
    n_rows = 1 if rows_dim is None else max(1, min(MAX_ROWS, shape[rows_dim]))
    n_cols = 1 if cols_dim is None else max(1, min(MAX_COLUMNS, shape[cols_dim]))
    owner = np.full((n_rows, n_cols), GAP, np.int64)
    holders = np.zeros((n_rows, n_cols), np.int64)
    covered_by = np.full((n_rows, n_cols), -1, np.int64)  # which distinct box covers the cell

    def cells(dim, count, lo, hi):  # the cells whose centre lies in [lo, hi) of that dim
        if dim is None:
            return 0, 1
        extent = shape[dim]
        centres = (np.arange(count) + 0.5) * extent / count
        return int(np.searchsorted(centres, lo, "left")), int(np.searchsorted(centres, hi, "left"))

    keys: dict[tuple, int] = {}
    for i in range(len(ranks)):
        key = (tuple(offsets[i].tolist()), tuple(sizes[i].tolist()))
        if 0 in key[1] and 0 not in shape:
            continue
        box = keys.setdefault(key, len(keys))
        r0, r1 = cells(rows_dim, n_rows, *(_span(key, rows_dim)))
        c0, c1 = cells(cols_dim, n_cols, *(_span(key, cols_dim)))
        block = covered_by[r0:r1, c0:c1]
        other = (block >= 0) & (block != box)
        owner[r0:r1, c0:c1] = np.where(other, OVERLAP, np.where(block == box, owner[r0:r1, c0:c1], int(ranks[i])))
        holders[r0:r1, c0:c1] += np.where(other, 0, 1)
        covered_by[r0:r1, c0:c1] = np.where(other, block, box)
    return owner, holders, (rows_dim, cols_dim)


def _span(key: tuple, dim: int | None) -> tuple[int, int]:
    if dim is None:
        return 0, 1
    offsets, sizes = key
    return offsets[dim], offsets[dim] + sizes[dim]


def draw(index, patterns: list[str]) -> None:
    """Print the map of every tensor matching `patterns` (the first MAX_TENSORS)."""
    from rich.text import Text

    from hpckpt.cli._output import printable, stdout_console

    console = stdout_console()
    names = [n for n in index.tensors if any(fnmatch.fnmatchcase(n, p) or n == p for p in patterns)]
    if not names:
        console.print(Text(f"no tensor matches {', '.join(patterns)}"))
        return
    for name in names[:MAX_TENSORS]:
        entry = index.tensors[name]
        offsets, sizes = entry.chunk_arrays()
        ranks = chunk_ranks(entry)
        owner, holders, (rows_dim, cols_dim) = grid(tuple(entry.shape), offsets, sizes, ranks)
        how = ("a 0-d tensor" if cols_dim is None else f"dim {cols_dim} across" if rows_dim is None
               else f"dim {rows_dim} down, dim {cols_dim} across")
        console.print(Text(f"\n{printable(name)}  {entry.dtype.name} {list(entry.shape)}  ({how}; "
                           f"{owner.shape[0]} x {owner.shape[1]} cells)"))
        for row_owner, row_holders in zip(owner.tolist(), holders.tolist()):
            line = Text()
            for rank, count in zip(row_owner, row_holders):
                if rank == GAP:
                    line.append(" .", style="bold red")
                elif rank == OVERLAP:
                    line.append("##", style="bold red on white")
                else:
                    line.append(f"{count:>2}" if count > 1 else "  ", style=f"black on {colour(rank)}")
            console.print(line)
        present = sorted({int(r) for r in ranks.tolist()})
        legend = Text()
        for rank in present[:MAX_LEGEND]:
            legend.append("  ", style=f"on {colour(rank)}")
            legend.append(f" {'no rank' if rank < 0 else f'rank {rank}'}  ")
        if len(present) > MAX_LEGEND:
            legend.append(f"and {len(present) - MAX_LEGEND} more ranks")
        console.print(legend)
        if (owner == GAP).any() or (owner == OVERLAP).any():
            console.print(Text(". no chunk covers it   # different chunks overlap   (digits: ranks holding one box)",
                               style="red"))
    if len(names) > MAX_TENSORS:
        console.print(Text(f"... and {len(names) - MAX_TENSORS} more tensors match"))
