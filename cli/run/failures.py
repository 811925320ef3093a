"""What went wrong in a failed job, said in one line: the rank that failed first (not one that
only reports another's failure), else a worker the launcher saw die, else the launcher itself."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from hpckpt.core import job_files

SECONDARY_KINDS = {"save-failed", "worker-failed", "interrupted"}  # reports about another rank's failure
MSRUN_WORKER_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
_MSRUN_SCHEDULER_EXIT = re.compile(r"Scheduler process \d+ exit with exception")
_TORCHRUN_EXIT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*exitcode\s*:\s*(-?\d+)")


@dataclass(frozen=True)
class DeadRank:
    """A worker the launcher saw exit badly: its rank when known, else its pid; its exit code."""

    rank: int | None
    pid: int | None
    exit_code: int


def dead_ranks(launcher_output: str, statuses: dict[int, dict]) -> list[DeadRank]:
    """The failed workers the launcher's own output names, the likeliest root cause first:
    torchrun's "Root Cause" entry before its other failures, and a worker killed by SIGTERM
    (the launcher stopping the others) last."""
    by_pid = {int(s["pid"]): r for r, s in statuses.items() if s and s.get("pid") is not None}
    before, marker, after = launcher_output.partition("Root Cause")
    dead = [DeadRank(int(r), None, int(c)) for r, c in _TORCHRUN_EXIT.findall(after if marker else "")]
    dead += [DeadRank(int(r), None, int(c)) for r, c in _TORCHRUN_EXIT.findall(before)]
    dead += [DeadRank(by_pid.get(int(p)), int(p), int(c)) for p, c in MSRUN_WORKER_EXIT.findall(launcher_output)]
    return sorted(dead, key=lambda d: d.exit_code == -signal.SIGTERM)  # stable: the order above otherwise


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def root_cause(run: job_files.RunFiles, launcher_output: str, launcher_code: int | None, run_dir: Path,
               launcher_log: Path) -> str:
    """The one line naming what failed first: the earliest failed status that is not a report
    about another rank's failure; else a rank the launcher saw die; else a rank that left no
    report; else the launcher itself."""
    failed = sorted(run.failed(), key=lambda f: (f.status.get("kind") in SECONDARY_KINDS, f.status.get("time", 0)))
    if failed:
        first = failed[0]
        return (f"rank {first.rank} failed: {first.status.get('error') or first.status.get('kind')} "
                f"(log: {job_files.log_path(run_dir, first.rank)})")
    statuses = {r: f.status for r, f in run.ranks.items() if f.status}
    for dead in dead_ranks(launcher_output, statuses):
        if dead.rank is not None:
            return (f"rank {dead.rank} exited without a report ({_exit_text(dead.exit_code)}) "
                    f"(log: {job_files.log_path(run_dir, dead.rank)})")
        return f"a worker (pid {dead.pid}) exited without a report ({_exit_text(dead.exit_code)}) (log: {launcher_log})"
    unfinished = [f for f in run.ranks.values() if f.state == job_files.RUNNING]
    if unfinished:
        first = unfinished[0]
        return f"rank {first.rank} exited without a report (log: {job_files.log_path(run_dir, first.rank)})"
    if _MSRUN_SCHEDULER_EXIT.search(launcher_output):
        return f"msrun's scheduler failed (log: {run_dir / 'scheduler.log'})"
    what = "was stopped" if launcher_code is None else f"exited with {_exit_text(launcher_code)}"
    when = "after every rank reported success" if run.ranks else "before any rank reported"
    return f"the launcher {what} {when} (log: {launcher_log})"


def died_after_success(run: job_files.RunFiles, launcher_output: str, run_dir: Path) -> str:
    """The warning for a job every rank of which reported success before one of them died.

    A rank reports success once its job is done and everything it wrote is committed; only the
    interpreter's teardown comes after (the launcher then stops the others). Such a death does
    not change the job's result, and is reported as what it is."""
    statuses = {r: f.status for r, f in run.ranks.items() if f.status}
    dead = [d for d in dead_ranks(launcher_output, statuses) if d.exit_code != -signal.SIGTERM]
    who = (f"rank {dead[0].rank}" if dead and dead[0].rank is not None else "a worker") + \
        (f" ({_exit_text(dead[0].exit_code)})" if dead else "")
    log = f" (log: {job_files.log_path(run_dir, dead[0].rank)})" if dead and dead[0].rank is not None else ""
    return (f"{who} died at exit after every rank had reported success: the results stand; its interpreter's "
            f"teardown failed{log}")
