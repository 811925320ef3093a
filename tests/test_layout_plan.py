"""The global plan from layouts (`core/geometry/layout_plan.py`) is `build_global_plan`'s plan of
the same boxes, array for array, in every de-dup mode: on the layouts of the live-save tests and
on seeded random ones (uneven and empty splits, nested splits of one dim, meshes on a subset or a
permutation of the ranks, replicas, 0-d tensors), and it refuses what it cannot plan."""

from __future__ import annotations

import numpy as np
import pytest

from hpckpt.core.dtypes import dtype
from hpckpt.core.geometry.box import Box
from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.global_plan import LocalPlan, build_global_plan
from hpckpt.core.geometry.layout import Mesh, RaggedShard, Replicate, Shard, TensorLayout, parse_placements
from hpckpt.core.geometry.layout_plan import build_layout_plan, mesh_boxes

FIELDS = ("tid", "owner", "index", "offsets", "sizes")


def _by_boxes(table, world, dedup):
    """What the ranks' own boxes give: each rank's LocalPlan, as a save gathers them."""
    per_rank = {r: [] for r in range(world)}
    for name, dt, shape, layout in table:
        boxes = layout.all_boxes(shape)
        for r in range(world):
            per_rank[r].append((name, dt.name, shape, list(boxes.get(r, []))))
    return build_global_plan([LocalPlan.build(r, per_rank[r]) for r in range(world)], dedup=dedup)


def _same(table, world):
    for dedup in ("balanced", "lowest-rank", "none"):
        want, got = _by_boxes(table, world, dedup), build_layout_plan(table, world, dedup=dedup)
        assert (got.names, got.shapes, [d.name for d in got.dtypes]) == \
            (want.names, want.shapes, [d.name for d in want.dtypes])
        for field in FIELDS:
            assert np.array_equal(getattr(got, field), getattr(want, field)), (dedup, field)
        assert got.plan() == want.plan()


def test_the_live_save_layouts():
    mesh4, mesh22 = Mesh((4,)), Mesh((2, 2))
    rows = [("emb", "bfloat16", (13, 6), mesh4, "S0"), ("cols", "float32", (5, 9), mesh4, "S1"),
            ("hsdp", "float32", (10, 3), mesh22, "R,S0"), ("grid", "float16", (7, 5), mesh22, "S0,S1"),
            ("rep", "float32", (3,), mesh4, "R"), ("step", "float32", (), mesh4, "R"),
            ("tiny", "int64", (2, 2), mesh4, "S0:ceil"), ("big_rep", "float32", (64, 4), mesh22, "R,R"),
            ("nested", "float32", (10, 2), mesh22, "S0:ceil,S0")]
    _same([(n, dtype(d), s, TensorLayout(m, parse_placements(p))) for n, d, s, m, p in rows], 4)


def _random_layout(rng, world, ndim):
    dims = [int(x) for x in rng.choice([1, 2, 3, 4], size=int(rng.integers(1, 4)))]
    while np.prod(dims) > world:
        dims.pop()
    dims = dims or [1]
    n = int(np.prod(dims))
    ranks = rng.permutation(world)[:n] if rng.random() < 0.4 else np.arange(n)
    placements = []
    for _k in dims:
        if ndim and rng.random() < 0.6:
            placements.append(Shard(int(rng.integers(0, ndim)), str(rng.choice(["balanced", "ceil"]))))
        else:
            placements.append(Replicate())
    return TensorLayout(Mesh(tuple(dims), tuple(int(r) for r in ranks)), tuple(placements))


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts(seed):
    rng = np.random.default_rng(seed)
    world = int(rng.choice([4, 6, 8, 12]))
    table = []
    for t in range(int(rng.integers(3, 12))):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(s) for s in rng.integers(0, 9, size=ndim))
        layout = _random_layout(rng, world, ndim)
        table.append((f"t{t}", dtype(str(rng.choice(["float32", "bfloat16", "int8"]))), shape, layout))
        if rng.random() < 0.3:  # a tensor of the same shape and layout: a layer of a model
            table.append((f"t{t}b", table[-1][1], shape, layout))
    _same(table, world)


def test_mesh_boxes_are_the_layouts_boxes():
    layout = TensorLayout(Mesh((2, 3), (5, 0, 4, 1, 3, 2)), (Shard(0, "ceil"), Shard(0)))
    ranks, offsets, sizes = mesh_boxes(layout, (11, 4))
    for r, o, s in zip(ranks.tolist(), offsets.tolist(), sizes.tolist()):
        [box] = layout.boxes((11, 4), r)
        assert (tuple(o), tuple(s)) == (box.offsets, box.sizes)


def test_what_it_refuses():
    ragged = TensorLayout(Mesh((2,)), (RaggedShard((0,), (1, 3)),))
    with pytest.raises(GeometryError, match="ragged"):
        build_layout_plan([("r", dtype("float32"), (8,), ragged)], 2)
    beyond = TensorLayout(Mesh((2,), (0, 7)), (Shard(0),))
    with pytest.raises(GeometryError, match="rank 7 of a job of 4"):
        build_layout_plan([("w", dtype("float32"), (8,), beyond)], 4)
    with pytest.raises(GeometryError):
        build_layout_plan([("w", dtype("float32"), (8,), TensorLayout(Mesh((2,)), (Shard(1),)))], 2)


def test_each_rank_describes_the_same_table_or_none():
    """`dist.save_plan.layout_table`: ranks whose tensors all have layouts that give exactly their
    boxes describe one table (one digest on every rank: the save then sends no boxes); a box the
    layout does not give, a mesh beyond the job, or a mesh in global ranks of a subgroup job:
    no table (the ranks send boxes)."""
    from types import SimpleNamespace

    from hpckpt.core.geometry.global_plan import LocalPlan
    from hpckpt.dist.save_plan import layout_table

    mesh = Mesh((2, 2))
    grid = TensorLayout(mesh, parse_placements("S0,S1"))
    shapes = {"w": (5, 4), "b": (3,)}

    def local(rank, layouts, boxes=None):
        rows = [("w", "float32", shapes["w"], boxes if boxes is not None else grid.boxes(shapes["w"], rank)),
                ("b", "float32", shapes["b"], [Box((0,), (3,))])]
        return SimpleNamespace(rows=rows, layouts=layouts, tensors={"w": None, "b": None},
                               plan=LocalPlan.build(rank, rows, (), {"w": ("model", "w")}))

    tables = [layout_table(local(r, [grid, "replicated"]), r, 4, ranks_are_global=True) for r in range(4)]
    assert all(t is not None for t in tables) and len({t.digest() for t in tables}) == 1
    assert tables[0].nesting == {"w": ("model", "w")}
    assert tables[0].rows[1][3].mesh.shape == (4,)  # b: replicated on 4
    assert layout_table(local(1, [grid, "replicated"], boxes=[Box((0, 0), (3, 2))]), 1, 4,
                        ranks_are_global=True) is None  # rank 1's box is not the layout's
    assert layout_table(local(0, [grid, "replicated"]), 0, 4, ranks_are_global=False) is None
    assert layout_table(local(0, [grid, None]), 0, 4, ranks_are_global=True) is None  # chunk_info: no layout
    beyond = TensorLayout(Mesh((2, 2), (0, 1, 2, 9)), parse_placements("S0,S1"))
    assert layout_table(local(0, [beyond, "replicated"]), 0, 4, ranks_are_global=True) is None
