"""Latency of MindSpore's CPU collectives as `hpckpt.dist` uses them (run under msrun).

    msrun --worker_num=4 --local_worker_num=4 --master_addr=127.0.0.1 --master_port=29779 \\
          --join=True --log_dir=/tmp/ms-lat python bench/ms_gather_latency.py; grep RANK /tmp/ms-lat/worker_*.log

Each rank prints the mean over 20 calls of: the barrier (a gather of one int32), a small
`all_gather_json` (one AllGather since 5056cf6), and AllGathers of 1,024 and 16,384 int32 words.
Measured 2026-12-02 with 4 ranks: 30-60 ms per AllGather whatever its size; a small exchange
90 ms before 5056cf6 (two gathers), 50 ms after.

Last, what waiting costs: rank 0 sleeps 2 s before a gather, and every rank prints the seconds it
spent in the gather and the CPU seconds it used meanwhile. Measured 2026-12-04: the waiting ranks
used 1.13-1.32 CPU-s in 2.03-2.06 s (MindSpore's CPU AllGather polls while it waits), CPU taken from
the ranks still working when ranks outnumber cores.
"""

import os
import resource
import sys
import time

import numpy as np
import mindspore
from mindspore import communication

mindspore.set_context(device_target="CPU")
communication.init()  # msrun's scheduler role serves the cluster inside this call
if os.environ.get("MS_ROLE") == "MS_SCHED":
    sys.exit(0)
from hpckpt.dist.frameworks.mindspore_tensors import Comm  # noqa: E402

comm = Comm()
comm.barrier()


def mean_ms(call, n=20):
    comm.barrier()
    t = time.perf_counter()
    for _ in range(n):
        call()
    return round((time.perf_counter() - t) / n * 1000, 2)


print("RANK", comm.rank, "barrier ms", mean_ms(comm.barrier),
      "gather_json small ms", mean_ms(lambda: comm.all_gather_json({"error": None, "files": [["a", 1]]})),
      "int32 x1024 ms", mean_ms(lambda: comm._all_gather_int32(np.zeros(1024, np.int32))),
      "int32 x16384 ms", mean_ms(lambda: comm._all_gather_int32(np.zeros(16384, np.int32))), flush=True)
comm.barrier()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if comm.rank == 0:
    time.sleep(2.0)
waited, used = time.perf_counter(), cpu_seconds()
comm.all_gather_json({"rank": comm.rank})
print("RANK", comm.rank, "waited in the gather s", round(time.perf_counter() - waited, 2), "CPU s meanwhile",
      round(cpu_seconds() - used, 2), flush=True)
