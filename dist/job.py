"""Which rank of how many this process is, and how it reaches the others."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as tdist

from hpckpt.dist.coordination import Collectives


class Alone:
    """The exchanges of a one-rank job: nothing to wait for."""

    kind = "collectives"
    rank, world_size = 0, 1

    def all_gather(self, phase: str, obj: Any, what: str | None = None) -> list[Any]:
        return [obj]


@dataclass(frozen=True)
class Job:
    rank: int
    world_size: int
    group: Any  # the torch process group, None when there is none (storage coordination, one rank)

    def collectives(self):
        if self.world_size == 1:
            return Alone()
        return Collectives(self.group, self.rank, self.world_size)

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return tdist.get_global_rank(self.group, group_rank)


def this_job(process_group: Any = None, *, need_collectives: bool) -> Job:
    """This process's place in the job: the process group's (given, or the default one), else
    `RANK`/`WORLD_SIZE` from the environment (what storage coordination needs: no group at all).

    Raises:
        ValueError: several ranks and collectives wanted, but torch.distributed is not initialised.
    """
    if process_group is not None or (tdist.is_available() and tdist.is_initialized()):
        group = process_group if process_group is not None else tdist.group.WORLD
        return Job(tdist.get_rank(group), tdist.get_world_size(group), group)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if need_collectives and world > 1:
        raise ValueError(f"this is rank {rank} of {world} (RANK/WORLD_SIZE) but torch.distributed is not initialised: "
                         "call init_process_group first, or use coordination='storage'")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not a rank of WORLD_SIZE={world}")
    return Job(rank, world, None)


def job_identity() -> str | None:
    """What all ranks of this job, and no other job, share: `HPCKPT_JOB_ID`, else torchrun's run
    id and restart count, else the rendezvous address (None when there is nothing)."""
    if os.environ.get("HPCKPT_JOB_ID"):
        return os.environ["HPCKPT_JOB_ID"]
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"{os.environ['TORCHELASTIC_RUN_ID']}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return None
