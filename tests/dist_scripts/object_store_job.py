"""One rank of a torchrun job that saves to and loads from an object store, for
tests/test_object_store.py (the server's address and credentials come in the environment).

    torchrun --nproc-per-node 4 object_store_job.py save URL LOCAL_DIR
    torchrun --nproc-per-node 2 object_store_job.py load URL

`save`: an FSDP2-sharded model, a replicated table and values, saved with `hpckpt.dist.save` to URL
and to LOCAL_DIR, and with `hpckpt.dist.async_save` to URL-async (the test compares the objects
with the files). `load`: the same model sharded
over this job's ranks, from another seed, loaded from URL with `hpckpt.dist.load` and compared,
whole, with the saved one. Each rank prints `rank R: OK` or `rank R: FAIL ...` and exits 0 or 1.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hpckpt.dist as hdist

SEED = 11


def model(seed: int, shard: bool) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 13), nn.Linear(13, 5))
    if shard:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    return net


def shared(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    return {"table": torch.randn(64, 16, generator=g), "ids": torch.arange(10, dtype=torch.int64) * seed}


def main() -> int:
    command, url = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    failure = None
    if command == "save":
        state = {"model": model(SEED, True).state_dict(), "shared": shared(SEED), "step": 7, "tag": "object store"}
        result = hdist.save(state, checkpoint_id=url)
        if not result.committed:
            failure = f"save to {url} was not committed"
        hdist.save(state, checkpoint_id=sys.argv[3])
        handle = hdist.async_save(state, checkpoint_id=url + "-async")  # exchanging through the store
        if not handle.result(timeout=120).committed:
            failure = f"async_save to {url}-async was not committed"
    else:
        net = model(SEED + 5, True)
        state = {"model": net.state_dict(), "shared": shared(SEED + 5), "step": 0, "tag": ""}
        hdist.load(state, checkpoint_id=url)
        want = {"model": model(SEED, False).state_dict(), "shared": shared(SEED)}
        for name, tensor in state["model"].items():
            if not torch.equal(tensor.full_tensor(), want["model"][name]):
                failure = f"model.{name} differs"
        for name, tensor in state["shared"].items():
            if not torch.equal(tensor, want["shared"][name]):
                failure = f"shared.{name} differs"
        if (state["step"], state["tag"]) != (7, "object store"):
            failure = f"values: {state['step']!r}, {state['tag']!r}"
    print(f"rank {rank}: " + (f"FAIL {failure}" if failure else "OK"), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort after the job's own last collective: README, "Clean exits"
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
