"""Drive `hpckpt.dist.jobs.reshard_job` under a real `torchrun` (gloo, CPU), without `hpckpt run`.

    torchrun --standalone --nproc-per-node N reshard_driver.py CASES_JSON OUT_DIR

CASES_JSON is a list of `{"name", "spec"}`; every rank runs every case in order with a context
built from `torch.distributed` (the job interface of `hpckpt run`: rank, world size, `comm` with
`all_gather_json`/`barrier`, `progress`, `phase`, `log`) and writes `OUT_DIR/rank-{r}.json`:
per case the job's result, or the error it raised (class, kind, exit code, message), and the
bytes its progress was started with and advanced by. Exit 0 whatever the cases did: the test
judges them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist


class Comm:
    def all_gather_json(self, obj):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, json.dumps(obj))
        return [json.loads(text) for text in gathered]

    def barrier(self):
        dist.barrier()


class Progress:
    def __init__(self):
        self.total = self.done = 0

    def start(self, total: int) -> None:
        self.total += total

    def advance(self, n: int) -> None:
        self.done += n


class Context:
    def __init__(self, run_dir: Path):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.node_rank = int(os.environ.get("GROUP_RANK", 0))
        self.framework = "torch"
        self.run_dir = run_dir
        self.comm = Comm()
        self.progress = Progress()
        self.phases: list[str] = []

    def phase(self, text: str) -> None:
        self.phases.append(text)

    def log(self, text: str) -> None:
        print(f"[rank {self.rank}] {text}", file=sys.stderr, flush=True)


def main() -> int:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    dist.init_process_group("gloo")
    from hpckpt.dist.jobs import reshard_job

    outcomes = {}
    for case in cases:
        ctx = Context(out)
        try:
            outcome = {"result": reshard_job.run(case["spec"], ctx)}
        except Exception as exc:  # the test judges every error
            outcome = {"error": {"class": type(exc).__name__, "kind": getattr(exc, "kind", None),
                                 "exit_code": getattr(exc, "exit_code", None), "message": str(exc)}}
            if not hasattr(exc, "kind"):
                outcome["error"]["traceback"] = traceback.format_exc()
        outcome.update(progress_total=ctx.progress.total, progress_done=ctx.progress.done, phases=ctx.phases)
        outcomes[case["name"]] = outcome
        dist.barrier()
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(outcomes, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort: README, "Clean exits"
    return 0


if __name__ == "__main__":
    sys.exit(main())
