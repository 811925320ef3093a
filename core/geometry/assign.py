"""The one balanced assignment: largest first, each piece of work to the least-loaded of the ranks
that may take it. Replica de-dup is its main use: a box several ranks hold is stored (or read) by
the least-loaded of them, as HyperParallel's own de-dup does.

The offline planner (`plan.py`), the live save's global plan (`global_plan.py`), the live load's
choice of a reader (`hpckpt.dist.load`) and `hpckpt run reshard`'s shares of target ranks per
worker (`hpckpt.dist.jobs.reshard_job`) all place with `least_loaded`, so a live save writes the
bytes `reshard` writes and every rank of a job computes the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

_SCAN = 16  # up to this many holders a Python min is faster than building an array


def least_loaded(load: Sequence[int], shared: Iterable[tuple[Sequence[int] | np.ndarray, int]], *,
                 counts: Sequence[int] | None = None) -> list[int]:
    """The rank chosen for each `(holders, nbytes)` of `shared`, in the order given.

    `load` is what each rank already carries (its boxes no other rank holds). Each box goes to
    the holder with the least load so far and adds its bytes to that rank's load. Ties: with
    `counts` (how many boxes each rank already carries, one more per choice), the holder with
    fewer boxes, so that boxes of no bytes are still spread; then the lowest rank (the first in
    `holders` order when they are not ascending and there are more than 16). The caller orders
    `shared`: largest first, and its own tie-breaks (the tensor order, then where the box first
    appears), so that every caller is deterministic. `load` and `counts` are not changed.
    """
    loads = [int(x) for x in load]  # read per box on the Python path: list indexing is cheapest
    loads_np = np.array(loads, np.int64)  # the same loads, gathered at once for many holders
    boxes = None if counts is None else [int(x) for x in counts]
    boxes_np = None if counts is None else np.array(boxes, np.int64)
    chosen = []
    for holders, nbytes in shared:
        if len(holders) <= _SCAN:
            few = holders.tolist() if isinstance(holders, np.ndarray) else [int(r) for r in holders]
            if boxes is None:
                best = min(few, key=lambda r: (loads[r], r))
            else:
                best = min(few, key=lambda r: (loads[r], boxes[r], r))
        else:  # argmin keeps the first of equals: the holders' order
            ranks = np.asarray(holders)
            held = loads_np[ranks]
            if boxes_np is None:
                best = int(ranks[int(np.argmin(held))])
            else:
                least = ranks[held == held.min()]
                best = int(least[int(np.argmin(boxes_np[least]))])
        chosen.append(best)
        loads[best] += int(nbytes)
        loads_np[best] += int(nbytes)
        if boxes is not None:
            boxes[best] += 1
            boxes_np[best] += 1
    return chosen
