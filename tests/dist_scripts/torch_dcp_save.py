"""Save a small DTensor state dict with PyTorch DCP from every rank (run under torchrun, gloo).

Usage: torchrun --standalone --nproc-per-node 2 torch_dcp_save.py CKPT_DIR [REFERENCE_FILE]

Rank 0 also writes the full tensors and values with plain torch.save to REFERENCE_FILE (default
CKPT_DIR + ".reference.pt"), which the test compares hpckpt's reassembled tensors against.
"""

import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def full_state() -> dict:
    """The same global tensors on every rank (fixed seed), before sharding."""
    g = torch.Generator().manual_seed(1234)
    return {
        "rows": torch.randn(5, 3, generator=g),  # Shard(0) over 2 ranks: 3 + 2 rows
        "cols": torch.randn(4, 5, generator=g),  # Shard(1): 3 + 2 columns
        "rep": torch.randn(2, 3, generator=g),  # Replicate
        "bf": torch.randn(7, 2, generator=g).to(torch.bfloat16),  # Shard(0): 4 + 3 rows
        "tiny": torch.arange(3, dtype=torch.int64).reshape(1, 3),  # Shard(0): rank 1 holds 0 rows
        "scalar": torch.tensor(2.5),  # plain 0-d tensor, same on every rank
        "plain_fp16": torch.randn(3, generator=g).half(),  # plain tensor, same on every rank
    }


VALUES = {"step": 11, "lr": 0.125, "tag": "dist", "milestones": [3, 6, 9]}
PLACEMENTS = {"rows": Shard(0), "cols": Shard(1), "rep": Replicate(), "bf": Shard(0), "tiny": Shard(0)}


def main() -> None:
    out = sys.argv[1]
    reference = sys.argv[2] if len(sys.argv) > 2 else out + ".reference.pt"
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    full = full_state()
    state = {
        name: distribute_tensor(t, mesh, [PLACEMENTS[name]]) if name in PLACEMENTS else t
        for name, t in full.items()
    }
    state["extra"] = dict(VALUES)
    dcp.save(state, checkpoint_id=out)
    if dist.get_rank() == 0:
        torch.save({"tensors": full, "values": VALUES}, reference)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort: README, "Clean exits"


if __name__ == "__main__":
    main()
