"""Strided reads (transposed and permuted views, sub-regions of them) at every read budget.

A permuted view is dense like a C-ordered one, so a reader that checks density alone copies the
bytes in storage order: the view's order is what must come out.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hpckpt.core.io.read import OpenFiles, _read_strided


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    base = np.random.default_rng(0).standard_normal((37, 23, 5)).astype(np.float32)
    path = tmp_path_factory.mktemp("strided") / "data.bin"
    path.write_bytes(b"xx" + base.tobytes())  # an unaligned start, as in a .ckpt
    return base, path


def read(path, view, base, budget):
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    out = np.empty(view.shape, np.float32)
    with OpenFiles() as files:
        _read_strided(files.fd(path), path, 2 + offset, view.shape, tuple(s // 4 for s in view.strides), 4,
                      np.dtype("<f4"), out, budget)
    return out


@pytest.mark.parametrize("perm", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("budget", [4, 64, 1000, 10**6])
def test_permuted_views_and_their_regions(stored, perm, budget):
    base, path = stored
    view = base.transpose(perm)
    assert np.array_equal(read(path, view, base, budget), view)
    region = view[3:9, 1:4, 2:3]
    assert np.array_equal(read(path, region, base, budget), region)
