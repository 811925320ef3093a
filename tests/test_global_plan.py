"""The global plan of a live save (`core/geometry/global_plan.py`): every rank derives it from the gathered
local plans, and it must be the offline planner's plan for the same layout (so a live save writes
the bytes `hpckpt reshard` writes), place replicas as HyperParallel's de-dup does, and refuse
shards that do not hold their tensor exactly once. No framework: local plans are built from the
layouts' own boxes, as a job's ranks would describe them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpckpt.core.geometry.box import Box
from hpckpt.core.dtypes import dtype
from hpckpt.core.errors import EntryMismatchError, GeometryError
from hpckpt.core.geometry.global_plan import LocalPlan, LocalValue, build_global_plan, plan_key
from hpckpt.core.geometry.layout import LayoutSpec, Mesh, parse_placements
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.geometry.plan import make_plan

# (name, dtype, shape, mesh, placements): uneven splits, replicas, HSDP, 0-d, an empty shard
TENSORS = [
    ("emb", "bfloat16", (13, 6), (4,), "S0"),
    ("cols", "float32", (5, 9), (4,), "S1"),
    ("hsdp", "float32", (10, 3), (2, 2), "R,S0"),
    ("grid", "float16", (7, 5), (2, 2), "S0,S1"),
    ("rep", "float32", (3,), (4,), "R"),
    ("step", "float32", (), (4,), "R"),
    ("tiny", "int64", (2, 2), (4,), "S0:ceil"),
    ("big_rep", "float32", (64, 4), (2, 2), "R,R"),
]


class _Layouts:
    def __init__(self, spec):
        self.spec = spec

    def resolve(self, fqn, shape):
        return self.spec[fqn]


def _layouts(world_size=4):
    return {name: LayoutSpec(Mesh(mesh), parse_placements(text)).resolve(name, shape)
            for name, _dt, shape, mesh, text in TENSORS}


def _local_plans(layouts, world_size=4, values=()):
    """Each rank's LocalPlan: the boxes the layout gives it, in the layout's order."""
    per_rank = {r: [] for r in range(world_size)}
    for name, dt, shape, _mesh, _text in TENSORS:
        boxes = layouts[name].all_boxes(shape)
        for r in range(world_size):
            per_rank[r].append((name, dt, shape, list(boxes.get(r, []))))
    return [LocalPlan.build(r, per_rank[r], values) for r in range(world_size)]


def _offline(layouts):
    """The offline planner's plan for the same tensors and layouts (what `reshard` writes)."""
    tensors = {name: MemoryTensor.whole(dtype(dt), np.zeros(shape, dtype(dt).np)) for name, dt, shape, _m, _t in TENSORS}
    return make_plan(memory_index(tensors), _Layouts(layouts), 4)


@pytest.mark.parametrize("dedup", ["balanced", "lowest-rank", "none"])
def test_every_rank_builds_the_offline_plan(dedup):
    layouts = _layouts()
    plans = _local_plans(layouts)
    gathered = [LocalPlan.from_json(json.loads(json.dumps(p.to_json()))) for p in plans]  # as a gather carries them
    live = build_global_plan(gathered, dedup=dedup).plan()
    again = build_global_plan(list(reversed(gathered))[::-1], dedup=dedup).plan()
    assert live == again  # deterministic: every rank derives the same plan
    by_name = {t.fqn: t for t in live.tensors}
    assert list(by_name) == [name for name, *_ in TENSORS]
    if dedup == "balanced":
        offline = {t.fqn: t for t in _offline(layouts).tensors}
        for name in by_name:
            assert by_name[name].boxes == offline[name].boxes, name
            assert by_name[name].dtype == offline[name].dtype and by_name[name].shape == offline[name].shape
    for name, _dt, shape, _mesh, _text in TENSORS:
        boxes = by_name[name].boxes
        assert [b.index for b in boxes] == list(range(len(boxes)))  # positions in the chunk list
        assert [b.rank for b in boxes] == sorted(b.rank for b in boxes)  # rank-major
        holders = layouts[name].all_boxes(shape)
        for b in boxes:  # every stored box is stored by a rank that holds it
            assert b.box in holders[b.rank]
        distinct = {b.box for b in boxes}
        if dedup == "none":
            assert len(boxes) == sum(len(v) for v in holders.values() if v) - _empty_duplicates(holders)
        else:
            assert len(boxes) == len(distinct)
    if dedup == "lowest-rank":
        assert all(b.rank == 0 for b in by_name["big_rep"].boxes + by_name["rep"].boxes)


def _empty_duplicates(holders):
    """Empty boxes sharing a start with another box are recorded once (one metadata key)."""
    seen, extra = {}, 0
    for rank, boxes in holders.items():
        for box in boxes:
            if box.is_empty and any(not o.is_empty and o.offsets == box.offsets for bs in holders.values() for o in bs):
                extra += 1
    return extra - len(seen)


def test_balanced_dedup_spreads_replicas_by_bytes():
    """Four ranks hold the same five tensors: largest first, each to the least-loaded holder
    (ties: the lowest rank)."""
    boxes = [Box((i * 10,), (10 * (4 - i),)) for i in range(4)]
    rows = [("t", "float32", (100,), [Box((0,), (100,))])]
    plans = [LocalPlan.build(r, rows + [(f"r{i}", "float32", (b.sizes[0],), [Box((0,), b.sizes)]) for i, b in
                                        enumerate(boxes)]) for r in range(4)]
    plan = build_global_plan(plans).plan()
    owners = {t.fqn: t.boxes[0].rank for t in plan.tensors}
    assert owners == {"t": 0, "r0": 1, "r1": 2, "r2": 3, "r3": 3}  # 400, 160, 120, 80 bytes; then 40 to rank 3


def test_a_rank_plan_has_only_its_boxes_with_global_positions():
    layouts = _layouts()
    gp = build_global_plan(_local_plans(layouts))
    full = {t.fqn: t.boxes for t in gp.plan().tensors}
    for rank in range(4):
        mine = gp.plan([rank])
        assert mine.producing == (rank,)
        for t in mine.tensors:
            assert t.boxes == tuple(b for b in full[t.fqn] if b.rank == rank)


def test_values_are_stored_once_and_must_agree():
    v = LocalValue("lr", 12, "d1")
    plans = [LocalPlan.build(r, [("t", "float32", (4,), [Box((r * 2,), (2,))] if r < 2 else [])], [v])
             for r in range(3)]
    gp = build_global_plan(plans)
    assert [(p.fqn, p.rank) for p in gp.values] == [("lr", 0)] and gp.value_lengths == {"lr": 12}
    differing = [LocalPlan.build(r, [("t", "float32", (4,), [Box((r * 2,), (2,))])], [LocalValue("rng", 8, f"d{r}")])
                 for r in range(2)]
    with pytest.raises(EntryMismatchError, match="rng: rank 0 and rank 1 hold different values"):
        build_global_plan(differing)


@pytest.mark.parametrize("boxes, message", [
    ([[Box((0,), (2,))], [Box((3,), (1,))]], "hold 3 elements of a tensor of 4"),  # a gap
    ([[Box((0,), (3,))], [Box((2,), (2,))]], "hold 5 elements of a tensor of 4"),  # an overlap, too many
    ([[Box((0,), (3,))], [Box((1,), (1,))]], "some twice"),  # overlap with the right count
    ([[Box((0,), (2,))], [Box((2,), (3,))]], "lies outside"),
])
def test_shards_that_do_not_hold_the_tensor_once_are_refused(boxes, message):
    if message == "some twice":
        boxes = [[Box((0,), (3,))], [Box((1,), (1,))]]
        plans = [LocalPlan.build(0, [("t", "float32", (4,), boxes[0])]),
                 LocalPlan.build(1, [("t", "float32", (4,), boxes[1])])]
        with pytest.raises(GeometryError, match="t: the ranks' shards hold 4 elements of a tensor of 4"):
            build_global_plan(plans)
        return
    plans = [LocalPlan.build(r, [("t", "float32", (4,), b)]) for r, b in enumerate(boxes)]
    with pytest.raises(GeometryError, match=message):
        build_global_plan(plans)


def test_ranks_that_disagree_on_a_tensor_are_refused():
    plans = [LocalPlan.build(0, [("t", "float32", (4,), [Box((0,), (4,))])]),
             LocalPlan.build(1, [("t", "bfloat16", (4,), [Box((0,), (4,))])])]
    with pytest.raises(EntryMismatchError, match="t: rank 0 holds it as float32\\[4\\], rank 1 as bfloat16\\[4\\]"):
        build_global_plan(plans)


def test_the_cache_key_sees_every_change():
    layouts = _layouts()
    plans = _local_plans(layouts)
    key = plan_key([p.digest() for p in plans], {"dedup": "balanced"})
    assert key == plan_key([p.digest() for p in _local_plans(layouts)], {"dedup": "balanced"})
    assert key != plan_key([p.digest() for p in plans], {"dedup": "lowest-rank"})
    reshaped = [LocalPlan.build(p.rank, [(n, d, tuple(s), []) for n, d, s in zip(p.names, p.dtypes, p.shapes)])
                for p in plans]
    assert key != plan_key([p.digest() for p in reshaped], {"dedup": "balanced"})  # same names, other boxes
    moved = _local_plans(layouts, values=[LocalValue("lr", 3, "x")])
    assert key != plan_key([p.digest() for p in moved], {"dedup": "balanced"})


def test_thousands_of_ranks():
    """4,096 ranks of an FSDP-like job (20 sharded tensors, 30 replicated): one sort, and the
    replicas spread over the ranks by bytes."""
    world = 4096
    base = [(f"w{t}", "bfloat16", (world * 2, 8)) for t in range(20)]
    rep = [(f"n{t}", "float32", (16,)) for t in range(30)]
    plans = [LocalPlan.build(r, [(n, d, s, [Box((2 * r, 0), (2, 8))]) for n, d, s in base]
                             + [(n, d, s, [Box((0,), (16,))]) for n, d, s in rep]) for r in range(world)]
    gp = build_global_plan(plans)
    plan = gp.plan()
    assert sum(len(t.boxes) for t in plan.tensors) == 20 * world + 30
    owners = {t.boxes[0].rank for t in plan.tensors if t.fqn.startswith("n")}
    assert len(owners) == 30  # each replicated tensor on its own rank: the loads were equal


def test_tensors_that_repeat_a_layout_are_planned_and_counted_each_as_alone():
    """`make_plan` computes a (layout, shape)'s boxes once and `rank_stats` intersects the same
    chunks and boxes once (a model's layers repeat them): each tensor still gets its own owners,
    bytes (its dtype) and files (its chunks'), as when planned alone."""
    from pathlib import Path

    from hpckpt.core.geometry.plan_stats import rank_stats
    from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry

    def entry(name, dt, files):
        chunks = [Chunk(Box((0, 0), (5, 6)), files[0], name), Chunk(Box((5, 0), (3, 6)), files[1], name)]
        return TensorEntry(name, dtype(dt), (8, 6), chunks, dt)

    def index(entries):
        return CheckpointIndex(root=Path("."), format="memory", format_version="", framework=None,
                               tensors={e.fqn: e for e in entries}, values={}, data_files=[], locator=None)

    specs = [("a", "float32", ["f0", "f1"]), ("b", "float32", ["g0", "g1"]), ("c", "bfloat16", ["f1", "f0"]),
             ("d", "float32", ["h0", "h1"])]
    layout = LayoutSpec(Mesh((3,)), parse_placements("S0")).resolve("a", (8, 6))
    layouts = _Layouts({name: layout for name, *_ in specs[:3]} |
                       {"d": LayoutSpec(Mesh((3,)), parse_placements("S1")).resolve("d", (8, 6))})
    together_plan = make_plan(index([entry(*s) for s in specs]), layouts, 3)
    together = rank_stats(together_plan, index([entry(*s) for s in specs]))
    alone = {}
    for s in specs:
        plan = make_plan(index([entry(*s)]), layouts, 3)
        assert plan.tensors[0] == next(t for t in together_plan.tensors if t.fqn == s[0])
        for st in rank_stats(plan, index([entry(*s)])):
            w, r, f = alone.get(st.rank, (0, 0, set()))
            alone[st.rank] = (w + st.bytes_written, r + st.bytes_read, f | set(st.files))
    assert {st.rank: (st.bytes_written, st.bytes_read, set(st.files)) for st in together} == alone
    assert any(len(f) > 2 for _, _, f in alone.values())  # (files of several tensors on one rank)


def test_a_plan_s_boxes_and_columns_are_one_plan():
    """The planner gives each tensor's boxes as columns (arrays: no object per box at thousands
    of ranks) and builds the `PlannedBox`es only when asked: the two forms, a tensor built from
    boxes, a pickled plan, the ranks that store something and their bytes all agree."""
    import pickle

    from hpckpt.core.geometry.plan import PlannedTensor

    plan = _offline(_layouts())
    for t in plan.tensors:
        c = t.columns
        as_columns = [(tuple(o), tuple(s), r, i) for i, (o, s, r) in
                      enumerate(zip(c.offsets.tolist(), c.sizes.tolist(), c.ranks.tolist()))]
        assert [(b.box.offsets, b.box.sizes, b.rank, b.index) for b in t.boxes] == as_columns
        from_boxes = PlannedTensor(t.fqn, t.shape, t.dtype, t.source_dtype, t.boxes)
        assert from_boxes == t and hash(from_boxes) == hash(t)
        back = from_boxes.columns
        assert back.index is None and all(np.array_equal(a, b) for a, b in
                                          ((back.offsets, c.offsets), (back.sizes, c.sizes), (back.ranks, c.ranks)))
        assert not c.offsets.flags.writeable and not c.ranks.flags.writeable  # (a plan is frozen data)
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert plan.storing_ranks == tuple(sorted(plan.by_rank)) and len(plan.storing_ranks) == 4
    for rank in range(4):
        assert plan.nbytes(rank) == sum(t.box_nbytes(b) for t, b in plan.by_rank[rank]) > 0
    assert plan.nbytes() == sum(plan.nbytes(r) for r in range(4))
    with pytest.raises(TypeError):
        PlannedTensor("t", (1,), dtype("float32"), dtype("float32"))  # neither boxes nor columns


def test_a_fanned_out_plan_s_figures_are_its_ranks_share_of_the_whole():
    """`rank_stats` of a plan that writes some ranks (`reshard --rank`) gives those ranks exactly
    the figures of the whole plan: bytes written, read and the source files."""
    from pathlib import Path

    from hpckpt.core.geometry.plan_stats import rank_stats
    from hpckpt.core.index import CheckpointIndex, Chunk, TensorEntry

    # stored over 3 source ranks (uneven rows), planned onto 4 with replicas and a 2-D grid
    entries = []
    for name, dt, shape, _mesh, _text in TENSORS:
        if len(shape) == 0:
            chunks = [Chunk(Box((), ()), "_rank0_.safetensors", name)]
        else:
            cut = [0, shape[0] // 3, shape[0] // 3 + (shape[0] + 1) // 3, shape[0]]
            chunks = [Chunk(Box((cut[r],) + (0,) * (len(shape) - 1), (cut[r + 1] - cut[r],) + shape[1:]),
                            f"_rank{r}_.safetensors", name) for r in range(3)]
        entries.append(TensorEntry(name, dtype(dt), shape, chunks, dt))
    index = CheckpointIndex(root=Path("."), format="memory", format_version="", framework=None,
                            tensors={e.fqn: e for e in entries}, values={}, data_files=[], locator=None)
    layouts = _Layouts(_layouts())
    whole = {s.rank: s for s in rank_stats(make_plan(index, layouts, 4), index)}
    assert sorted(whole) == [0, 1, 2, 3] and any(s.source_files > 1 for s in whole.values())
    for ranks in ([0], [1, 3], [2], [3, 2, 1, 0]):
        part = rank_stats(make_plan(index, layouts, 4, ranks=ranks), index)
        assert part == [whole[r] for r in sorted(ranks)]
