"""Turning command-line options into the library's typed objects (layouts, settings, selections).

Only parsing happens here: a wrong combination is a usage error (exit 2) that names the options.
"""

from __future__ import annotations

import typer


def layout_spec(src, world_size, split, mesh, placements, rules, layout_files, keep_layout=False):
    """The target layout the options name (reshard and convert), checked for conflicts."""
    from hpckpt import api
    from hpckpt.core.layout import LayoutSpec, Mesh, parse_mesh, parse_placements

    if keep_layout:
        if placements or rules or layout_files or (world_size is None) == (mesh is None):
            raise typer.BadParameter("--keep-layout goes with exactly one of --world-size or --mesh, and nothing else")
        return api.keep_layout_spec(src, Mesh((world_size,)) if world_size is not None else parse_mesh(mesh))
    chosen = sum(x is not None and x != [] for x in (world_size, mesh, layout_files))
    if chosen != 1 and not (rules and chosen == 0):
        raise typer.BadParameter("give exactly one target: --world-size, --mesh (with --placements or "
                                 "--layout-rules), --layout-rules with a mesh inside, or --layout-file")
    if world_size is not None:
        return LayoutSpec.for_world_size(world_size, split)
    if layout_files:
        return LayoutSpec.from_layout_files(layout_files)
    target_mesh = parse_mesh(mesh) if mesh else None
    if rules is not None:
        spec = LayoutSpec.from_toml(rules, mesh=target_mesh)
        return spec.with_default(parse_placements(placements, split)) if placements else spec
    if not placements:
        raise typer.BadParameter("--mesh needs --placements (or --layout-rules)")
    return LayoutSpec(target_mesh, parse_placements(placements, split))


def settings(jobs, max_memory: str, no_fsync: bool, force: bool, progress=None):
    """How to write, from the options every writing command has."""
    from hpckpt.api import WriteSettings, parse_size

    return WriteSettings(jobs=jobs, max_memory=parse_size(max_memory), sync=not no_fsync, force=force,
                         progress=progress)


def selection(include, exclude):
    from hpckpt.api import Selection

    return Selection.of(include, exclude)


def check_framework(value: str | None, option: str = "--framework") -> None:
    if value not in (None, "torch", "mindspore"):
        raise typer.BadParameter("torch or mindspore", param_hint=option)
