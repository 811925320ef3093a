"""Turning command-line options into the library's typed objects (layouts, settings, selections).

Only parsing happens here: a wrong combination is a usage error (exit 2) that names the options.
"""

from __future__ import annotations

import typer


def check_layout_options(world_size, mesh, placements, rules, layout_files, keep_layout=False) -> None:
    """Refuse a combination of layout options that names no target or several (before anything
    is read: a large source takes seconds to open)."""
    if keep_layout:
        if placements or rules or layout_files or (world_size is None) == (mesh is None):
            raise typer.BadParameter("--keep-layout goes with exactly one of --world-size or --mesh, and nothing else")
        return
    chosen = sum(x is not None and x != [] for x in (world_size, mesh, layout_files))
    if chosen != 1 and not (rules and chosen == 0):
        raise typer.BadParameter("give exactly one target: --world-size, --mesh (with --placements or "
                                 "--layout-rules), --layout-rules with a mesh inside, or --layout-file")
    if mesh and rules is None and not placements:
        raise typer.BadParameter("--mesh needs --placements (or --layout-rules)")


def layout_spec(src, world_size, split, mesh, placements, rules, layout_files, keep_layout=False):
    """The target layout the options name (reshard and convert); `src` is the source's index or
    path (read only by --keep-layout)."""
    from hpckpt import api
    from hpckpt.api.layouts import target_layout
    from hpckpt.core.layout import Mesh, parse_mesh

    check_layout_options(world_size, mesh, placements, rules, layout_files, keep_layout)
    if keep_layout:
        return api.keep_layout_spec(src, Mesh((world_size,)) if world_size is not None else parse_mesh(mesh))
    return target_layout(world_size, split, mesh, placements, rules, layout_files)


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
