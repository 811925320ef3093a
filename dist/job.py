"""Which rank of how many this process is, and how it reaches the others."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

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
    comm: Any  # the framework's Comm (`frameworks`), None when there is none (storage coordination, one rank)
    framework: ModuleType

    def collectives(self):
        if self.world_size == 1:
            return Alone()
        return Collectives(self.comm)

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.comm is None else self.comm.global_rank(group_rank)


def _environment_rank() -> tuple[int, int]:
    """torchrun's RANK/WORLD_SIZE, else msrun's RANK_ID/RANK_SIZE."""
    env = os.environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    return int(env.get("RANK_ID", "0")), int(env.get("RANK_SIZE", "1"))


def this_job(framework: ModuleType, process_group: Any = None, *, need_collectives: bool,
             no_dist: bool = False) -> Job:
    """This process's place in the job: the framework's process group (given, or the world), else
    the launcher's environment (what storage coordination needs: no group at all); with
    `no_dist`, rank 0 of a job of one, whatever the group (torch DCP's `no_dist=True`).

    Raises:
        ValueError: several ranks and collectives wanted, but the framework's communication is
            not initialised.
    """
    if no_dist:
        return Job(0, 1, None, framework)
    comm = framework.comm_of(process_group)
    if comm is not None:
        return Job(comm.rank, comm.world_size, comm, framework)
    rank, world = _environment_rank()
    if need_collectives and world > 1:
        call = "init_process_group" if framework.NAME == "torch" else "mindspore.communication.init()"
        raise ValueError(f"this is rank {rank} of {world} but {framework.NAME}'s communication is not initialised: "
                         f"call {call} first, or use coordination='storage'")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not a rank of a world of {world}")
    return Job(rank, world, None, framework)


def job_identity() -> str | None:
    """What all ranks of this job, and no other job, share: `HPCKPT_JOB_ID`, else torchrun's run
    id and restart count, else the rendezvous address (None when there is nothing)."""
    env = os.environ
    if env.get("HPCKPT_JOB_ID"):
        return env["HPCKPT_JOB_ID"]
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if env.get("MS_SCHED_HOST") and env.get("MS_SCHED_PORT"):
        return f"{env['MS_SCHED_HOST']}:{env['MS_SCHED_PORT']}"
    return None
