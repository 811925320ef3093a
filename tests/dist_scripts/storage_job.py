"""One plain process of a job without any process group, for tests/test_dist_fixtures.py.

    RANK=r WORLD_SIZE=n HPCKPT_JOB_ID=id python storage_job.py save CKPT COORDINATION [--timeout S]
        [--die-before-save R] [--hang-before-save R] [--die-while-writing R] [--variant K]
        [--sleep-before-save R:S]
    python storage_job.py load CKPT WORLD_SIZE_SAVED [--variant K]

`save`: this rank saves `rank_state(rank)` with `hpckpt.dist.save(..., coordination=COORDINATION,
timeout=S)`, no torch.distributed at all. `--die-before-save R`: rank R prints READY and leaves with
`os._exit(9)` without saving; `--hang-before-save R`: rank R prints READY and sleeps (the test
kills it with SIGKILL); `--die-while-writing R`: rank R leaves with `os._exit(9)` right after it
wrote its files, before reporting them. `--variant K` changes every tensor and value;
`--sleep-before-save R:S`: rank R sleeps S seconds before it calls save (a late coordinator). The other ranks print `RESULT <json>` and exit 0 on success; on
`CoordinationTimeoutError` they print `TIMEOUT after <s>s: <message>` on stderr and exit 3; any other
error: the traceback and exit 1. Every rank prints `READY` (flushed) just before it calls save.

`load`: one process, no process group, no RANK/WORLD_SIZE: loads CKPT into zeros shaped like
the union of what the ranks of a WORLD_SIZE_SAVED-rank save held, compares every tensor and value
with `rank_state`, prints `RESULT <json>` (the LoadResult) and exits 0, or prints the differences
and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import hpckpt.dist as hdist
import torch

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.float16)


def shared(variant: int = 0) -> torch.Tensor:
    return (torch.arange(12, dtype=torch.float32) * 0.25).reshape(3, 4) + variant


def own(rank: int, variant: int = 0) -> torch.Tensor:
    shape = (2 + rank, 3)
    t = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) + 100 * rank + variant
    return t.to(DTYPES[rank % len(DTYPES)])


def rank_state(rank: int, variant: int = 0) -> dict:
    """What rank `rank` saves; `variant` changes every tensor and value (a later step)."""
    return {
        "shared": shared(variant),
        f"own{rank}": own(rank, variant),
        "scalar": torch.tensor(1.5 + variant),
        "meta": {"step": 7 + variant, "tag": "storage", "betas": (0.9, 0.95)},
        "notes": {f"r{rank}": f"rank {rank} was here"},
    }


def die_while_writing() -> None:
    """Make this rank leave (os._exit(9)) right after it wrote its own files into the staging
    directory, before it reports them: a rank killed in the middle of a save. This reaches into
    `hpckpt.dist.save_commit` (there is no public hook)."""
    import importlib

    save_module = importlib.import_module("hpckpt.dist.save_commit")  # where a rank writes its own files

    original = save_module._write_own

    def write_then_die(*args, **kwargs):
        original(*args, **kwargs)
        print("WROTE", flush=True)
        os._exit(9)

    save_module._write_own = write_then_die


def result_json(result) -> dict:
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in vars(result).items()}


def save(args) -> int:
    rank = int(os.environ["RANK"])
    if args.die_before_save == rank:
        print("READY", flush=True)
        os._exit(9)
    if args.hang_before_save == rank:
        print("READY", flush=True)
        time.sleep(600)
        return 9
    if args.die_while_writing == rank:
        die_while_writing()
    if args.sleep_before_save is not None and args.sleep_before_save[0] == rank:
        time.sleep(args.sleep_before_save[1])
    state = rank_state(rank, args.variant)
    print("READY", flush=True)
    t0 = time.perf_counter()
    try:
        result = hdist.save(state, args.ckpt, coordination=args.coordination, timeout=args.timeout)
    except hdist.CoordinationTimeoutError as e:
        print(f"TIMEOUT after {time.perf_counter() - t0:.2f}s: {e}", file=sys.stderr, flush=True)
        traceback.print_exc()
        return 3
    except Exception:  # noqa: BLE001 - printed, and a distinct exit code
        traceback.print_exc()
        return 1
    print("RESULT " + json.dumps({"seconds": time.perf_counter() - t0, **result_json(result)}), flush=True)
    return 0


def load(args) -> int:
    world = args.world
    v = args.variant
    target = {"shared": torch.zeros(3, 4), "scalar": torch.tensor(0.0),
              "meta": {"step": None, "tag": None, "betas": None}, "notes": {}}
    want = {"shared": shared(v), "scalar": torch.tensor(1.5 + v)}
    for r in range(world):
        o = own(r, v)
        target[f"own{r}"] = torch.zeros_like(o)
        want[f"own{r}"] = o
        target["notes"][f"r{r}"] = None
    originals = {k: target[k] for k in want}
    try:
        result = hdist.load(target, args.ckpt)
    except Exception:  # noqa: BLE001 - printed, and a distinct exit code
        traceback.print_exc()
        return 1
    problems = []
    for name, w in want.items():
        got = target[name]
        if got is not originals[name]:
            problems.append(f"{name}: replaced, not filled in place")
        if got.dtype != w.dtype or got.shape != w.shape or not torch.equal(got, w):
            problems.append(f"{name}: got {got!r} want {w!r}")
    want_values = {("meta", "step"): 7 + v, ("meta", "tag"): "storage", ("meta", "betas"): (0.9, 0.95),
                   **{("notes", f"r{r}"): f"rank {r} was here" for r in range(world)}}
    for (a, b), w in want_values.items():
        got = target[a][b]
        if got != w or type(got) is not type(w):
            problems.append(f"{a}.{b}: got {got!r} want {w!r}")
    print("RESULT " + json.dumps(result_json(result), default=repr), flush=True)
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("save")
    s.add_argument("ckpt")
    s.add_argument("coordination")
    s.add_argument("--timeout", type=float, default=5.0)
    s.add_argument("--die-before-save", type=int, default=None)
    s.add_argument("--hang-before-save", type=int, default=None)
    s.add_argument("--die-while-writing", type=int, default=None)
    s.add_argument("--variant", type=int, default=0)
    s.add_argument("--sleep-before-save", type=lambda v: (int(v.split(":")[0]), float(v.split(":")[1])), default=None,
                   metavar="R:S")
    ld = sub.add_parser("load")
    ld.add_argument("ckpt")
    ld.add_argument("world", type=int)
    ld.add_argument("--variant", type=int, default=0)
    args = parser.parse_args()
    return save(args) if args.mode == "save" else load(args)


if __name__ == "__main__":
    sys.exit(main())
