"""One rank of an `hpckpt run` job: set the framework up, run the job, report through files.

torchrun and msrun start this (through `entry/hpckpt_run_worker.py`) once per rank with
`--run-dir D --launcher L --spec-json S`. The worker writes its own log, status, progress and
result files in D (`hpckpt.core.job_files`), which the `run` process polls: that is how a
failure on one rank reaches the user in a second instead of after a collective's timeout.

msrun starts the script once more as its scheduler (`MS_ROLE=MS_SCHED`): that process must
call `mindspore.communication.init()` too, which serves the cluster's meta server until the
workers are done (measured: a scheduler that exits early leaves the workers retrying their
registration until `--cluster_time_out`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpckpt.core import job_files
from hpckpt.core.errors import HpckptError

INTERNAL_EXIT = 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hpckpt_run_worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--launcher", required=True, choices=("torchrun", "msrun"))
    parser.add_argument("--spec-json", required=True)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    return parser.parse_args(argv)


def one_line(text: str, limit: int = 500) -> str:
    """An error message as the one line the parent prints."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass
class JobContext:
    """What a job knows about its place in the run (the job interface of `hpckpt.dist.jobs`)."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    framework: str  # "torch" (torchrun) or "mindspore" (msrun)
    run_dir: Path
    comm: Any  # all_gather_json(obj) -> list, barrier()
    progress: job_files.ProgressFile
    phase: Callable[[str], None] = field(init=False)

    def __post_init__(self) -> None:
        self.phase = self.progress.phase

    def log(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} rank {self.rank}] {text}", flush=True)


def _framework_comm(framework: str) -> Any:
    """The exchanges of the framework's own module (`all_gather_json`, `barrier`)."""
    if framework == "torch":
        from hpckpt.dist.frameworks.torch_tensors import Comm
    else:
        from hpckpt.dist.frameworks.mindspore_tensors import Comm
    return Comm()


# -- framework set-up and teardown --------------------------------------------------------------

def _env_rank(launcher: str) -> tuple[int, int]:
    """(rank, world size) as the launcher's variables give them, before any framework starts."""
    if launcher == "torchrun":
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK_ID", "0")), int(os.environ.get("RANK_SIZE", os.environ.get("MS_WORKER_NUM", "1")))


def _start_torch(world_size: int) -> tuple[int, int]:
    """gloo, also for one rank: the jobs then meet one kind of process group (torchrun sets the
    rendezvous variables whatever the world size).

    `torch.distributed.nn` is imported first: its functions take the default group as a default
    argument, so imported later (by torch DCP, FSDP) they would hold the group past
    `destroy_process_group()`, and gloo's threads with it (docs/library.md, "Clean exits")."""
    import torch.distributed as tdist
    import torch.distributed.nn  # noqa: F401 - see above

    if not tdist.is_initialized():
        tdist.init_process_group("gloo")
    return tdist.get_rank(), tdist.get_world_size()


def _start_mindspore() -> tuple[int, int]:
    import mindspore
    from mindspore import communication

    mindspore.set_context(device_target="CPU")
    communication.init()
    return communication.get_rank(), communication.get_group_size()


EXIT_GRACE_SECONDS = 0.2


def _stop_framework(framework: str) -> None:
    """Tear the framework down while the interpreter is whole (nothing of the job holds it now).

    torch: `destroy_process_group()` frees a gloo group, and joins its threads, only when nothing
    else holds it; then the collection below finds it gone. If something still does (FSDP2's
    state), gloo's threads live on and may still release a finished collective's tensors, which
    takes the GIL: the process lets them do it before the interpreter finalizes, since a thread
    that takes the GIL after that aborts the process (docs/library.md, "Clean exits")."""
    try:
        if framework == "torch":
            import gc
            import weakref

            import torch.distributed as tdist

            if tdist.is_initialized():
                group = weakref.ref(tdist.group.WORLD)
                tdist.destroy_process_group()
                gc.collect()
                if group() is not None:
                    print("the process group outlived destroy_process_group(); waiting "
                          f"{EXIT_GRACE_SECONDS} s for gloo's threads", flush=True)
                    time.sleep(EXIT_GRACE_SECONDS)
        else:
            from mindspore import communication

            communication.release()
    except Exception:  # noqa: BLE001 - the job's outcome is written already; teardown is best effort
        traceback.print_exc()


def _scheduler(run_dir: Path, node_rank: int) -> int:
    """msrun's scheduler role: serve the cluster's meta server until the workers finish.

    msrun starts a scheduler on every node whose `--master_addr` is one of its own addresses:
    node 0 only on a cluster, but every node when several share one host (the second one cannot
    bind the port, and its msrun exits 1). Only node 0 serves."""
    _redirect_output(run_dir / "scheduler.log")
    if node_rank != 0:
        print(f"node {node_rank}: the scheduler is node 0's", flush=True)
        return 0
    import mindspore
    from mindspore import communication

    mindspore.set_context(device_target="CPU")
    communication.init()  # returns (or exits) when the cluster is done
    return 0


def _redirect_output(path: Path) -> None:
    """Point this process's stdout and stderr (the file descriptors: native code writes there
    too) at its own log, so the launcher's output stays readable and every rank's is apart."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream, target in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        os.dup2(fd, target)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass


# -- the rank's run -----------------------------------------------------------------------------

def _failed(run_dir: Path, rank: int, exc: BaseException) -> int:
    """Write the failed status (the traceback goes to the rank's log) and return the exit code."""
    traceback.print_exc()
    if isinstance(exc, HpckptError):
        kind, code, message = exc.kind, exc.exit_code, exc.message
    else:
        kind, code, message = "internal", INTERNAL_EXIT, f"{type(exc).__name__}: {exc}"
    job_files.write_status(run_dir, rank, job_files.FAILED, kind=kind, exit_code=code, error=one_line(message),
                           pid=os.getpid(), host=socket.gethostname())
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    run_dir = args.run_dir
    if args.launcher == "msrun" and os.environ.get("MS_ROLE") == "MS_SCHED":
        return _scheduler(run_dir, args.node_rank)
    framework = "torch" if args.launcher == "torchrun" else "mindspore"
    rank, world_size = _env_rank(args.launcher)
    _redirect_output(job_files.log_path(run_dir, rank))
    where = {"pid": os.getpid(), "host": socket.gethostname()}
    job_files.write_status(run_dir, rank, job_files.RUNNING, **where)
    try:
        spec = json.loads(args.spec_json)
        from hpckpt.dist.jobs import job_module

        module = job_module(spec["job"])
        started_rank, world_size = _start_torch(world_size) if framework == "torch" else _start_mindspore()
        if started_rank != rank:  # the framework's numbering is the one that counts
            os.replace(job_files.log_path(run_dir, rank), job_files.log_path(run_dir, started_rank))
            job_files.status_path(run_dir, rank).unlink(missing_ok=True)
            rank = started_rank
            job_files.write_status(run_dir, rank, job_files.RUNNING, **where)
        local_rank = int(os.environ.get("LOCAL_RANK", rank - args.node_rank * args.nproc_per_node))
        node_rank = int(os.environ.get("GROUP_RANK", args.node_rank))
        ctx = JobContext(rank, world_size, local_rank, node_rank, framework, run_dir, _framework_comm(framework),
                         job_files.ProgressFile(run_dir, rank))
        ctx.log(f"{spec['job']} job: rank {rank} of {world_size} ({framework}, node {node_rank})")
        result = module.run(spec, ctx)
        ctx.progress.flush()
        job_files.write_json(job_files.result_path(run_dir, rank), result if result is not None else {})
        job_files.write_status(run_dir, rank, job_files.OK, exit_code=0, **where)
    except Exception as exc:  # noqa: BLE001 - every failure is reported, never lost in a launcher's output
        return _failed(run_dir, rank, exc)
    try:
        ctx.comm.barrier()  # a rank leaving early can break a slower peer's collective (msrun)
    except Exception:  # noqa: BLE001 - this rank's outcome is written; a peer's failure is its own report
        traceback.print_exc()
    del ctx  # its exchanges hold the process group
    _stop_framework(framework)
    return 0
