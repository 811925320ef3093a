"""`core.geometry.assign.least_loaded`: the one replica de-dup rule the offline planner, the live
save's global plan and the live load's choice of readers share."""

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
