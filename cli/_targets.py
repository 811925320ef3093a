"""Turning command-line options into the library's typed objects (layouts, settings, selections).

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


def settings(jobs, max_memory: str, no_fsync: bool, force: bool, progress=None, parents: bool = False):
    """How to write, from the options every writing command has."""
    from hpckpt.api import WriteSettings, parse_size

    return WriteSettings(jobs=jobs, max_memory=parse_size(max_memory), sync=not no_fsync, force=force,
                         progress=progress, parents=parents)


def selection(include, exclude):
    from hpckpt.api import Selection

    return Selection.of(include, exclude)


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
