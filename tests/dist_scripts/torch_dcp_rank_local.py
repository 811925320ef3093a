"""Save DTensor state dicts with `dcp.save(..., use_collectives=False)` from every rank (torchrun, gloo).

Usage: torchrun --standalone --nproc-per-node 2 torch_dcp_rank_local.py OUT_DIR

Writes under OUT_DIR:
  good/           every rank's own `__{r}.metadata` and `__{r}_0.distcp` (no `.metadata`)
  reference.pt    (rank 0) the full tensors and values before sharding
  loaded{r}.pt    what torch's own `dcp.load` of good/ gave rank r (no global metadata, so each
                  rank falls back to its own rank-local metadata): local shards and their offsets
  clash_shape/    ranks disagree on one tensor's shape
  clash_kind/     a name is a tensor on rank 0 and a value on rank 1
"""

import io
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

PLACEMENTS = {"rows": Shard(0), "cols": Shard(1), "rep": Replicate(), "bf": Shard(0)}


def full_tensors() -> dict:
    g = torch.Generator().manual_seed(2026)
    return {
        "rows": torch.randn(5, 3, generator=g),  # Shard(0): 3 + 2 rows
        "cols": torch.randn(4, 5, generator=g),  # Shard(1): 3 + 2 columns
        "rep": torch.randn(2, 3, generator=g),  # Replicate: each rank stores its copy
        "bf": torch.randn(7, 2, generator=g).to(torch.bfloat16),  # Shard(0): 4 + 3 rows
        "plain": torch.arange(6, dtype=torch.int64),  # plain tensor, the same on every rank
    }


def state(mesh, full: dict, rank: int, blank: bool = False) -> dict:
    """The state dict of one rank; `blank` gives the same structure filled with zeros, to load into."""
    made = {}
    for name, t in full.items():
        t = torch.zeros_like(t) if blank else t
        made[name] = distribute_tensor(t, mesh, [PLACEMENTS[name]]) if name in PLACEMENTS else t.clone()
    made[f"own{rank}"] = torch.zeros(3) if blank else torch.full((3,), 10.0 + rank)  # only this rank has it
    made["step"] = 0 if blank else 17
    made["note"] = "" if blank else f"rank {rank}"  # differs per rank: torch's tools read rank 0's
    made["blob"] = io.BytesIO() if blank else io.BytesIO(b"\x00raw\xffbytes")
    return made


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_tensors()
    good = os.path.join(out, "good")
    dcp.save(state(mesh, full, rank), checkpoint_id=good, use_collectives=False)
    if rank == 0:
        torch.save({"tensors": full, "values": {"step": 17, "blob": b"\x00raw\xffbytes"}},
                   os.path.join(out, "reference.pt"))
    dist.barrier()

    target = state(mesh, full, rank, blank=True)
    dcp.load(target, checkpoint_id=good)
    loaded = {}
    for name, value in target.items():
        if isinstance(value, DTensor):
            _sizes, offsets = compute_local_shape_and_global_offset(value.shape, mesh, value.placements)
            loaded[name] = (tuple(offsets), value.to_local().clone())
        elif isinstance(value, torch.Tensor):
            loaded[name] = ((0,) * value.dim(), value.clone())
        elif isinstance(value, io.BytesIO):
            loaded[name] = value.getvalue()
        else:
            loaded[name] = value
    torch.save(loaded, os.path.join(out, f"loaded{rank}.pt"))

    clash = torch.zeros(2 + rank)
    dcp.save({"ok": torch.ones(2), "clash": clash}, checkpoint_id=os.path.join(out, "clash_shape"),
             use_collectives=False)
    kind = torch.ones(2) if rank == 0 else 5
    dcp.save({"ok": torch.ones(2), "kind": kind}, checkpoint_id=os.path.join(out, "clash_kind"),
             use_collectives=False)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort: README, "Clean exits"


if __name__ == "__main__":
    main()
