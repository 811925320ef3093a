"""One msrun job that checks `hpckpt.dist.frameworks.mindspore_tensors.Comm` on the CPU backend,
for tests/test_dist_mindspore_comm.py.

    msrun --worker_num=N --local_worker_num=N --master_addr=127.0.0.1 --master_port=P --join=True
        --log_dir=DIR --cluster_time_out=S ms_comm_job.py        (N >= 2; 3 makes real subgroups)

Checks, on every worker: `init_job` gives (RANK_ID, N); `all_gather_json` of small objects of
unequal lengths (and non-ASCII text), of None, and of about 1 MB per rank (unequal); `barrier`
really waits for a late rank (rank 0 arrives 2 s late); `groups` + `broadcast` over the world,
over every pair of ranks (a real MindSpore subgroup when N > 2) and over single ranks, with an
8 MiB, an odd-sized and an empty buffer; a `Comm` over a subgroup (its own ranks, all_gather_json,
barrier, broadcast from its rank 1); `release`. At the end the ranks gather each other's
failures: each prints `MS_COMM_JOB_OK rank=R world=N` and exits 0 only when no rank failed a
check, else prints every failure and exits 1. In msrun's scheduler role `init_job` never returns.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import numpy as np

from hpckpt.dist.frameworks import mindspore_tensors as ms_fw

failures: list[str] = []


def check(what: str, ok: bool, detail: object = "") -> None:
    if not ok:
        failures.append(f"{what}: {detail}")


def pattern(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def main() -> int:
    started = time.monotonic()
    rank, world = ms_fw.init_job()
    print(f"rank {rank}: init_job took {time.monotonic() - started:.2f} s", flush=True)
    check("init_job", (rank, world) == (int(os.environ["RANK_ID"]), int(os.environ["RANK_SIZE"])), (rank, world))
    check("is_scheduler in a worker", not ms_fw.is_scheduler())
    comm = ms_fw.Comm()
    check("Comm rank/world", (comm.rank, comm.world_size) == (rank, world), (comm.rank, comm.world_size))

    small = comm.all_gather_json({"rank": rank, "text": "é☃" * rank, "list": list(range(rank * 3))})
    want = [{"rank": r, "text": "é☃" * r, "list": list(range(r * 3))} for r in range(world)]
    check("all_gather_json small", small == want, small)
    check("all_gather_json None", comm.all_gather_json(None) == [None] * world)
    # around the first gather's block (4 KiB a rank, 4 bytes of it the length): one rank just
    # inside it, one exactly filling it, one a byte beyond (the second gather), in turn
    for shift in range(world):
        sizes = [4090, 4092, 4093, 1][:world]
        mine = "x" * (sizes[(rank + shift) % world] - 2)  # json.dumps adds two quotes
        edge = comm.all_gather_json(mine)
        check(f"all_gather_json at the block's edge ({shift})",
              edge == ["x" * (sizes[(r + shift) % world] - 2) for r in range(world)], [len(e) for e in edge])

    def big(r: int) -> dict:
        return {"rank": r, "blob": "ab" * (500_000 + 1_001 * r), "ints": list(range(r * 100))}
    for attempt in range(2):
        t = time.monotonic()
        got = comm.all_gather_json(big(rank))
        print(f"rank {rank}: all_gather_json of ~1 MB took {time.monotonic() - t:.3f} s", flush=True)
        check(f"all_gather_json 1 MB ({attempt})", got == [big(r) for r in range(world)],
              [len(g.get("blob", "")) for g in got])

    if rank == 0:
        time.sleep(2.0)
    t = time.monotonic()
    comm.barrier()
    waited = time.monotonic() - t
    print(f"rank {rank}: barrier with rank 0 late by 2 s waited {waited:.2f} s", flush=True)
    if rank != 0:
        check("barrier waits for a late rank", waited > 1.5, f"{waited:.2f} s")

    sets = list(dict.fromkeys([tuple(range(world)), *itertools.combinations(range(world), 2),
                               *((r,) for r in range(world))]))
    handles = comm.groups(sets)
    check("groups keys", list(handles) == sets, list(handles))
    for i, ranks in enumerate(sets):
        if rank not in ranks:
            continue
        src = ranks[-1]
        for size in (8 * 1024 * 1024, 1001, 0):
            sent = pattern(size, seed=i * 7 + size)
            buffer = sent.copy() if rank == src else np.zeros(size, np.uint8)
            t = time.monotonic()
            got = comm.broadcast(buffer, src, handles[ranks])
            if size > 1024 * 1024:
                print(f"rank {rank}: broadcast of 8 MiB over {list(ranks)} took {time.monotonic() - t:.3f} s", flush=True)
            check(f"broadcast over {list(ranks)} from {src}, {size} bytes", np.array_equal(got, sent) and got is buffer)
    # a Comm over a subgroup: its ranks are the group's (global rank g is group rank g - 1 here)
    last = (1, world - 1) if world > 2 else None
    if last is not None and rank in last:
        sub = ms_fw.Comm(handles[last].name)
        check("sub Comm rank/world", (sub.rank, sub.world_size) == (last.index(rank), 2), (sub.rank, sub.world_size))
        check("sub Comm global_rank", [sub.global_rank(r) for r in range(2)] == list(last))
        check("sub all_gather_json", sub.all_gather_json({"g": rank}) == [{"g": g} for g in last])
        sub.barrier()
        sent = pattern(4097, seed=99)
        got = sub.broadcast(sent.copy() if sub.rank == 1 else np.zeros(4097, np.uint8), 1, sub.groups([(0, 1)])[(0, 1)])
        check("sub broadcast from its rank 1", np.array_equal(got, sent))
    try:
        comm.broadcast(np.zeros(4, np.uint8), world - 1, handles[(0,)])
        check("broadcast on a non-member or from a non-member raises", False)
    except ValueError:
        pass
    comm.release(handles)

    everyone = comm.all_gather_json(failures)
    comm.barrier()  # no rank leaves while a peer is still inside a collective
    bad = [f"rank {r}: {f}" for r, fs in enumerate(everyone) for f in fs]
    if bad:
        print("MS_COMM_JOB_FAILED\n" + "\n".join(bad), flush=True)
        return 1
    print(f"MS_COMM_JOB_OK rank={rank} world={world}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
