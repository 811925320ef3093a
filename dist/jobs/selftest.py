"""`hpckpt run ... selftest`: check a launcher set-up end to end, without touching a checkpoint.

Every rank gathers every rank's host and pid (proving the collectives work), waits at a barrier
and reports what it saw. `fail_rank` makes one rank fail after the gather, `crash_rank` one
die by SIGKILL there, without a report (how failure propagation is tested); `bytes` drives the progress protocol (how its aggregation is tested).
"""

from __future__ import annotations

import os
import signal
import socket
import time

from hpckpt.core.errors import HpckptError, SelftestFailure

PROGRESS_STEPS = 8


def run(spec: dict, ctx) -> dict:
    started = time.time()
    ctx.phase("gathering ranks")
    peers = ctx.comm.all_gather_json({"rank": ctx.rank, "host": socket.gethostname(), "pid": os.getpid()})
    if [p["rank"] for p in peers] != list(range(ctx.world_size)):
        raise HpckptError(f"the gather returned ranks {[p['rank'] for p in peers]}, not 0..{ctx.world_size - 1}")
    if spec.get("fail_rank") == ctx.rank:
        raise SelftestFailure(f"failing on purpose (--fail-rank {ctx.rank})")
    if spec.get("crash_rank") == ctx.rank:  # a death without a report: a segfault, the OOM killer
        os.kill(os.getpid(), signal.SIGKILL)
    total = int(spec.get("bytes") or 0)
    if total:
        ctx.phase("counting bytes")
        ctx.progress.start(total)
        step, left = max(1, total // PROGRESS_STEPS), total
        while left > 0:
            ctx.progress.advance(min(step, left))
            left -= min(step, left)
            time.sleep(float(spec.get("step_seconds") or 0))
    ctx.phase("barrier")
    ctx.comm.barrier()
    return {
        "rank": ctx.rank, "world_size": ctx.world_size, "local_rank": ctx.local_rank, "node_rank": ctx.node_rank,
        "framework": ctx.framework, "host": socket.gethostname(), "pid": os.getpid(),
        "peers": peers, "bytes": total, "seconds": round(time.time() - started, 3),
    }
