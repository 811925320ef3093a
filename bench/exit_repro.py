"""torch alone, no hpckpt: the smallest job that dies at exit (SIGABRT, "terminate called").

    for i in $(seq 30); do torchrun --standalone --nproc-per-node=3 bench/exit_repro.py 2>&1 \
        | grep -c "terminate called"; done | awk '$1 > 0' | wc -l

Variants (one argument): `hold` as below; `barrier`: the same with `dist.barrier()` before
`destroy_process_group()`; `sleep`: the same with `time.sleep(0.05)` after it; `free`: no group held.
Measured on 2 cores, torch 2.13, CPython 3.11 (jobs aborted): hold 10/30, barrier 11/60,
sleep 0/60, free 0/30. Why: README, "Clean exits".
"""
import sys
import time

import torch.distributed as dist

variant = sys.argv[1] if len(sys.argv) > 1 else "hold"
dist.init_process_group("gloo")
rank = dist.get_rank()
held = dist.group.WORLD if variant != "free" else None  # what FSDP2's state does
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {"rank": dist.get_rank()})  # gloo's worker still holds its tensors...
if variant == "barrier":
    dist.barrier()
dist.destroy_process_group()  # ...and a held gloo group keeps its worker threads
if variant == "sleep":
    time.sleep(0.05)
print(f"rank {rank}: done", flush=True)  # the interpreter finalizes; the worker takes the GIL
