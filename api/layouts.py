"""Target layouts read off a source: keep each tensor's layout on a new mesh, or keep it all.

Both look at each tensor's stored boxes (`core.geometry.layout.infer`) and rebuild the layout that gives
them, so `reshard --keep-layout` and a `convert` without layout options need no layout file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpckpt.core.errors import PlacementFitError
from hpckpt.core.geometry.layout import LayoutSpec, Mesh, Replicate, Shard, TensorLayout, infer
from hpckpt.core.index import CheckpointIndex


def _splits(found) -> tuple[Shard, ...]:
    return tuple(Shard(d, "balanced" if r == "even" else r) for d, r in zip(found.dims, found.rules))


def target_layout(world_size: int | None, split: str, mesh: str | None, placements: str | None,
                  rules: str | Path | None, layout_files: Iterable[str | Path] | None) -> LayoutSpec:
    """The layout the layout options name (`reshard`, `convert`, the jobs of `hpckpt run`): a
    world size (dim 0 split), layout files, a rules file (with placements as its default), or a
    mesh with placements. The caller has checked that exactly one target is named.

    Raises:
        ValueError: a malformed mesh or placement.
    """
    from hpckpt.core.geometry.layout import parse_mesh, parse_placements

    if world_size is not None:
        return LayoutSpec.for_world_size(world_size, split)
    if layout_files:
        return LayoutSpec.from_layout_files(list(layout_files))
    target_mesh = parse_mesh(mesh) if mesh else None
    if rules is not None:
        spec = LayoutSpec.from_toml(rules, mesh=target_mesh)
        return spec.with_default(parse_placements(placements, split)) if placements else spec
    return LayoutSpec(target_mesh, parse_placements(placements, split))


def keep_layout_spec(index: CheckpointIndex | str | Path, mesh: Mesh) -> LayoutSpec:
    """Each tensor keeps its layout and changes only the mesh size (HSDP-style); `index` is the
    source's index or its path.

    Each tensor's split dims, as inferred from its chunks, go in order onto the last mesh dims
    (outer mesh dims replicate), with the split rule it was saved with; replicated tensors stay
    replicated; irregular ones (ragged) are split on dim 0 over the last mesh dim.
    """
    if not isinstance(index, CheckpointIndex):
        from hpckpt.converters import open_index

        index = open_index(index)
    layouts = {}
    for fqn, entry in index.tensors.items():
        found = infer(entry.shape, entry.boxes, index.world_size)
        if found is not None and found.kind == "replicated":
            splits: list[Any] = []
        elif found is not None and found.kind == "sharded":
            splits = list(_splits(found))
        else:
            splits = [Shard(0)] if entry.shape else []
        splits = splits[-mesh.ndim:] if splits else []
        placements = (Replicate(),) * (mesh.ndim - len(splits)) + tuple(splits)
        layouts[fqn] = TensorLayout(mesh, placements)
    return LayoutSpec(mesh, layouts=layouts)


def source_layout(index: CheckpointIndex) -> LayoutSpec:
    """The layout the source was saved with, tensor by tensor: the same boxes on the same number
    of ranks. A tensor split into n parts on W ranks gets the mesh (W / n, *parts) with its splits
    on the inner dims (replicated over the outer one, as HSDP saves); replicated tensors stay
    replicated; irregular ones (ragged) are split on dim 0 over all ranks."""
    found = {fqn: infer(e.shape, e.boxes, index.world_size) for fqn, e in index.tensors.items()}
    grids = [math.prod(f.parts) for f in found.values() if f is not None and f.kind == "sharded"]
    world = max([index.world_size or 1, *grids])
    mesh = Mesh((world,))
    layouts = {}
    for fqn, f in found.items():
        if f is not None and f.kind == "sharded":
            n = math.prod(f.parts)
            if world % n == 0 and world > n:
                layouts[fqn] = TensorLayout(Mesh((world // n, *f.parts)), (Replicate(),) + _splits(f))
            else:
                layouts[fqn] = TensorLayout(Mesh(f.parts), _splits(f))
        elif (f is not None and f.kind == "replicated") or not index.tensors[fqn].shape:
            layouts[fqn] = TensorLayout(mesh, (Replicate(),))
        else:
            layouts[fqn] = TensorLayout(mesh, (Shard(0),))
    return LayoutSpec(mesh, layouts=layouts)


def check_fit(layout: LayoutSpec | None, index: CheckpointIndex, names: Iterable[str] | None = None) -> list[str]:
    """Check the target layout's placements against the tensors they apply to (`names`, default
    all): returns one `layout:` warning per placement some tensors cannot take (they are
    replicated on that mesh dim instead, each named).

    Raises:
        PlacementFitError: a placement fits none of the tensors it applies to (`--placements S9`
            on 2-D tensors): a usage error, never a silent replication of everything.
    """
    if layout is None:
        return []
    wanted = None if names is None else set(names)
    shapes = {fqn: e.shape for fqn, e in index.tensors.items() if wanted is None or fqn in wanted}
    warnings = []
    for m in layout.misfits(shapes):
        where = f"{m.placement} (mesh dim {m.mesh_dim}, {m.source})"
        if m.fits == 0:
            dims = sorted({len(shapes[f]) for f in m.unfit})
            raise PlacementFitError(
                f"placement {where} fits none of the {len(m.unfit)} tensor(s) it applies to "
                f"(they have {' or '.join(map(str, dims))} dims)",
                hint="a Shard(d) needs tensors with more than d dims: check --placements or the layout rules")
        warnings.append(f"layout: placement {where} does not fit {len(m.unfit)} of the {len(m.unfit) + m.fits} "
                        f"tensor(s) it applies to, which are replicated on that mesh dim: {', '.join(m.unfit)}")
    return warnings


def check_layout_options(world_size, mesh, placements, rules, layout_files, keep_layout=False) -> None:
    """Refuse a combination of layout options that names no target or several (before anything
    is read: a large source takes seconds to open).

    Raises:
        ValueError: the message names the options to give.
    """
    if keep_layout:
        if placements or rules or layout_files or (world_size is None) == (mesh is None):
            raise ValueError("--keep-layout goes with exactly one of --world-size or --mesh, and nothing else")
        return
    chosen = sum(x is not None and x != [] for x in (world_size, mesh, layout_files))
    if chosen != 1 and not (rules and chosen == 0):
        raise ValueError("give exactly one target: --world-size, --mesh (with --placements or "
                         "--layout-rules), --layout-rules with a mesh inside, or --layout-file")
    if mesh and rules is None and not placements:
        raise ValueError("--mesh needs --placements (or --layout-rules)")
    if mesh and placements:
        from hpckpt.core.geometry.layout import parse_mesh, parse_placements

        dims, given = len(parse_mesh(mesh).shape), len(parse_placements(placements))
        if dims != given:
            raise ValueError(f"--placements gives {given} placement(s) for the {dims}-D mesh {mesh}: one per mesh "
                             "dimension, e.g. --mesh 2x4 --placements R,S0")


def layout_spec(src: CheckpointIndex | str | Path, world_size: int | None, split: str, mesh: str | None,
                placements: str | None, rules: str | Path | None, layout_files: Iterable[str | Path] | None,
                keep_layout: bool = False) -> LayoutSpec:
    """The target layout the layout options name (reshard, convert, `run reshard`'s workers);
    `src` is the source's index or path (read only by --keep-layout).

    Raises:
        ValueError: the options name no target, several, or a malformed one.
    """
    from hpckpt.core.geometry.layout import parse_mesh

    check_layout_options(world_size, mesh, placements, rules, layout_files, keep_layout)
    if keep_layout:
        return keep_layout_spec(src, Mesh((world_size,)) if world_size is not None else parse_mesh(mesh))
    return target_layout(world_size, split, mesh, placements, rules, layout_files)
