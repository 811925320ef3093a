"""Replica de-dup's one rule: a box several ranks hold is stored (or read) by the least-loaded of
them, largest boxes first, as HyperParallel's own de-dup does.

The offline planner (`plan.py`), the live save's global plan (`global_plan.py`) and the live load's
choice of a reader (`hpckpt.dist.load`) all place shared boxes with `least_loaded`, so a live save
writes the bytes `reshard` writes and every rank of a job computes the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_SCAN = 16  # up to this many holders a Python min is faster than building an array


def least_loaded(load: Sequence[int], shared: Iterable[tuple[Sequence[int] | np.ndarray, int]]) -> list[int]:
    """The rank chosen for each `(holders, nbytes)` of `shared`, in the order given.

    `load` is what each rank already carries (its boxes no other rank holds). Each box goes to
    the holder with the least load so far, the lowest rank among equal loads (the first in
    `holders` order when they are not ascending and there are more than 16), and adds its bytes
    to that rank's load. The caller orders `shared`: largest first, and its own tie-breaks (the
    tensor order, then where the box first appears), so that every caller is deterministic.
    """
    loads = [int(x) for x in load]
    chosen = []
    for holders, nbytes in shared:
        if len(holders) <= _SCAN:
            best = min((int(r) for r in holders), key=lambda r: (loads[r], r))
        else:
            ranks = np.asarray(holders)
            best = int(ranks[int(np.argmin([loads[r] for r in ranks.tolist()]))])
        chosen.append(best)
        loads[best] += int(nbytes)
    return chosen
