"""`core.geometry.assign.least_loaded`: the one balanced assignment the offline planner, the live
save's global plan, the live load's choice of readers and `run reshard`'s worker shares share."""

from __future__ import annotations

import numpy as np
import pytest

from hpckpt.core.geometry.assign import least_loaded


def test_each_box_goes_to_the_least_loaded_holder_and_adds_to_its_load():
    # rank 0 already carries 10 bytes: the first box goes to rank 1, the next to rank 0 (10 < 1+12)
    assert least_loaded([10, 1, 0], [([0, 1], 12), ([0, 1], 5), ([0, 1], 5)]) == [1, 0, 1]


def test_equal_loads_go_to_the_lowest_rank_whatever_the_holders_order():
    assert least_loaded([0, 0, 0, 0], [([3, 1, 2], 4)]) == [1]
    assert least_loaded([0] * 40, [(list(range(39, -1, -1)), 4)]) == [39]  # over 16 holders: first in order
    assert least_loaded([0] * 40, [(np.arange(40), 4)]) == [0]


def test_zero_byte_boxes_still_spread_by_rank_and_never_change_loads():
    assert least_loaded([0, 0], [([0, 1], 0), ([0, 1], 0), ([1, 0], 7), ([0, 1], 1)]) == [0, 0, 0, 1]


def test_the_answer_is_a_function_of_its_inputs_and_the_loads_are_not_touched():
    load = [3, 1, 4, 1, 5]
    shared = [([0, 1, 2, 3, 4], n) for n in (9, 2, 6, 5, 3, 5)]
    first = least_loaded(load, shared)
    assert least_loaded(load, iter(shared)) == first == [1, 3, 0, 3, 2, 4]
    assert load == [3, 1, 4, 1, 5]


@pytest.mark.parametrize("holders", [[2], np.array([2])])
def test_a_single_holder_is_chosen(holders):
    assert least_loaded([100, 0, 50], [(holders, 1)]) == [2]


def test_many_holders_take_the_array_path_with_the_same_rule():
    rng = np.random.default_rng(0)
    load = rng.integers(0, 5, 64).tolist()
    shared = [(np.sort(rng.choice(64, size=int(rng.integers(2, 40)), replace=False)), int(rng.integers(0, 9)))
              for _ in range(200)]
    loads, expected = list(load), []
    for holders, nbytes in shared:
        best = min(holders.tolist(), key=lambda r: (loads[r], r))
        expected.append(best)
        loads[best] += nbytes
    assert least_loaded(load, shared) == expected


def test_with_counts_equal_loads_go_to_the_holder_with_fewer_boxes_first():
    # without counts every zero-byte box lands on rank 0; with them they are dealt out in turn
    assert least_loaded([0, 0], [([0, 1], 0)] * 4) == [0, 0, 0, 0]
    assert least_loaded([0, 0], [([0, 1], 0)] * 4, counts=[0, 0]) == [0, 1, 0, 1]
    assert least_loaded([0, 0, 0], [([0, 1, 2], 0)], counts=[2, 1, 1]) == [1]
    assert least_loaded([5, 0], [([0, 1], 1)], counts=[0, 9]) == [1]  # the load decides first


def test_with_counts_many_holders_keep_the_same_rule_and_the_holders_order_on_full_ties():
    holders = list(range(39, -1, -1))
    assert least_loaded([0] * 40, [(holders, 0)], counts=[1] * 39 + [0]) == [39]
    assert least_loaded([0] * 40, [(holders, 0)], counts=[0] * 40) == [39]  # over 16 holders: first in order
    assert least_loaded([0] * 40, [(np.arange(40), 0)] * 3, counts=[0] * 40) == [0, 1, 2]


def test_counts_are_not_touched():
    counts = [0, 0, 0]
    assert least_loaded([0, 0, 0], [([0, 1, 2], 3)] * 3, counts=counts) == [0, 1, 2]
    assert counts == [0, 0, 0]


def test_with_counts_both_paths_follow_load_then_boxes_then_rank():
    rng = np.random.default_rng(1)
    load = rng.integers(0, 3, 48).tolist()
    counts = rng.integers(0, 3, 48).tolist()
    shared = [(np.sort(rng.choice(48, size=int(rng.integers(1, 48)), replace=False)), int(rng.integers(0, 3)))
              for _ in range(300)]
    loads, boxes, expected = list(load), list(counts), []
    for holders, nbytes in shared:
        best = min(holders.tolist(), key=lambda r: (loads[r], boxes[r], r))
        expected.append(best)
        loads[best] += nbytes
        boxes[best] += 1
    assert least_loaded(load, shared, counts=counts) == expected
