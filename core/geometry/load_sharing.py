"""Which boxes of a live load several ranks want, and which of them reads each one it broadcasts.

A box that several ranks want (an HSDP replica, a tensor every rank holds whole) is read once and
broadcast, or read by each (`hpckpt.dist.load` decides per set of holders). Two descriptions of
the job's wants give the same answers:

- `ListedWants`: every rank's list of wanted boxes, gathered (what any rank can send: a
  HyperParallel `chunk_info`, a strided shard); an object per box of the job, so fine for
  hundreds of ranks, not for thousands;
- `LayoutWants`: one table of every tensor's layout, the same on every rank (ranks compare its
  digest, nothing else travels), from which every rank's boxes follow; the work is per distinct
  (shape, layout) and per shared box, in numpy, so 16,384 ranks plan in a fraction of a second.

Both answer `shared` (per set of holders, the boxes and bytes they share), `wanted_bytes`
(every distinct wanted box once) and `mine(sent)`: for this rank's shared boxes in the sets
chosen for broadcast, their holders and their reader. Readers are chosen as `least_loaded`
does (largest first, the holder with the fewest bytes to read so far, then the lowest rank),
starting from what each rank reads for itself: the same answer on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from hpckpt.core.geometry.assign import least_loaded
from hpckpt.core.geometry.global_plan import members
from hpckpt.core.geometry.layout import TensorLayout
from hpckpt.core.geometry.layout_plan import HolderRun, distinct_boxes

BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]  # (fqn, offsets, sizes)
Holders = tuple[int, ...]


class ListedWants:
    """From `everyone[r]`, rank r's wanted boxes as `[fqn, offsets, sizes, nbytes]`."""

    def __init__(self, everyone: Sequence[Sequence], rank: int):
        holders: dict[BoxKey, list[int]] = defaultdict(list)
        nbytes: dict[BoxKey, int] = {}
        for r, boxes in enumerate(everyone):
            for fqn, offsets, sizes, n in boxes:
                key = (fqn, tuple(offsets), tuple(sizes))
                holders[key].append(r)
                nbytes[key] = int(n)
        self._holders, self._nbytes, self._rank, self._world = holders, nbytes, rank, len(everyone)
        shared: dict[Holders, list[int]] = defaultdict(lambda: [0, 0])
        for key, ranks in holders.items():
            if len(ranks) > 1:
                shared[tuple(ranks)][0] += 1
                shared[tuple(ranks)][1] += nbytes[key]
        self.shared = {ranks: (boxes, size) for ranks, (boxes, size) in shared.items()}
        self.wanted_bytes = sum(nbytes.values())

    def mine(self, sent: set[Holders]) -> dict[BoxKey, tuple[Holders, int]]:
        holders, nbytes = self._holders, self._nbytes
        load = [0] * self._world
        broadcast = []
        for key, ranks in holders.items():
            if len(ranks) > 1 and tuple(ranks) in sent:
                broadcast.append(key)
            else:
                for r in ranks:
                    load[r] += nbytes[key]
        broadcast.sort(key=lambda k: (-nbytes[k], k))
        readers = least_loaded(load, ((holders[k], nbytes[k]) for k in broadcast))
        return {k: (tuple(holders[k]), reader) for k, reader in zip(broadcast, readers)
                if self._rank in holders[k]}


class _Pattern:
    """One distinct (shape, layout) of the table: its non-empty boxes, who wants each, the sets
    of holders of its shared boxes (`sets`: global set ids per box, -1 when one rank wants it),
    and the box this rank wants (-1: none)."""

    def __init__(self, layout: TensorLayout, shape: tuple[int, ...], name: str, rank: int,
                 set_ids: dict[Holders, int]):
        g = distinct_boxes(layout, shape, name)
        keep = np.flatnonzero(g.volume > 0)
        self.offsets, self.sizes, self.volume = g.offsets[keep], g.sizes[keep], g.volume[keep]
        self.starts, self.counts, self.holders = g.starts[keep], g.counts[keep], g.holders
        self.sets = np.full(len(keep), -1, np.int64)
        for j in np.flatnonzero(self.counts > 1).tolist():
            ranks = tuple(self.holders[self.starts[j]:self.starts[j] + self.counts[j]].tolist())
            self.sets[j] = set_ids.setdefault(ranks, len(set_ids))
        box_of = np.repeat(np.arange(len(keep)), self.counts)
        held = self.holders[members(self.starts, self.counts)]
        self.held, self.box_of = held, box_of
        at = np.flatnonzero(held == rank)
        self.mine = int(box_of[at[0]]) if len(at) else -1

    def volume_per_rank(self, world: int, boxes: np.ndarray) -> np.ndarray:
        """Elements each rank wants of this pattern's `boxes` (a mask over them)."""
        weights = np.where(boxes[self.box_of], self.volume[self.box_of], 0)
        out = np.zeros(world, np.int64)
        np.add.at(out, self.held, weights)
        return out


class LayoutWants:
    """From `rows`, `(fqn, shape, TensorLayout, itemsize)` per tensor wanted (every rank's table,
    the same), for a job of `world_size` ranks seen from `rank`. A layout's ranks are the job's."""

    def __init__(self, rows: Sequence[tuple[str, tuple[int, ...], TensorLayout, int]], world_size: int, rank: int):
        self._world, self._rank = world_size, rank
        set_ids: dict[Holders, int] = {}
        patterns: dict[tuple, _Pattern] = {}
        self._rows = []
        for fqn, shape, layout, itemsize in rows:
            shape = tuple(int(s) for s in shape)
            found = (shape, layout.placements, layout.order, layout.mesh.shape, id(layout.mesh))
            pattern = patterns.get(found)
            if pattern is None:
                pattern = patterns[found] = _Pattern(layout, shape, fqn, rank, set_ids)
            self._rows.append((fqn, pattern, int(itemsize)))
        self._sets = list(set_ids)
        boxes = np.zeros(len(self._sets), np.int64)
        nbytes = np.zeros(len(self._sets), np.int64)
        self.wanted_bytes = 0
        for _fqn, p, itemsize in self._rows:
            shared = p.sets >= 0
            np.add.at(boxes, p.sets[shared], 1)
            np.add.at(nbytes, p.sets[shared], p.volume[shared] * itemsize)
            self.wanted_bytes += int(p.volume.sum()) * itemsize
        self.shared = {ranks: (int(b), int(n)) for ranks, b, n in zip(self._sets, boxes.tolist(), nbytes.tolist())}

    def mine(self, sent: set[Holders]) -> dict[BoxKey, tuple[Holders, int]]:
        chosen = np.zeros(len(self._sets), bool)
        chosen[[i for i, ranks in enumerate(self._sets) if ranks in sent]] = True
        load = np.zeros(self._world, np.int64)
        per_pattern: dict[int, tuple[np.ndarray, list[_Run]]] = {}  # id -> (what each rank reads itself, runs)
        runs = []  # (-nbytes, fqn, row, run): a row's broadcast boxes of one size
        for r, (fqn, p, itemsize) in enumerate(self._rows):
            if id(p) not in per_pattern:
                broadcast = np.zeros(len(p.sets), bool)
                broadcast[p.sets >= 0] = chosen[p.sets[p.sets >= 0]]
                which = np.flatnonzero(broadcast)
                order = which[np.argsort(-p.volume[which], kind="stable")]
                cuts = np.flatnonzero(np.diff(p.volume[order])) + 1
                per_pattern[id(p)] = (p.volume_per_rank(self._world, ~broadcast),
                                      [_Run(p, run) for run in np.split(order, cuts)] if len(order) else [])
            own, pattern_runs = per_pattern[id(p)]
            load += own * itemsize
            runs += [(-run.volume * itemsize, fqn, r, run) for run in pattern_runs]
        runs.sort(key=lambda run: run[:2])
        found: dict[BoxKey, tuple[Holders, int]] = {}
        for neg, fqn, r, run in runs:
            readers = run.choose(load)
            load[readers] += -neg
            p = self._rows[r][1]
            if run.mine >= 0:
                j = p.mine
                key = (fqn, tuple(p.offsets[j].tolist()), tuple(p.sizes[j].tolist()))
                found[key] = (self._sets[p.sets[j]], int(readers[run.mine]))
        return found


class _Run(HolderRun):
    """A `HolderRun` of one pattern's broadcast boxes of one size, with their size and where
    this rank's box is in it (-1: not there)."""

    def __init__(self, p: _Pattern, boxes: np.ndarray):
        super().__init__(p, boxes)
        self.volume = int(p.volume[boxes[0]])
        at = np.flatnonzero(boxes == p.mine)
        self.mine = int(at[0]) if len(at) else -1
