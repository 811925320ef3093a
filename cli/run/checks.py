"""The jobs' options checked, and turned into the parts of a job's spec the workers read.

A wrong option is a usage error (exit 2) found here, before a launcher starts (10-25 s); what
needs the file system (a missing source, an existing destination) is checked last, just before.
"""

from __future__ import annotations

from pathlib import Path

import typer

from hpckpt.core.storage.object_path import is_object


def absolute(path: Path | None) -> str | None:
    """Paths reach the workers absolute: a launcher may start them elsewhere (a URL as it is)."""
    if path is None:
        return None
    return str(path) if is_object(path) else str(Path(path).expanduser().absolute())


def size(text: str | None, option: str) -> int | None:
    if text is None:
        return None
    from hpckpt.api.options import parse_size

    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{option}: {exc}") from None
    if nbytes <= 0:
        raise typer.BadParameter(f"{option} must be more than 0 bytes")
    return nbytes


def layout_part(layout) -> dict:
    """The layout options' part of a job's spec (paths absolute); `layout` is a RankLayout or a
    TargetLayout (cli._option_groups)."""
    files = layout.layout_files
    return {"mesh": layout.mesh, "placements": layout.placements, "rules": absolute(layout.rules),
            "layout_files": [absolute(p) for p in files] if files else None, "split": layout.split}


def one_source(size_text: str | None, src: Path | None) -> None:
    if (size_text is None) == (src is None):
        raise typer.BadParameter("give exactly one of --size (synthetic tensors) or --from SRC")


def world_size(ctx: typer.Context) -> int:
    return ctx.obj["nnodes"] * ctx.obj["nproc_per_node"]


def rate(text: str | None, option: str) -> float | None:
    """Bytes per second from a rate option (`2GiB`, `800MB/s`); None when not given."""
    if text is None:
        return None
    from hpckpt.core.sizes import parse_rate

    try:
        return parse_rate(text)
    except ValueError:
        raise typer.BadParameter(f"{option}: {text!r} is not a rate; give bytes per second, e.g. 2GiB/s") from None


def rank_layout(world: int, layout) -> None:
    """The layout of the job's own ranks (a RankLayout): a mesh of exactly the job's world size,
    with placements or rules; placements only with a mesh; layout files alone."""
    from hpckpt.core.geometry.layout import parse_mesh, parse_placements

    mesh, placements, rules, split = layout.mesh, layout.placements, layout.rules, layout.split
    if layout.layout_files and (mesh or placements or rules):
        raise typer.BadParameter("--layout-file goes alone (without --mesh, --placements or --layout-rules)")
    if placements and not mesh:
        raise typer.BadParameter("--placements needs --mesh")
    try:
        if mesh:
            sizes = parse_mesh(mesh).shape
            product = parse_mesh(mesh).size
            if product != world:
                raise typer.BadParameter(f"--mesh {mesh} holds {product} ranks, the job has {world} "
                                         "(--nnodes x --nproc-per-node)")
            if not placements and rules is None:
                raise typer.BadParameter("--mesh needs --placements (or --layout-rules)")
            if placements and len(parse_placements(placements, split)) != len(sizes):
                raise typer.BadParameter(f"--placements {placements} needs one placement per mesh dim ({len(sizes)})")
        elif placements:
            parse_placements(placements, split)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def paths(spec: dict) -> None:
    """What this node can tell before a launcher starts: a source that is not there, a
    destination that exists without --force or that would overwrite the source. One line and
    the error's own exit code, as every command gives; the workers check again (other nodes may
    see other storage).

    Raises:
        PathNotFoundError, DestinationExistsError, UnsafeDestinationError.
    """
    import hpckpt.converters  # noqa: F401 - registers what a destination check asks of the formats
    from hpckpt.core.commit.destination import refuse_existing, refuse_unsafe
    from hpckpt.core.errors import PathNotFoundError

    from hpckpt.core.storage.urls import as_path, lexists

    source = spec.get("ckpt") or spec.get("src") or spec.get("from")
    source = as_path(source) if source else None
    if source is not None and not lexists(source):
        raise PathNotFoundError(f"{source}: no such file or directory")
    if spec["job"] in ("save", "reshard") and spec.get("out"):
        out = as_path(spec["out"])
        refuse_unsafe(out, source)
        refuse_existing(out, bool(spec.get("force")))
