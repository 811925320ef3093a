"""A training-script-shaped job that checkpoints once and then ends the way users' scripts end:
`dist.destroy_process_group()`, `return`, a normal interpreter exit. Nothing here leaves early.

    torchrun --standalone --nproc-per-node 3 exit_job.py OUT setup         # OUT/hpckpt and OUT/dcp, to load
    torchrun --standalone --nproc-per-node 3 exit_job.py OUT PATH [NAME]   # saves write OUT/NAME

Every rank builds a small FSDP2 model on a 1-D mesh of all ranks (so FSDP2 holds the default
process group past `destroy_process_group()`, as in real jobs) plus two replicated plain
tensors, then does PATH and checks it:

- hpckpt paths: `save`, `async_save` (its `result()` awaited), `save-storage`
  (`coordination="storage"`), `load` (`broadcast_shared=False`), `load-broadcast` (a replicated
  tensor read by one rank and broadcast to the others);
- the same with torch alone, as the baseline: `dcp-save`, `dcp-async-save`, `dcp-load`;
- `all-gather`: the last collective is torch's `all_gather_object` (torch's own bug in 15 lines).

Saves go to OUT/NAME (default "run"; the caller removes it), loads read OUT/hpckpt or OUT/dcp. A rank prints
`rank R: OK PATH.` after its checks, or `rank R: FAIL ...` and returns 1; either way the process
then leaves through the normal interpreter exit, so an abort at exit shows as signal 6.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hpckpt.dist as hdist

HPCKPT_PATHS = ("save", "async_save", "save-storage", "load", "load-broadcast")
TORCH_PATHS = ("dcp-save", "dcp-async-save", "dcp-load", "all-gather")


def state(seed: int) -> dict:
    """FSDP2-sharded parameters and two replicated tensors (every rank wants them whole)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 13), nn.Linear(13, 5))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(seed + 1)
    return {"model": model.state_dict(), "shared": {"table": torch.randn(64, 16, generator=g),
                                                    "scale": torch.randn(16, generator=g)}}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(local(a["model"][k]), local(b["model"][k])) for k in a["model"]) and \
        all(torch.equal(a["shared"][k], b["shared"][k]) for k in a["shared"])


def run(out: Path, path: str, name: str) -> str | None:
    """Do PATH; None when its checks pass, else what failed."""
    saved = state(seed=1)
    target = out / name
    if path == "setup":
        hdist.save(saved, out / "hpckpt")
        dcp.save(saved, checkpoint_id=str(out / "dcp"))
        return None
    if path == "save":
        result = hdist.save(saved, target)
        return None if result.files else "save wrote no file"
    if path == "async_save":
        result = hdist.async_save(saved, target).result(timeout=120)
        return None if result.files else "async_save wrote no file"
    if path == "save-storage":
        result = hdist.save(saved, target, coordination="storage", timeout=60)
        return None if result.files else "save wrote no file"
    if path in ("load", "load-broadcast"):
        fresh = state(seed=2)
        result = hdist.load(fresh, out / "hpckpt", broadcast_shared=path == "load-broadcast")
        if result.missing or result.unused or not same(fresh, saved):
            return f"load: missing {result.missing}, unused {result.unused}, or values differ"
        if path == "load-broadcast" and result.job_bytes_read != result.job_bytes_wanted:
            return f"load-broadcast read {result.job_bytes_read} bytes for {result.job_bytes_wanted}"
        return None
    if path == "dcp-save":
        dcp.save(saved, checkpoint_id=str(target))
        return None
    if path == "dcp-async-save":
        dcp.async_save(saved, checkpoint_id=str(target)).result()
        return None
    if path == "dcp-load":
        fresh = state(seed=2)
        dcp.load(fresh, checkpoint_id=str(out / "dcp"))
        return None if same(fresh, saved) else "dcp.load: values differ"
    if path == "all-gather":
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, dist.get_rank())
        return None if ranks == list(range(dist.get_world_size())) else f"all_gather_object gave {ranks}"
    raise SystemExit(f"unknown path {path!r}")


def main() -> int:
    out, path = Path(sys.argv[1]), sys.argv[2]
    name = sys.argv[3] if len(sys.argv) > 3 else "run"
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    failure = run(out, path, name)
    if failure:
        print(f"rank {rank}: FAIL {path}: {failure}", file=sys.stderr, flush=True)
    else:
        print(f"rank {rank}: OK {path}.", flush=True)
    dist.destroy_process_group()
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
