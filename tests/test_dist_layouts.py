"""`hdist.sharded`: a local tensor with the layout it was cut by, in either framework's form."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hpckpt.dist as hdist
from hpckpt.core import errors
from hpckpt.core.geometry.box import Box
from hpckpt.core.errors import GeometryError
from hpckpt.dist.frameworks import torch_tensors
from hpckpt.dist.shards import shards_of


def test_mesh_placements_and_tensor_map_give_the_same_boxes():
    by_placements = hdist.sharded(torch.zeros(1, 10), (4, 10), mesh=(2, 4), placements="R,S0")
    by_map = hdist.sharded(torch.zeros(1, 10), (4, 10), device_matrix=(2, 4), tensor_map=(0, -1))
    for rank in range(8):
        a = shards_of("w", by_placements, torch_tensors, rank).pieces[0][0]
        b = shards_of("w", by_map, torch_tensors, rank).pieces[0][0]
        assert a == b == Box((rank % 4, 0), (1, 10))


def test_the_split_rule_and_rank_list_are_the_layouts():
    balanced = hdist.sharded(torch.zeros(3, 2), (10, 2), mesh=(4,), placements="S0")
    ceil = hdist.sharded(torch.zeros(3, 2), (10, 2), mesh=(4,), placements="S0", split="ceil")
    assert shards_of("w", balanced, torch_tensors, 0).pieces[0][0] == Box((0, 0), (3, 2))
    assert shards_of("w", ceil, torch_tensors, 2).pieces[0][0] == Box((6, 0), (3, 2))
    with pytest.raises(GeometryError, match="local tensor is \\[3, 2\\].*box \\[2, 2\\]"):
        shards_of("w", balanced, torch_tensors, 3)
    reversed_ranks = hdist.sharded(torch.zeros(5, 2), (10, 2), mesh=(2,), placements="S0", rank_list=(7, 3))
    assert shards_of("w", reversed_ranks, torch_tensors, 7).pieces[0][0] == Box((0, 0), (5, 2))
    assert shards_of("w", reversed_ranks, torch_tensors, 0).pieces == []  # not in the mesh: holds nothing


def test_a_layout_is_given_once_and_must_fit():
    with pytest.raises(ValueError, match="give the layout once"):
        hdist.sharded(torch.zeros(1), (4,), mesh=(4,), placements="S0", device_matrix=(4,), tensor_map=(0,))
    with pytest.raises(ValueError, match="needs placements"):
        hdist.sharded(torch.zeros(1), (4,), mesh=(4,))
    with pytest.raises(GeometryError):
        hdist.sharded(torch.zeros(1), (4,), mesh=(4,), placements="S1")  # a dim the tensor lacks


def test_a_mindspore_parameter_is_wrapped_and_filled_in_place(tmp_path):
    mindspore = pytest.importorskip("mindspore")
    from hpckpt.dist.frameworks import mindspore_tensors

    full = np.arange(24, dtype=np.float32).reshape(8, 3)
    hdist.save({"w": torch.from_numpy(full)}, tmp_path / "ck")
    param = mindspore.Parameter(mindspore.Tensor(np.zeros((2, 3), np.float32)), name="w")
    wrapped = hdist.sharded(param, (8, 3), device_matrix=(4,), tensor_map=(0,))
    hdist.load({"w": wrapped}, tmp_path / "ck")  # one rank (rank 0): the first quarter of the rows
    assert np.array_equal(mindspore_tensors.to_numpy(param, copy=True), full[:2])


def test_load_check_names_a_box_that_differs_from_the_checkpoint(tmp_path):
    """`hpckpt run load --check`'s comparison: a loaded state passes, one changed element fails
    (exit 23), named; read a block of rows at a time (a tiny block forces many)."""
    from hpckpt.converters import open_index
    from hpckpt.core.geometry.layout import LayoutSpec
    from hpckpt.dist.jobs import load_job, states

    hdist.save({"w": torch.arange(40, dtype=torch.float32).reshape(10, 4), "lr": 0.5}, tmp_path / "ck")
    state, pieces = states.empty_state(open_index(tmp_path / "ck"), LayoutSpec.for_world_size(1), 0, "torch")
    hdist.load(state, tmp_path / "ck")
    small = load_job.CHECK_TILE_BYTES
    load_job.CHECK_TILE_BYTES = 16  # one row a block
    try:
        assert load_job.check(tmp_path / "ck", state, pieces, torch_tensors, 0) == \
            {"checked_boxes": 1, "checked_bytes": 160, "checked_values": 1}
        state["w"].local[9, 3] += 1  # the last row's last element
        with pytest.raises(errors.CheckFailedError, match="rank 0: w box \\[10, 4\\] at \\[0, 0\\] differs") as info:
            load_job.check(tmp_path / "ck", state, pieces, torch_tensors, 0)
        assert info.value.exit_code == 23
        state["w"].local[9, 3] -= 1
        state["lr"] = 0.25
        with pytest.raises(errors.CheckFailedError, match="value lr is 0.25, the checkpoint holds 0.5"):
            load_job.check(tmp_path / "ck", state, pieces, torch_tensors, 0)
    finally:
        load_job.CHECK_TILE_BYTES = small
