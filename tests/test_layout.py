"""Layout model of the resharding engine: split rules, boxes per rank, converters, inference.

Ground truth: hand-worked cases, the chunk boxes HyperParallel itself recorded in the fixtures,
numpy/torch split functions and torch DTensor's own shard geometry.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from _util import FIXTURES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import layouts_and_shapes

from hpckpt.converters import open_index
from hpckpt.core.geometry.box import Box
from hpckpt.core.errors import CorruptMetadataError, GeometryError, PathNotFoundError
from hpckpt.core.geometry.layout import (
    RULES_FILE_EXAMPLE,
    InferredLayout,
    LayoutSpec,
    Mesh,
    RaggedShard,
    Replicate,
    Shard,
    TensorLayout,
    decompose_flat_interval,
    from_tensor_map,
    infer,
    load_layout_file,
    load_rules,
    parse_mesh,
    parse_placements,
    split,
)

R = Replicate()


def B(offsets, sizes) -> Box:
    return Box(tuple(offsets), tuple(sizes))


def layout(mesh: str, placements: str, rule: str = "balanced") -> TensorLayout:
    return TensorLayout(parse_mesh(mesh), parse_placements(placements, rule))


# ---------------------------------------------------------------------------------- split rules


def test_split_hand_worked():
    assert [split(10, 4, i, "balanced") for i in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert [split(5, 4, i, "ceil") for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 0)]
    assert [split(2, 4, i, "balanced") for i in range(4)] == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert [split(0, 3, i, "ceil") for i in range(3)] == [(0, 0)] * 3


@pytest.mark.parametrize("args", [(-1, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_split_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        split(*args)
    with pytest.raises(ValueError, match="unknown split rule"):
        split(4, 2, 0, "even")


def test_split_matches_numpy_and_torch():
    torch = pytest.importorskip("torch")
    for length in range(0, 40):
        x = torch.arange(length)
        for n in range(1, 12):
            balanced = [split(length, n, i, "balanced")[1] for i in range(n)]
            ceil = [split(length, n, i, "ceil")[1] for i in range(n)]
            assert balanced == [len(a) for a in np.array_split(np.arange(length), n)]
            assert balanced == [len(t) for t in torch.tensor_split(x, n)]
            chunks = [len(t) for t in torch.chunk(x, n)] if length else []
            assert ceil == chunks + [0] * (n - len(chunks))  # torch.chunk drops empty trailing parts
            starts = [split(length, n, i, "ceil")[0] for i in range(n)]
            assert starts == [min(sum(ceil[:i]), length) for i in range(n)]


# ---------------------------------------------------------------------------------- mesh, placements


def test_mesh_coordinates_are_row_major():
    mesh = Mesh((2, 3), (10, 11, 12, 13, 14, 15))
    assert [mesh.coordinate(r) for r in mesh.ranks] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert Mesh((4,)) == Mesh((4,), (0, 1, 2, 3)) and str(mesh) == "2x3@[10, 11, 12, 13, 14, 15]"
    with pytest.raises(ValueError, match="not in mesh"):
        mesh.coordinate(0)


@pytest.mark.parametrize("shape,ranks", [((), None), ((2, 0), None), ((2,), (0, 1, 2)), ((2,), (1, 1))])
def test_mesh_rejects_impossible_shapes(shape, ranks):
    with pytest.raises(GeometryError):
        Mesh(shape, ranks)


def test_parse_mesh_and_placements():
    assert parse_mesh("2x4").shape == (2, 4) and parse_mesh("8").shape == (8,) and parse_mesh("(2, 2)").shape == (2, 2)
    assert parse_placements("R,S0") == (R, Shard(0))
    assert parse_placements("[S(1), s0:ceil]", rule="balanced") == (Shard(1), Shard(0, "ceil"))
    assert parse_placements("S0, S1:balanced", rule="ceil") == (Shard(0, "ceil"), Shard(1))
    ragged = parse_placements("Ragged(0,1;7,8,0,15),R")
    assert ragged == (RaggedShard((0, 1), (7, 8, 0, 15)), R)
    for text in ("R,S0:ceil", "Ragged(0,1;7,8,0,15),R"):  # str() round-trips
        assert ",".join(map(str, parse_placements(text))) == text


@pytest.mark.parametrize("text", ["", "R,,S0", "X", "S", "S(0", "S0:odd", "Ragged(0;)"])
def test_parse_rejects_bad_text(text):
    with pytest.raises((ValueError, GeometryError)):
        parse_placements(text)


@pytest.mark.parametrize("text", ["", "2x", "0x2", "a"])
def test_parse_mesh_rejects_bad_text(text):
    with pytest.raises(ValueError):
        parse_mesh(text)


# ---------------------------------------------------------------------------------- boxes


def test_2x2_mesh_hand_worked():
    rs0 = layout("2x2", "R,S0")
    assert rs0.all_boxes((8, 6)) == {0: [B((0, 0), (4, 6))], 1: [B((4, 0), (4, 6))],
                                      2: [B((0, 0), (4, 6))], 3: [B((4, 0), (4, 6))]}
    assert rs0.replica_groups((8, 6)) == [[0, 2], [1, 3]]
    s0s1 = layout("2x2", "S0,S1")
    assert s0s1.all_boxes((5, 3)) == {0: [B((0, 0), (3, 2))], 1: [B((0, 2), (3, 1))],
                                       2: [B((3, 0), (2, 2))], 3: [B((3, 2), (2, 1))]}
    assert s0s1.replica_groups((5, 3)) == [[0], [1], [2], [3]]


def test_same_dim_split_successively_outer_first():
    # 10 -> [0,5) [5,10) over mesh dim 0, then each in 2 over mesh dim 1 (balanced: 3+2)
    both = layout("2x2", "S0,S0")
    assert [b for bs in both.all_boxes((10,)).values() for b in bs] == [
        B((0,), (3,)), B((3,), (2,)), B((5,), (3,)), B((8,), (2,))]


def test_replicate_everywhere_and_ranks_outside():
    rr = TensorLayout(Mesh((2,), (4, 7)), (R,))
    assert rr.boxes((3, 2), 7) == [B((0, 0), (3, 2))]
    assert rr.boxes((), 4) == [B((), ())]
    assert rr.boxes((3, 2), 0) == []


def test_empty_boxes_are_returned():
    ceil = layout("4", "S0:ceil")
    assert ceil.boxes((5, 4), 3) == [B((5, 0), (0, 4))]
    assert ceil.boxes((0, 4), 1) == [B((0, 0), (0, 4))]


def test_validate_rejects_impossible_layouts():
    with pytest.raises(GeometryError, match="S1 on a 1-D"):
        layout("4", "S1").boxes((8,), 0)
    with pytest.raises(GeometryError, match="2 placements for a 1-D mesh"):
        layout("4", "R,S0")
    with pytest.raises(GeometryError, match="not divisible"):
        TensorLayout(Mesh((2,)), (RaggedShard((0,), (1, 1)),)).validate((5, 3))
    with pytest.raises(GeometryError, match="prefix"):
        RaggedShard((1,), (1, 1))
    with pytest.raises(GeometryError, match="Replicate on every other"):
        TensorLayout(Mesh((2, 2)), (RaggedShard((0,), (1, 1)), Shard(0)))
    with pytest.raises(GeometryError, match="3 units for mesh dim 0 of size 2"):
        TensorLayout(Mesh((2,)), (RaggedShard((0,), (1, 1, 1)),))
    with pytest.raises(GeometryError):
        Shard(-1)
    with pytest.raises(ValueError):
        Shard(0, "even")


def test_decompose_flat_interval_by_hand():
    # [3, 4, 5]: flat [7, 47) = rest of row (0,1), rows (0,2..3), block 1, row (2,0), part of (2,1)
    assert decompose_flat_interval((3, 4, 5), 7, 47) == [
        B((0, 1, 2), (1, 1, 3)), B((0, 2, 0), (1, 2, 5)), B((1, 0, 0), (1, 4, 5)),
        B((2, 0, 0), (1, 1, 5)), B((2, 1, 0), (1, 1, 2))]
    assert decompose_flat_interval((6, 5), 2, 4) == [B((0, 2), (1, 2))]
    assert decompose_flat_interval((6, 5), 3, 3) == []
    assert decompose_flat_interval((), 0, 1) == [B((), ())]
    with pytest.raises(ValueError):
        decompose_flat_interval((2, 2), 0, 5)


# ---------------------------------------------------------------------------------- fixtures

MESH_1D, MESH_2D = Mesh((4,)), Mesh((2, 2))
FIXTURE_LAYOUTS = {  # the m0-torch-4rank README table
    "model.embed_tokens.weight": (MESH_1D, "S0"),
    "model.layers.0.self_attn.q_proj.weight": (MESH_2D, "R,S0"),
    "model.layers.0.self_attn.o_proj.weight": (MESH_2D, "R,S1"),
    "model.layers.0.mlp.up_proj.weight": (MESH_2D, "S0,S1"),
    "model.layers.0.mlp.down_proj.weight": (MESH_1D, "S1"),
    "model.layers.0.mlp.gate_proj.weight": (MESH_1D, "S0"),
    "model.lm_head.weight": (MESH_1D, "S0:ceil"),
    "model.layers.0.mlp.experts.w1": (MESH_1D, "Ragged(0,1;7,8,0,15)"),
    "model.norm.weight": (MESH_2D, "R,R"),
    "model.rotary_emb.inv_freq": (MESH_1D, "R"),
    "model.position_ids": (MESH_1D, "R"),
    "optimizer.state.0.step": (MESH_1D, "R"),
    "optimizer.state.0.exp_avg": (MESH_1D, "S0"),
    "optimizer.state.1.step": (MESH_1D, "R"),
    "optimizer.state.1.exp_avg_sq": (MESH_1D, "S0"),
}


@pytest.fixture(scope="module")
def m0_index():
    return open_index(FIXTURES / "m0-torch-4rank")


@pytest.mark.parametrize("name", ["m0-torch-4rank", "legacy-torch-4rank"])
def test_fixture_chunk_boxes_reproduced(name):
    index = open_index(FIXTURES / name)
    checked = 0
    for fqn, entry in index.tensors.items():
        if fqn not in FIXTURE_LAYOUTS:
            continue
        mesh, text = FIXTURE_LAYOUTS[fqn]
        ours = TensorLayout(mesh, parse_placements(text)).unique_boxes(entry.shape)
        saved = [c.box for c in entry.chunks]
        assert set(ours) == set(saved), fqn
        assert len(ours) == len(saved), fqn  # de-dup keeps each replicated box once
        checked += 1
    assert checked == len(index.tensors)


def test_fixture_ragged_boxes_in_rank_order(m0_index):
    entry = m0_index.tensors["model.layers.0.mlp.experts.w1"]
    ragged = TensorLayout(MESH_1D, (RaggedShard((0, 1), (7, 8, 0, 15)),))
    per_rank = ragged.all_boxes(entry.shape)
    assert per_rank[2] == []  # 0 units: no chunk at all, as in the fixture
    assert [b for r in range(4) for b in per_rank[r]] == [c.box for c in entry.chunks]
    assert ragged.replica_groups(entry.shape) == [[0], [1], [2], [3]]


def test_infer_on_fixture(m0_index):
    got = {fqn: infer(e.shape, [c.box for c in e.chunks], 4) for fqn, e in m0_index.tensors.items()}
    assert str(got["model.embed_tokens.weight"]) == "S0/4 even"
    assert str(got["model.layers.0.mlp.gate_proj.weight"]) == "S0/4 balanced"
    assert str(got["model.lm_head.weight"]) == "S0/4 ceil"
    assert str(got["model.layers.0.self_attn.q_proj.weight"]) == "S0/2 even"
    assert got["model.layers.0.mlp.up_proj.weight"] == InferredLayout("sharded", (0, 1), (2, 2), ("even", "even"))
    assert str(got["model.layers.0.mlp.experts.w1"]) == "irregular (ragged)"
    for fqn in ("model.norm.weight", "optimizer.state.0.step", "model.position_ids"):
        assert got[fqn].kind == "replicated"
    lm_head = m0_index.tensors["model.lm_head.weight"]
    again = got["model.lm_head.weight"].to_layout().unique_boxes(lm_head.shape)
    assert again == [c.box for c in lm_head.chunks]


def test_infer_edge_cases():
    assert infer((4,), []) is None
    assert infer((4,), [B((2,), (3,))]) is None  # outside the tensor
    assert infer((4,), [B((0,), (3,)), B((2,), (2,))]) == InferredLayout("irregular", detail="unknown")
    assert infer((4,), [B((0,), (2,))]) == InferredLayout("irregular", detail="unknown")  # a gap
    # balanced 10 -> [S0, S0] on 2x2 is 3,2,3,2: no single rule gives that; 1-D it is flat intervals
    assert infer((10,), layout("2x2", "S0,S0").unique_boxes((10,))).detail == "ragged"
    assert infer((2, 10), layout("2x2", "S1,S1").unique_boxes((2, 10))).detail == "unknown"
    # without a world size, merged empty parts count as one
    assert str(infer((5, 4), layout("8", "S0:ceil").unique_boxes((5, 4)))) == "S0/6 even"
    assert str(infer((5, 4), layout("8", "S0:ceil").unique_boxes((5, 4)), world_size=8)) == "S0/8 even"
    assert infer((3,), [B((0,), (3,))]).to_layout().unique_boxes((3,)) == [B((0,), (3,))]


# ---------------------------------------------------------------------------------- torch DTensor


def test_ceil_shards_match_torch_dtensor_geometry():
    pytest.importorskip("torch")
    try:
        from torch.distributed.tensor import Replicate as TR
        from torch.distributed.tensor import Shard as TS
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as dtensor_box
    except ImportError:
        pytest.skip("this torch has no DTensor shard geometry helper")
    cases = [((2, 2), ("S0", "S0")), ((2, 2), ("S0", "S1")), ((2, 3), ("S1", "R")), ((3, 2), ("S0", "S0")),
             ((2, 2, 2), ("S1", "S0", "S1")), ((8,), ("S0",)), ((2, 4), ("R", "S0"))]
    for mesh_shape, tokens in cases:
        ours = TensorLayout(Mesh(mesh_shape), tuple(Replicate() if t == "R" else Shard(int(t[1]), "ceil") for t in tokens))
        theirs = [TR() if t == "R" else TS(int(t[1])) for t in tokens]
        for shape in [(5, 3), (7, 1), (1, 9), (0, 4), (13, 6), (2, 2)]:
            for rank, (box,) in ours.all_boxes(shape).items():
                sizes, offsets = dtensor_box(shape, mesh_shape, list(ours.mesh.coordinate(rank)), theirs)
                assert box.sizes == tuple(sizes), (mesh_shape, tokens, shape, rank)
                if not box.is_empty:  # torch puts empty shards at offset `len`, HP just after the parent
                    assert box.offsets == tuple(offsets), (mesh_shape, tokens, shape, rank)


# ---------------------------------------------------------------------------------- tensor_map


def test_from_tensor_map_counts_mesh_dims_from_the_right():
    mesh = Mesh((2, 4))
    cases = {
        (1, -1): (Shard(0), R),   # 1 = mesh dim 0 (size 2)
        (0, -1): (R, Shard(0)),   # 0 = the last mesh dim (size 4)
        (-1, 1): (Shard(1), R),
        (0, 1): (Shard(1), Shard(0)),
        (-1, -1): (R, R),
        ((1, 0), -1): (Shard(0), Shard(0)),
    }
    for tensor_map, placements in cases.items():
        ours = from_tensor_map((2, 4), tensor_map)
        assert ours == TensorLayout(mesh, placements), tensor_map
        assert ours.all_boxes((16, 8)) == TensorLayout(mesh, placements).all_boxes((16, 8))


def test_from_tensor_map_tuple_order_and_options():
    # (0, 1): split over the size-4 mesh dim first (outermost), then over the size-2 one
    inner_first = from_tensor_map((2, 4), ((0, 1),))
    assert inner_first.order == (1, 0)
    assert inner_first.boxes((16,), 1) == [B((4,), (2,))]  # coordinate (0, 1): part 1 of 4, then part 0 of 2
    assert inner_first.boxes((16,), 4) == [B((2,), (2,))]  # coordinate (1, 0)
    assert sorted(b.offsets for bs in inner_first.all_boxes((16,)).values() for b in bs) == [(2 * i,) for i in range(8)]
    with_ranks = from_tensor_map((2,), (0,), rank_list=(4, 6), uneven_mesh_dims=(0,))
    assert with_ranks == TensorLayout(Mesh((2,), (4, 6)), (Shard(0, "ceil"),))
    for bad in ((2, -1), (0, 0), ((0, 0),)):
        with pytest.raises(GeometryError):
            from_tensor_map((2, 4), bad)


# ---------------------------------------------------------------------------------- .layout files


def _param(device_matrix, tensor_map, full_shape, rank_list=None):
    return {"device_matrix": device_matrix, "tensor_map": tensor_map, "interleaved_parallel": False,
            "alias_name": ["dp", "tp"][-len(device_matrix):], "rank_list": rank_list or list(range(math.prod(device_matrix))),
            "type": "Float32", "full_shape": full_shape}


def _rank_view():
    return {
        "embed.weight": _param([2, 2], [1, -1], [8, 6]),
        "proj.weight": _param([2, 2], [[1, 0], -1], [8, 6]),
        "bias": {"type": "Float32", "full_shape": [6]},
    }


def test_load_layout_files_merges_ranks(tmp_path):
    for r in range(4):
        (tmp_path / f"rank{r}.layout").write_text(json.dumps({str(r): _rank_view()}))
    layouts = load_layout_file(tmp_path)
    assert layouts == load_layout_file(sorted(tmp_path.glob("*.layout")))
    assert layouts["embed.weight"] == TensorLayout(Mesh((2, 2)), (Shard(0), R))
    assert layouts["proj.weight"] == TensorLayout(Mesh((2, 2)), (Shard(0), Shard(0)))
    assert layouts["bias"] == TensorLayout(Mesh((4,)), (R,))
    spec = LayoutSpec.from_layout_files(tmp_path)
    assert spec.resolve("embed.weight", (8, 6)) == layouts["embed.weight"]
    assert spec.resolve("unknown.weight", (3,)) == TensorLayout(Mesh((4,)), (R,))
    with pytest.raises(GeometryError, match="says shape"):
        spec.resolve("embed.weight", (8, 7))


def test_load_layout_files_errors(tmp_path):
    a, b = tmp_path / "a.layout", tmp_path / "b.layout"
    a.write_text(json.dumps({"0": _rank_view(), "1": _rank_view()}))
    b.write_text(json.dumps({"1": _rank_view()}))
    with pytest.raises(CorruptMetadataError, match="rank 1 appears in both"):
        load_layout_file([a, b])
    other = _rank_view()
    other["embed.weight"]["tensor_map"] = [-1, 0]
    b.write_text(json.dumps({"2": other}))
    with pytest.raises(CorruptMetadataError, match="gives embed.weight the layout"):
        load_layout_file([a, b])
    for text in ("{", "[1]", '{"x": {}}', '{"0": {"w": {"device_matrix": [2], "tensor_map": [0, 0], "full_shape": [4]}}}'):
        b.write_text(text)
        with pytest.raises(CorruptMetadataError):
            load_layout_file(b)
    b.write_text(json.dumps({"0": {"w": _param([4], [0], [6, 2]) | {"interleaved_parallel": True}}}))
    with pytest.raises(GeometryError, match="interleaved"):
        load_layout_file(b)
    b.write_text(json.dumps({"0": {"w": _param([4], [1, -1], [6, 2])}}))
    with pytest.raises(GeometryError, match="names no dim"):
        load_layout_file(b)
    with pytest.raises(PathNotFoundError):
        load_layout_file(tmp_path / "missing.layout")


# ---------------------------------------------------------------------------------- TOML rules


def test_documented_rules_file(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text(RULES_FILE_EXAMPLE)
    assert load_rules(path) == [
        ("*.embed_tokens.weight", (Shard(0), R)),
        (r"re:model\.layers\.\d+\.mlp\..*", (R, Shard(1, "ceil"))),
        ("*.lm_head.weight", (Shard(1, "ceil"), Shard(0, "ceil"))),
        ("*norm.weight", (R, R)),
    ]
    spec = LayoutSpec.from_toml(path)
    mesh = Mesh((2, 4))
    assert spec.resolve("model.embed_tokens.weight", (12, 4)) == TensorLayout(mesh, (Shard(0), R))
    assert spec.resolve("model.layers.0.mlp.up_proj.weight", (8, 4)) == TensorLayout(mesh, (R, Shard(1, "ceil")))
    assert spec.resolve("model.layers.0.mlp.up_proj.bias", (8,)) == TensorLayout(mesh, (R, R))  # S1 on 1-D -> R
    assert spec.resolve("model.layers.10.self_attn.q_proj.weight", (8, 4)) == TensorLayout(mesh, (R, Shard(0)))
    assert spec.resolve("model.norm.weight", (6,)) == TensorLayout(mesh, (R, R))
    assert spec.resolve("optimizer.state.0.step", ()) == TensorLayout(mesh, (R, R))  # 0-d: always replicated
    assert LayoutSpec.from_toml(path, mesh=Mesh((2, 2))).mesh == Mesh((2, 2))


@pytest.mark.parametrize("text,error", [
    ('mesh = "2"\ndefault = "S0"\nsplit = "odd"', "unknown split rule"),
    ('mesh = "2"\nmeshes = 3', "unknown key"),
    ('mesh = "2"\n[[rule]]\nplacements = "S0"', "exactly one of"),
    ('mesh = "2"\n[[rule]]\nmatch = "*"\nregex = "x"\nplacements = "S0"', "exactly one of"),
    ('mesh = "2"\n[[rule]]\nregex = "("\nplacements = "S0"', "bad regex"),
    ('mesh = "2"\n[[rule]]\nmatch = "*"\nplacements = "S0"\ncolor = "x"', "unknown key"),
    ('mesh = "2"\n[[rule]]\nmatch = "*"\nplacements = 3', "must be a string"),
    ('default = "S0"', "no 'mesh'"),
    ("mesh = [", "not valid TOML"),
])
def test_rules_file_errors(tmp_path, text, error):
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        LayoutSpec.from_toml(path)


def test_rules_placement_count_checked_early(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('mesh = "2x2"\n[[rule]]\nmatch = "*"\nplacements = "S0"')
    with pytest.raises(GeometryError, match="1 placements for a 2-D mesh"):
        LayoutSpec.from_toml(path)
    with pytest.raises(PathNotFoundError):
        load_rules(tmp_path / "nope.toml")


def test_world_size_spec_is_fsdp_style():
    spec = LayoutSpec.for_world_size(4, "ceil")
    assert spec.resolve("w", (5, 3)) == TensorLayout(Mesh((4,)), (Shard(0, "ceil"),))
    assert spec.resolve("step", ()) == TensorLayout(Mesh((4,)), (R,))
    assert spec.resolve("empty", (0, 3)) == TensorLayout(Mesh((4,)), (R,))
    with pytest.raises(ValueError):
        LayoutSpec.for_world_size(0)
    with pytest.raises(ValueError):
        LayoutSpec()


# ---------------------------------------------------------------------------------- properties


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts_and_shapes())
def test_boxes_tile_the_tensor_exactly(case):
    lay, shape = case
    per_rank = lay.all_boxes(shape)
    cover = np.zeros(shape, dtype=np.int64)
    for box in lay.unique_boxes(shape):
        assert box.inside(shape)
        cover[box.slices()] += 1
    assert (cover == 1).all()  # no gap, no overlap: distinct boxes never intersect
    sharded_dims = [k for k, p in enumerate(lay.placements) if not isinstance(p, Replicate)]
    by_key: dict[tuple, list] = {}
    for rank, boxes in per_rank.items():  # ranks differing only on Replicate mesh dims are replicas
        key = tuple(lay.mesh.coordinate(rank)[k] for k in sharded_dims)
        assert by_key.setdefault(key, boxes) == boxes
    groups = lay.replica_groups(shape)
    assert sorted(r for g in groups for r in g) == sorted(lay.mesh.ranks)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9), st.integers(0, 2), st.sampled_from(["balanced", "ceil"]),
       st.integers(1, 3))
def test_infer_recovers_1d_shard_layouts(length, n, dim, rule, ndim):
    shape = tuple(length if d == min(dim, ndim - 1) else 3 for d in range(ndim))
    d = min(dim, ndim - 1)
    lay = TensorLayout(Mesh((n,)), (Shard(d, rule),))
    got = infer(shape, lay.unique_boxes(shape), world_size=n)
    if n == 1 or length == 0:
        assert got == InferredLayout("replicated")
        return
    other = "ceil" if rule == "balanced" else "balanced"
    same = all(split(length, n, i, rule) == split(length, n, i, other) for i in range(n))
    assert got == InferredLayout("sharded", (d,), (n,), ("even" if same else rule,))
    assert got.to_layout().unique_boxes(shape) == lay.unique_boxes(shape)
