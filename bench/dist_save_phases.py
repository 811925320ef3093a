"""Where a live save's time goes, per rank and round, under torchrun or msrun.

    torchrun --standalone --nproc-per-node 4 bench/dist_save_phases.py torch
    msrun --worker_num=4 --local_worker_num=4 --master_addr=127.0.0.1 --master_port=29778 --join=True \\
          --log_dir=/tmp/ms-phases python bench/dist_save_phases.py mindspore; grep RANK /tmp/ms-phases/worker_*.log

The synthetic 1.5 GiB state (`hpckpt.dist.jobs.synthetic`) split over the ranks, saved three
times (plan cache off) after a barrier; each rank prints the whole save, its planning and its
own write. The rest is the exchanges after the write and waiting for the slowest rank.
Under MindSpore each round also times, after a barrier, MindSpore's own `save_checkpoint` of
the same local tensors to one `.ckpt` per rank, then its fsync (what `hpckpt run bench` calls
`durable_seconds`), 5 AllGathers of one int32 (the latency each of the save's three
exchanges pays), and `hdist.save(coordination="none")` (each rank its own files and
`{rank}.metadata`, no exchange and no global commit: what MindSpore's own save promises): the
same bytes written side by side, a round at a time.
Measured 2026-12-02 with 4 ranks: torch 0.90-1.17 s a save (writes 0.78-0.92 s), MindSpore
1.40-1.46 s (writes 0.75-1.07 s), before 5056cf6.
"""

import os
import shutil
import sys
import time
from pathlib import Path

framework = sys.argv[1]
OUT = os.environ.get("OUT", f"/tmp/dist-save-phases-{framework}")
if framework == "mindspore":
    import mindspore
    from mindspore import communication

    mindspore.set_context(device_target="CPU")
    communication.init()
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        sys.exit(0)
    from hpckpt.dist.frameworks.mindspore_tensors import Comm
else:
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    from hpckpt.dist.frameworks.torch_tensors import Comm

import hpckpt.dist as hdist  # noqa: E402
from hpckpt.core.dtypes import dtype  # noqa: E402
from hpckpt.core.geometry.layout import LayoutSpec  # noqa: E402
from hpckpt.dist.jobs import states  # noqa: E402

comm = Comm()
state, _pieces = states.synthetic_state(int(1.5 * 2**30), dtype("bfloat16"), LayoutSpec.for_world_size(comm.world_size),
                                        comm.rank, framework)


def mindspore_own(i: int) -> None:
    """MindSpore's `save_checkpoint` of this rank's tensors, then an fsync of its file."""
    import math

    from hpckpt.core.commit.durable import fsync_path
    from hpckpt.dist.jobs.bench_state import sharded_leaves

    items = [{"name": ".".join(map(str, path)), "data": s.local} for path, s in sharded_leaves(state)
             if math.prod(s.local.shape)]
    dest = f"{OUT}-ms/rank_{comm.rank}.ckpt"
    if comm.rank == 0:
        shutil.rmtree(f"{OUT}-ms", ignore_errors=True)
        os.makedirs(f"{OUT}-ms")
    os.sync()
    comm.barrier()
    t = time.perf_counter()
    mindspore.save_checkpoint(items, dest)
    saved = time.perf_counter() - t
    fsync_path(Path(dest))
    durable = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(5):
        comm.barrier()
    gather = (time.perf_counter() - t) / 5
    print("RANK", comm.rank, "round", i, "mindspore save_checkpoint", round(saved, 3), "+ fsync", round(durable, 3),
          "allgather", round(gather, 3), flush=True)


for i in range(3):
    if comm.rank == 0:
        shutil.rmtree(OUT, ignore_errors=True)
    os.sync()
    comm.barrier()
    t = time.perf_counter()
    r = hdist.save(state, OUT, plan_cache=False)
    t = time.perf_counter() - t
    print("RANK", comm.rank, "round", i, round(t, 3), "planning", round(r.planning, 3), "writing",
          round(r.writing, 3), "rest", round(t - r.planning - r.writing, 3), flush=True)
    if framework == "mindspore":
        mindspore_own(i)
        if comm.rank == 0:
            shutil.rmtree(f"{OUT}-none", ignore_errors=True)
        os.sync()
        comm.barrier()
        t = time.perf_counter()
        hdist.save(state, f"{OUT}-none", coordination="none")
        print("RANK", comm.rank, "round", i, "coordination none", round(time.perf_counter() - t, 3), flush=True)
comm.barrier()
if comm.rank == 0:
    shutil.rmtree(OUT, ignore_errors=True)
    shutil.rmtree(f"{OUT}-ms", ignore_errors=True)
    shutil.rmtree(f"{OUT}-none", ignore_errors=True)
