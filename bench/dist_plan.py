"""Global planning of `hpckpt.dist.save` at scale, in one process: 64 simulated ranks, 10,000 tensors.

    python bench/dist_plan.py --ranks 64 --tensors 10000 --repeat 3 --report FILE

The job's state: 2/3 of the tensors are matrices split Shard(0) over every rank (torch.chunk rule,
rows uneven: 4096 + i % 61 rows, so the tail ranks hold fewer rows), 1/3 are small vectors every
rank holds whole (replicated: norms, biases; stored once by the balanced de-dup). Per rank, as
`hpckpt.dist.save` does it:
  build      `LocalPlan.build(rank, rows)` for each of the 64 ranks (the sum over ranks; one
             rank pays 1/64 of it in a real job),
  to_json    `plan.to_json()` + `json.dumps` (what the gather pickles and sends),
  from_json  `json.loads` + `LocalPlan.from_json` for all 64 (what every rank does after the gather),
  digest     `plan.digest()` for all 64 (the plan-cache key part; each rank does its own),
  global     `build_global_plan(plans, dedup="balanced")` (every rank does this once on a miss),
  rank plan  `global_plan.plan([0])` (the Plan of the boxes rank 0 writes).
Best of `--repeat` for each part; the JSON size is the sum over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_state  # noqa: E402

from hpckpt.core.geometry.box import Box  # noqa: E402
from hpckpt.core.geometry.global_plan import LocalPlan, build_global_plan  # noqa: E402


def tensors_of(n_tensors: int):
    out = []
    for i in range(n_tensors):
        if i % 3 == 2:
            out.append((f"layers.{i // 3}.norm.weight", "float32", (1024 + i % 7,), False))
        else:
            out.append((f"layers.{i // 3}.w{i % 3}", "bfloat16" if i % 2 else "float32", (4096 + i % 61, 1024), True))
    return out


def rank_rows(tensors, rank: int, world: int):
    rows = []
    for fqn, dt, shape, sharded in tensors:
        if sharded:
            lo, hi = engine_state.rows_of(rank, world, shape[0])
            boxes = [Box((min(lo, shape[0]), 0), (hi - lo, shape[1]))]
        else:
            boxes = [Box((0,), shape)]
        rows.append((fqn, dt, shape, boxes))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--report")
    args = parser.parse_args()
    tensors = tensors_of(args.tensors)
    rows = [rank_rows(tensors, r, args.ranks) for r in range(args.ranks)]  # the state itself, untimed
    best: dict[str, float] = {}
    runs = []
    info = {}
    for _ in range(args.repeat):
        t = {}
        t0 = time.perf_counter()
        plans = [LocalPlan.build(r, rows[r]) for r in range(args.ranks)]
        t["build"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        wire = [json.dumps(p.to_json(), separators=(",", ":")) for p in plans]
        t["to_json"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = [LocalPlan.from_json(json.loads(w)) for w in wire]
        t["from_json"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        digests = [p.digest() for p in back]
        t["digest"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        gp = build_global_plan(back, dedup="balanced")
        t["global"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        mine = gp.plan([0])
        t["rank_plan"] = time.perf_counter() - t0
        runs.append(t)
        for k, v in t.items():
            best[k] = min(best.get(k, v), v)
        info = {"json_bytes": sum(len(w) for w in wire), "boxes_gathered": int(sum(len(p.boxes) for p in back)),
                "boxes_stored": int(len(gp.tid)), "rank0_boxes": sum(len(pt.boxes) for pt in mine.tensors),
                "distinct_digests": len(set(digests))}
    out = {"ranks": args.ranks, "tensors": args.tensors, "repeat": args.repeat, "best": best, "runs": runs, **info}
    print(json.dumps(out["best"]), json.dumps(info), flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
