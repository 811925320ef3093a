"""Every HyperParallel fixture (written by HyperParallel itself) rebuilds bit-exactly."""

from __future__ import annotations

import pytest
from _util import FIXTURE_NAMES, FIXTURES, assert_bit_equal, expected_tensors, expected_values

from hpckpt.converters import open_index
from hpckpt.core.io.read import OpenFiles, read_box


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_rebuilds_every_tensor_bit_exactly(name):
    fixture = FIXTURES / name
    index = open_index(fixture)
    expected = expected_tensors(fixture)
    assert set(index.tensors) == set(expected)
    with OpenFiles() as files:
        for fqn, entry in index.tensors.items():
            assert entry.shape == expected[fqn].shape, fqn
            assert_bit_equal(read_box(index, entry, files=files), expected[fqn], fqn)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_values_keep_value_and_python_type(name):
    fixture = FIXTURES / name
    index = open_index(fixture)
    expected = expected_values(fixture)
    assert set(index.values) == set(expected)
    for fqn, want in expected.items():
        got = index.decode_value(fqn)
        assert type(got).__name__ == want["type"], fqn
        if isinstance(got, tuple):
            got = list(got)
        assert got == want["value"], fqn


@pytest.mark.parametrize(
    ("name", "fmt", "framework", "world"),
    [
        ("legacy-torch-4rank", "hyperparallel-legacy", "torch", 4),
        ("legacy-torch-4rank-rankLocal", "hyperparallel-legacy", "torch", 4),
        ("m0-torch-4rank", "hyperparallel", "torch", 4),
        ("m0-torch-4rank-rankLocal", "hyperparallel", "torch", 4),
        ("m0-mindspore-1rank", "hyperparallel", "mindspore", 1),
        ("m0-mindspore-1rank-noDist", "hyperparallel", "mindspore", 1),
    ],
)
def test_fixture_format_is_detected(name, fmt, framework, world):
    index = open_index(FIXTURES / name)
    assert (index.format, index.framework, index.world_size) == (fmt, framework, world)
