"""Write the benchmark state with real `torch.distributed.checkpoint.save` (run under torchrun).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/torch_dcp_make.py \
        --size-gib 1.5 --dcp DIR [--hf DIR] [--report FILE]

Every rank builds its Shard(0) part of the state of `engine_state.py` as DTensors on a 1-D CPU
mesh (gloo), then `dcp.save` writes a PyTorch DCP checkpoint (`.metadata`, `__{r}_0.distcp`). With
`--hf`, the tensors are also saved with `HuggingFaceStorageWriter(save_distributed=True)` (sharded
safetensors carrying DCP's offsets: the input PyTorch's `consolidate_safetensors_files` needs).
Non-tensor values are left out of the HF save (the HF writer accepts them and writes a corrupt
file), and so is the int64 0-d tensor (PyTorch's consolidation fails on integer dtypes).
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gib", type=float, required=True)
    parser.add_argument("--dcp", required=True)
    parser.add_argument("--hf")
    parser.add_argument("--report")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world, mesh = engine_state.join_gloo_job()
    t0 = time.perf_counter()
    state = engine_state.local_state(args.size_gib, rank, world, mesh)
    built = time.perf_counter() - t0

    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=args.dcp)
    dist.barrier()
    dcp_seconds = time.perf_counter() - t0

    hf_seconds = None
    if args.hf:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        # Floating tensors only: consolidate_safetensors_files calls torch.finfo on every dtype
        # and fails on integer tensors (TypeError: torch.finfo() requires a floating point input type).
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(path=args.hf, save_distributed=True))
        dist.barrier()
        hf_seconds = time.perf_counter() - t0

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "build_s": built, "maxrss": rss})
    if rank == 0 and args.report:
        with open(args.report, "w") as f:
            json.dump({"world": world, "dcp_save_s": dcp_seconds, "hf_save_s": hf_seconds,
                       "ranks": gathered}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort: README, "Clean exits"


if __name__ == "__main__":
    main()
