"""hpckpt.dist's accelerator paths on a real GPU: nccl exchanges, pinned staging, loads into device
tensors; side by side with torch DCP on the same state (`bench/cuda_check.sh` runs it).

    torchrun --standalone --nproc-per-node 1 bench/cuda_job.py --backend nccl --size-gib 2 --work W --report R
    torchrun --standalone --nproc-per-node 2 bench/cuda_job.py --backend gloo --size-gib 0.25 --work W --report R

The state is engine_state's (fp32 and bf16 tensors, uneven first dims, 0-d tensors, values) as
DTensors sharded over the ranks, every local shard on cuda:0 (one GPU: nccl needs a GPU per rank,
so nccl runs on one rank and the multi-rank job uses gloo with device tensors). Each round times,
from a barrier + cuda synchronize to the next:
  hdist.save / dcp.save                      fsynced saves from GPU memory
  hdist.async_save / dcp.async_save          blocked: until the call returns; total: until
                                             `.result()`; the state is overwritten right after the
                                             call returns (what a training step does), so a load
                                             equal to the pattern proves the staging copy was taken
                                             before the call returned
  hdist.load / dcp.load / dcp+HpckptReader   into empty device DTensors, each checked bit-exact
                                             against the pattern (first round), page cache evicted
  dcp+HpckptWriter                           torch's planner, hpckpt's writer
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

import hpckpt.dist as hdist  # noqa: E402
from dist_job import build_state, compare, evict, files_under, prepare, rank  # noqa: E402
from hpckpt.dist.torch_storage import HpckptReader, HpckptWriter  # noqa: E402


DEVICE = "cuda"  # `--device cpu`: the same job on a machine without a GPU (a dry run of the script)


def on_gpu(state: dict, mesh) -> dict:
    out = {}
    for fqn, v in state.items():
        if isinstance(v, DTensor):
            out[fqn] = DTensor.from_local(v.to_local().to(DEVICE), mesh, v.placements, run_check=False,
                                          shape=v.shape, stride=v.stride())
        elif isinstance(v, torch.Tensor):
            out[fqn] = v.to(DEVICE)
        else:
            out[fqn] = v
    return out


def sync_barrier() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def timed(fn):
    sync_barrier()
    start = time.perf_counter()
    out = fn()
    sync_barrier()
    return out, time.perf_counter() - start


def scribble(state: dict) -> None:
    """What the next training step does to the state: every device tensor overwritten."""
    for v in state.values():
        if isinstance(v, torch.Tensor):
            (v.to_local() if isinstance(v, DTensor) else v).fill_(7)


def cold(src: Path) -> None:
    if rank() == 0:
        for f in files_under(src):
            evict(f)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--report", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(args.backend, device_id=torch.device("cuda", 0) if args.backend == "nccl" else None)
    try:
        run(args)
    finally:
        dist.destroy_process_group()
        time.sleep(0.05)  # torch's exit abort: README, "Clean exits"


def run(args) -> None:
    work = Path(args.work)
    world = dist.get_world_size()
    cpu_mesh = init_device_mesh("cpu", (world,))
    mesh = init_device_mesh(DEVICE, (world,))
    reference = on_gpu(build_state(args.size_gib, cpu_mesh, [Shard(0)]), mesh)
    rows, checked = [], set()

    def fresh():
        return {k: (v.clone() if not isinstance(v, DTensor) and isinstance(v, torch.Tensor) else v)
                for k, v in on_gpu(build_state(args.size_gib, cpu_mesh, [Shard(0)]), mesh).items()}

    def check(name: str, loaded: dict) -> None:
        if name in checked:
            return
        checked.add(name)
        bad = compare(loaded, reference)
        on_device = all(v.to_local().device.type == DEVICE for v in loaded.values() if isinstance(v, DTensor))
        rows.append({"step": name, "mismatches": bad, "on_device": on_device})

    for r in range(args.rounds):
        for name, folder, save in (
            ("hdist.save", "hp", lambda s, d: hdist.save(s, d)),
            ("dcp.save", "torch", lambda s, d: dcp.save(s, checkpoint_id=str(d))),
            ("dcp+HpckptWriter", "hpwriter", lambda s, d: dcp.save(s, storage_writer=HpckptWriter(d))),
        ):
            state = fresh()
            prepare(work / folder)
            _, seconds = timed(lambda: save(state, work / folder))
            rows.append({"round": r, "step": name, "seconds": seconds})
        for name, folder, start in (
            ("hdist.async_save", "hpa", lambda s, d: hdist.async_save(s, d)),
            ("dcp.async_save", "torcha", lambda s, d: dcp.async_save(s, checkpoint_id=str(d))),
        ):
            state = fresh()
            prepare(work / folder)
            sync_barrier()
            t0 = time.perf_counter()
            handle = start(state, work / folder)
            blocked = time.perf_counter() - t0
            scribble(state)  # the next step, while the save goes on
            handle.result()
            sync_barrier()
            rows.append({"round": r, "step": name, "blocked": blocked, "seconds": time.perf_counter() - t0})
        for name, folder, load in (
            ("hdist.load", "hp", lambda s, d: hdist.load(s, d)),
            ("hdist.load (async save)", "hpa", lambda s, d: hdist.load(s, d)),
            ("dcp.load", "torch", lambda s, d: dcp.load(s, checkpoint_id=str(d))),
            ("dcp.load (async save)", "torcha", lambda s, d: dcp.load(s, checkpoint_id=str(d))),
            ("dcp+HpckptReader (hp)", "hp", lambda s, d: dcp.load(s, storage_reader=HpckptReader(d))),
            ("dcp.load (HpckptWriter)", "hpwriter", lambda s, d: dcp.load(s, checkpoint_id=str(d))),
        ):
            state = fresh()
            scribble(state)
            cold(work / folder)
            _, seconds = timed(lambda: load(state, work / folder))
            rows.append({"round": r, "step": name, "seconds": seconds})
            check(name, state)
        if rank() == 0:
            print(f"round {r} done", flush=True)
    if rank() == 0:
        Path(args.report).write_text(json.dumps({
            "backend": args.backend, "world": world, "size_gib": args.size_gib,
            "device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
