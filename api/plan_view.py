"""What a plan's page shows (`reshard --plan --html`, and the dry runs of convert and
consolidate): the source's and the target's shard maps side by side, and per target rank the
bytes it writes and reads and the source files it opens."""

from __future__ import annotations

import numpy as np

from hpckpt.api import pipeline
from hpckpt.api.shard_map import planned_map, shard_map
from hpckpt.core.geometry.plan_stats import rank_stats
from hpckpt.core.index import CheckpointIndex


def convert_view(index: CheckpointIndex, dst, to: str | None = None, *, layout=None, rules=None,
                 select=None, dtype: str | None = None, keep_replicas: bool = False,
                 planned: tuple | None = None) -> tuple[dict, str]:
    """`plan_view` of what `api.convert` would write (its names renamed as the rules say; the
    tensors rules derive are not drawn): `(view, target format name)`. `planned`: as for `plan_view`."""
    from hpckpt.api.convert import convert_target, rename, target_format
    from hpckpt.api.options import Selection

    fmt = target_format(to, dst)
    view, _mapping, casts, _derived, _dropped = rename(index, rules, select or Selection())
    target = convert_target(fmt, view, layout, dtype=dtype, casts=casts, keep_replicas=keep_replicas)
    return plan_view(view, target, planned=planned), fmt.name


def plan_view(index: CheckpointIndex, target: pipeline.Target, names: list[str] | None = None, *,
              planned: tuple | None = None) -> dict:
    """The plan of writing `index` (the entries `names`) as `target`, as the page draws it:
    `source` and `target` shard maps, `ranks` rows `[rank, bytes written, bytes read, files]`,
    `files` (every source data file named once) and, per target rank, the indices of the files
    it opens (`touched`, flat, with `touched_start`). `planned`: the dry run's `(plan, rank
    stats)` (`WriteReport.planned`), drawn as they are; else the plan is made here."""
    if planned is not None:
        plan, stats = planned
    else:
        plan = pipeline.make_target_plan(index, target, names)
        stats = rank_stats(plan, index)
    tensors = [t.fqn for t in plan.tensors]
    target_map = planned_map(plan)
    if target.layout is not None:  # each target tensor's layout, as the options gave it
        for row in target_map["tensors"]:
            row[3] = str(target.layout.resolve(row[0], tuple(row[2])))
    files = sorted({f for s in stats for f in s.files})
    number = {f: i for i, f in enumerate(files)}
    touched = [number[f] for s in stats for f in s.files]
    starts = np.cumsum([0, *(len(s.files) for s in stats)])
    return {"source": shard_map(index, tensors), "target": target_map,
            "ranks": [[s.rank, s.bytes_written, s.bytes_read, s.source_files] for s in stats],
            "files": files, "touched": np.array(touched, np.int32), "touched_start": starts.astype(np.int32)}
