"""Load the benchmark checkpoint onto N ranks with `torch.distributed.checkpoint.load` (under torchrun).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 bench/torch_dcp_load.py \
        --size-gib 1.5 --dcp DIR [--save DIR] [--verify] [--report FILE]

Every rank allocates its Shard(0) part of the state of `engine_state.py` on the new world size
(empty DTensors on a 1-D CPU mesh, gloo) and calls `dcp.load`: PyTorch's own resharding on load.
The time inside the script is taken from a barrier before `dcp.load` to a barrier after it (the
slowest rank). With `--save DIR` the loaded state is then saved with `dcp.save` (what a reshard
to disk costs with PyTorch); `--verify` checks every loaded element against the pattern (not
timed). Rank 0 writes the per-rank times and peak RSS (`ru_maxrss`) to `--report`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_state  # noqa: E402


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gib", type=float, required=True)
    parser.add_argument("--dcp", required=True)
    parser.add_argument("--save")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--report")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world, mesh = engine_state.join_gloo_job()
    state = engine_state.local_state(args.size_gib, rank, world, mesh, empty=True)
    ready = time.perf_counter() - started

    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=args.dcp)
    own_load = time.perf_counter() - t0
    dist.barrier()
    load_seconds = time.perf_counter() - t0
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    save_seconds = None
    if args.save:
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=args.save)
        dist.barrier()
        save_seconds = time.perf_counter() - t0

    bad = []
    if args.verify:
        reference = engine_state.local_state(args.size_gib, rank, world, None)
        for fqn, want in reference.items():
            got = state[fqn]
            if isinstance(want, torch.Tensor):
                got = got.to_local() if hasattr(got, "to_local") else got
                if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                    bad.append(fqn)
            elif got != want:
                bad.append(fqn)

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "ready_s": ready, "own_load_s": own_load,
                                      "maxrss_after_load": rss_after_load, "maxrss": rss, "bad": bad})
    if rank == 0:
        failures = sorted({f for g in gathered for f in g["bad"]})
        if args.report:
            with open(args.report, "w") as f:
                json.dump({"world": world, "load_s": load_seconds, "save_s": save_seconds,
                           "verified": args.verify, "mismatches": failures, "ranks": gathered}, f, indent=1)
        if args.verify:
            print(f"verify: {len(failures)} mismatching entries {failures[:5]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort: README, "Clean exits"
    if args.verify and any(g["bad"] for g in gathered):
        sys.exit(1)


if __name__ == "__main__":
    main()
