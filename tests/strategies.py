"""Hypothesis strategies shared by the property tests (import by plain name, like `_util`:
`from strategies import meshes, specs`).

Every strategy is built from `st.integers`, `st.lists`, `st.booleans`, `st.sampled_from` and
`st.permutations` with small bounds, so hypothesis shrinks a failing case toward the smallest
one: integers toward their lower bound, lists toward their minimum length, booleans toward
False, `sampled_from` toward its first element (for `placement`: `Replicate()`), permutations
toward the identity. The definitions are the ones the tests were written with; changing a
bound or a branch order changes the examples every test using it sees.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import RULES, Mesh, RaggedShard, Replicate, Shard, TensorLayout, decompose_flat_interval

# --------------------------------------------------------------------------------------------
# Shapes, meshes and placements (test_engine_properties)

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
"""A tensor shape of 0 to 3 dims, each 0..7 (empty dims included); shrinks toward `()`."""


@st.composite
def meshes(draw) -> Mesh:
    """A 1-D or 2-D mesh of at most 6 ranks, global ranks in any order.

    Shrinks toward the one-rank 2-D mesh `(1, 1)` with ranks in order."""
    if draw(st.booleans()):
        dims = (draw(st.integers(1, 6)),)
    else:
        a = draw(st.integers(1, 3))
        dims = (a, draw(st.integers(1, 6 // a)))
    ranks = draw(st.permutations(range(math.prod(dims))))
    return Mesh(dims, tuple(ranks))


placement = st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, 2), st.sampled_from(RULES)))
"""One placement: `Replicate()` or `Shard(dim 0..2, any split rule)`; shrinks toward `Replicate()`."""


@st.composite
def specs(draw) -> tuple[Mesh, tuple]:
    """A mesh (`meshes`) and one `placement` per mesh dim; shrinks toward a replicated one-rank mesh."""
    mesh = draw(meshes())
    return mesh, tuple(draw(placement) for _ in mesh.shape)


# --------------------------------------------------------------------------------------------
# Chunk boxes (test_engine_properties: the chunk index against brute force)


@st.composite
def tilings(draw) -> tuple[tuple[int, ...], list[Box]]:
    """A shape and a random guillotine tiling of it (recursive cuts, so sizes vary), plus
    optionally replicas, empty boxes and RaggedShard-style flat-interval boxes.

    Shrinks toward a 1-D shape `(1,)` covered by one box."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))

    def cut(box: Box, depth: int) -> list[Box]:
        splittable = [d for d in range(box.ndim) if box.sizes[d] > 1]
        if depth > 5 or not splittable or not draw(st.booleans()):
            return [box]
        d = draw(st.sampled_from(splittable))
        at = draw(st.integers(1, box.sizes[d] - 1))
        left = Box(box.offsets, box.sizes[:d] + (at,) + box.sizes[d + 1:])
        right = Box(box.offsets[:d] + (box.offsets[d] + at,) + box.offsets[d + 1:],
                    box.sizes[:d] + (box.sizes[d] - at,) + box.sizes[d + 1:])
        return cut(left, depth + 1) + cut(right, depth + 1)

    if draw(st.booleans()):
        boxes = cut(Box((0,) * len(shape), shape), 0)
    else:  # flat row-major intervals, as RaggedShard stores them
        total = math.prod(shape)
        points = sorted(set(draw(st.lists(st.integers(0, total), max_size=6))) | {0, total})
        boxes = [b for lo, hi in zip(points, points[1:]) for b in decompose_flat_interval(shape, lo, hi)]
    extras = draw(st.lists(st.sampled_from(boxes), max_size=3))  # identical replicas
    if draw(st.booleans()):
        d = draw(st.integers(0, len(shape) - 1))
        extras.append(Box(tuple(draw(st.integers(0, s)) for s in shape), shape[:d] + (0,) + shape[d + 1:]))
    order = draw(st.permutations(boxes + extras))
    return shape, list(order)


@st.composite
def query_boxes(draw, shape):
    """A box inside `shape` (possibly empty); shrinks toward the empty box at the origin."""
    offsets, sizes = [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        offsets.append(lo)
        sizes.append(draw(st.integers(0, n - lo)))
    return Box(tuple(offsets), tuple(sizes))


# --------------------------------------------------------------------------------------------
# Layouts (test_layout)


@st.composite
def layouts_and_shapes(draw):
    """A `TensorLayout` on a mesh of at most 8 ranks (1 to 3 dims) and a shape it applies to:
    one in five (when the shape has dims) a RaggedShard layout, else Replicate/Shard placements
    with either split rule.

    Shrinks toward a one-rank 1-D mesh, a 0-d shape and `Replicate()`."""
    mesh_shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(lambda s: math.prod(s) <= 8))
    shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
    mesh = Mesh(tuple(mesh_shape))
    if shape and draw(st.integers(0, 4)) == 0:  # a ragged layout
        k = draw(st.integers(0, mesh.ndim - 1))
        units = draw(st.lists(st.integers(0, 3), min_size=mesh.shape[k], max_size=mesh.shape[k]).filter(any))
        shape = (sum(units) * draw(st.integers(0, 2)),) + shape[1:]
        prefix = draw(st.integers(1, len(shape)))
        if math.prod(shape[:prefix]) % sum(units):
            prefix = 1
        placements = [Replicate()] * mesh.ndim
        placements[k] = RaggedShard(tuple(range(prefix)), tuple(units))
        return TensorLayout(mesh, tuple(placements)), shape
    options = [Replicate()] + [Shard(d, r) for d in range(len(shape)) for r in ("balanced", "ceil")]
    placements = tuple(draw(st.sampled_from(options)) for _ in mesh_shape)
    return TensorLayout(mesh, placements), shape
