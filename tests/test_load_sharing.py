"""The load's shared boxes from layouts (`LayoutWants`) are those from every rank's list of
wanted boxes (`ListedWants`, what the ranks gathered before): the same sets of holders with the
same boxes and bytes, the same bytes wanted, and for every rank the same reader of each box it
shares, whichever sets broadcast; on the live-load layouts and on seeded random ones."""

from __future__ import annotations

import numpy as np
import pytest

from hpckpt.core.geometry.layout import Mesh, TensorLayout, parse_placements
from hpckpt.core.geometry.load_sharing import LayoutWants, ListedWants
from tests.test_layout_plan import _random_layout


def _everyone(rows, world):
    """Each rank's wanted boxes, as `hpckpt.dist.load` lists them (its non-empty boxes)."""
    everyone = [[] for _ in range(world)]
    for fqn, shape, layout, itemsize in rows:
        for r in range(world):
            for box in layout.boxes(shape, r):
                if not box.is_empty:
                    everyone[r].append([fqn, list(box.offsets), list(box.sizes), box.volume * itemsize])
    return everyone


def _same(rows, world, rng):
    everyone = _everyone(rows, world)
    listed = [ListedWants(everyone, r) for r in range(world)]
    laid = [LayoutWants(rows, world, r) for r in range(world)]
    want = listed[0].shared
    assert want, "nothing shared: the case tests nothing"
    for a, b in zip(listed, laid):
        assert b.shared == want and a.shared == want
        assert b.wanted_bytes == a.wanted_bytes
    sets = sorted(want)
    for sent in (set(sets), set(), {s for s in sets if rng.random() < 0.5}):
        readers = {}
        for r, (a, b) in enumerate(zip(listed, laid)):
            got = b.mine(sent)
            assert got == a.mine(sent), (r, sent)
            assert all(r in holders for holders, _reader in got.values())
            for key, (holders, reader) in got.items():
                assert readers.setdefault(key, (holders, reader)) == (holders, reader)  # every holder agrees
        assert set(readers) == _shared_keys(everyone, sent)  # every shared box broadcast has its reader


def _shared_keys(everyone, sent):
    holders = {}
    for r, boxes in enumerate(everyone):
        for fqn, o, z, _n in boxes:
            holders.setdefault((fqn, tuple(o), tuple(z)), []).append(r)
    return {k for k, ranks in holders.items() if len(ranks) > 1 and tuple(ranks) in sent}


def test_the_live_load_layouts():
    mesh8, hsdp, grid = Mesh((8,)), Mesh((2, 4)), Mesh((4, 2))
    rows = [("emb", (13, 6), mesh8, "S0", 2), ("hsdp.a", (10, 3), hsdp, "R,S0", 4),
            ("hsdp.b", (10, 3), hsdp, "R,S0", 4), ("hsdp.c", (16, 8), hsdp, "R,S0", 2),
            ("grid", (7, 5), grid, "S0,R", 2), ("rep", (3,), mesh8, "R", 4), ("step", (), mesh8, "R", 8),
            ("tiny", (2, 2), mesh8, "S0:ceil", 8),
            ("a_rep", (3,), mesh8, "R", 4)]  # rep's size, later in the table, first by name: the tie-break
    _same([(n, s, TensorLayout(m, parse_placements(p)), i) for n, s, m, p, i in rows], 8, np.random.default_rng(0))


@pytest.mark.parametrize("seed", range(10))
def test_random_layouts(seed):
    rng = np.random.default_rng(100 + seed)
    world = int(rng.choice([4, 6, 8]))
    rows = [("replicated", (5,), TensorLayout(Mesh((world,)), parse_placements("R")), 4)]
    for t in range(int(rng.integers(3, 12))):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(s) for s in rng.integers(0, 9, size=ndim))
        layout = _random_layout(rng, world, ndim)
        rows.append((f"t{t}", shape, layout, int(rng.choice([1, 2, 4]))))
        if rng.random() < 0.3:  # a tensor of the same shape and layout: a layer of a model
            rows.append((f"t{t}b", shape, layout, rows[-1][3]))
    _same(rows, world, rng)


def test_readers_of_loads_too_large_to_pack_with_the_rank():
    """Loads of 2^61 bytes and more cannot share an integer with the rank; the other reduction
    gives the same readers (a constant added to every load changes no choice)."""
    from hpckpt.core.geometry.load_sharing import _Pattern, _Run

    layout = TensorLayout(Mesh((3, 4)), parse_placements("R,S0"))
    p = _Pattern(layout, (8, 2), "w", 5, {})
    run = _Run(p, np.arange(4))
    load = np.array([5, 3, 3, 9, 0, 7, 7, 1, 2, 2, 6, 4], np.int64)
    want = run.choose(load)
    assert want.tolist() == [4, 9, 2, 7]  # box j is held by j, j + 4, j + 8: the least load, then the lowest rank
    assert run.choose(load + (1 << 61)).tolist() == want.tolist()
    for level in (7, 1 << 61):  # all equal: the lowest rank of each box
        assert run.choose(np.full(12, level, np.int64)).tolist() == [0, 1, 2, 3]
    assert run.mine == 1 and p.mine == 1
