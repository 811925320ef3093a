"""The state a job saves or loads into, laid out over the job's ranks.

`layout_spec` reads the same layout options as `hpckpt reshard` (a world size, a mesh with
placements, layout rules, layout files); every tensor becomes a `hdist.sharded` local tensor of
this rank's box, in nested dicts as the checkpoint's own nesting (HyperParallel's
`planner_data`) or the synthetic model's.
"""

from __future__ import annotations

from typing import Any

from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import LayoutSpec, parse_mesh
from hpckpt.dist.jobs import synthetic, tensors
from hpckpt.dist.layouts import Sharded, sharded


def layout_spec(spec: dict, world_size: int) -> LayoutSpec:
    """The layout the job's options name; by default dim 0 split over every rank.

    Raises:
        GeometryError: a mesh of another size than the job's world.
    """
    from hpckpt.api.layouts import target_layout

    mesh = parse_mesh(spec["mesh"]) if spec.get("mesh") else None
    if mesh is not None and mesh.size != world_size:
        raise GeometryError(f"mesh {spec['mesh']} has {mesh.size} ranks, the job has {world_size}",
                            hint=f"launch {mesh.size} ranks (--nproc-per-node x --nnodes) or give a mesh of {world_size}")
    named = spec.get("mesh") or spec.get("rules") or spec.get("layout_files")
    return target_layout(None if named else world_size, spec.get("split") or "balanced", spec.get("mesh"),
                         spec.get("placements"), spec.get("rules"), spec.get("layout_files"))


def _box(layout, shape, rank) -> Box | None:
    boxes = layout.boxes(shape, rank)
    if len(boxes) > 1:
        raise GeometryError(f"layout {layout} gives rank {rank} {len(boxes)} boxes of a {list(shape)} tensor: a job "
                            "holds one box per tensor (ragged layouts are for reshard)")
    return boxes[0] if boxes else None


def _put(nested: dict, path: tuple, value: Any) -> None:
    node = nested
    for step in path[:-1]:
        node = node.setdefault(step, {})
    node[path[-1]] = value


def _lists(node: Any) -> Any:
    """Dicts keyed 0..n-1 by ints (list positions in a HyperParallel path) back into lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def synthetic_state(nbytes: int, dtype, layout: LayoutSpec, rank: int, framework: str) -> tuple[dict, list]:
    """The synthetic model's state, this rank's boxes filled with `synthetic.values`; returns it
    and its `(fqn, Sharded)` list."""
    state: dict = {}
    pieces = []
    for t in synthetic.tensors(nbytes, dtype):
        tl = layout.resolve(t.fqn, t.shape)
        box = _box(tl, t.shape, rank)
        local = tensors.from_values(framework, synthetic.values(t, box), t.dtype) if box is not None else \
            tensors.empty(framework, (0,) * len(t.shape), t.dtype)
        wrapped = sharded(local, t.shape, layout=tl)
        _put(state, t.path, wrapped)
        pieces.append((t.fqn, wrapped))
    for path, value in synthetic.state_values().items():
        _put(state, path, value)
    return _lists(state), pieces


def empty_state(index, layout: LayoutSpec, rank: int, framework: str, cast=None) -> tuple[dict, list]:
    """A zero state for every entry of a checkpoint (`index`), laid out by `layout`: what a load
    fills (`cast`: the dtype of its floating tensors, converted on the copy). Values are None
    until loaded."""
    nesting = index.planner_data or {}
    state: dict = {}
    pieces = []
    for fqn, entry in index.tensors.items():
        shape = tuple(entry.shape)
        tl = layout.resolve(fqn, shape)
        box = _box(tl, shape, rank)
        dtype = cast if cast is not None and entry.dtype.is_floating else entry.dtype
        local = tensors.empty(framework, box.sizes if box is not None else (0,) * len(shape), dtype)
        wrapped = sharded(local, shape, layout=tl)
        _put(state, tuple(nesting.get(fqn, (fqn,))), wrapped)
        pieces.append((fqn, wrapped))
    for fqn in index.values:
        _put(state, tuple(nesting.get(fqn, (fqn,))), None)
    return _lists(state), pieces


def nbytes_of(pieces: list[tuple[str, Sharded]], fw, rank: int) -> int:
    total = 0
    for fqn, s in pieces:
        box = s.box(fqn, rank, fw.shape_of(s.local))
        if box is not None:
            total += box.volume * fw.dtype_of(s.local, fqn).itemsize
    return total
