"""Turning command-line options into the library's typed objects (layouts, formats, ranks; the
write settings and selections come from the option groups, `cli._option_groups`).

Only parsing happens here: a wrong combination is a usage error (exit 2) that names the options.
"""

from __future__ import annotations

import typer


def check_layout_options(world_size, mesh, placements, rules, layout_files, keep_layout=False) -> None:
    """`api.layouts.check_layout_options`, its refusal a usage error (exit 2) naming the options."""
    from hpckpt.api.layouts import check_layout_options as check

    try:
        check(world_size, mesh, placements, rules, layout_files, keep_layout)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def layout_spec(src, world_size, split, mesh, placements, rules, layout_files, keep_layout=False):
    """The target layout the options name (reshard and convert); `src` is the source's index or
    path (read only by --keep-layout)."""
    from hpckpt.api.layouts import layout_spec as spec

    check_layout_options(world_size, mesh, placements, rules, layout_files, keep_layout)
    return spec(src, world_size, split, mesh, placements, rules, layout_files, keep_layout)


def open_source(src, progress):
    """Read the source's metadata under a progress line (it can take seconds), then say planning."""
    from hpckpt.converters import open_index

    progress.phase(f"reading metadata of {src}")
    index = open_index(src)
    progress.phase("planning")
    return index


def output_format(given: str | None, out, option: str, default: str | None = None):
    """The format to write: the one `option` names, else the one `out`'s extension names, else
    `default`. An option that contradicts the extension (`--format pt -o model.safetensors`) is a
    usage error: which one the user meant cannot be told.

    Raises:
        ValueError: neither names a format and there is no default (the message says what to pass).
    """
    from pathlib import Path

    from hpckpt.converters import format_for_extension, format_named

    by_extension = format_for_extension(out)
    if given is None:
        if by_extension is None and default is None:
            raise ValueError(f"cannot tell the target format of {out}: pass {option} "
                             "(or name it .pt, .ckpt, .safetensors)")
        return by_extension or format_named(default)
    chosen = format_named(given)
    if by_extension is not None and by_extension is not chosen:
        raise typer.BadParameter(f"{given!r} writes {chosen.name}, but the extension of {out} ({Path(out).suffix}) "
                                 f"names {by_extension.name}; drop one of them or make them agree", param_hint=option)
    return chosen


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
