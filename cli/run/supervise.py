"""Supervising a launched job: start the launcher, follow the ranks' files, and stop every
process at the first failure, instead of leaving the other ranks inside a collective until a
timeout (msrun waits `--cluster_time_out`, 40 s and more, measured).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hpckpt.cli.run.failures import MSRUN_WORKER_EXIT, died_after_success, root_cause
from hpckpt.cli.run.launch_plan import LaunchPlan
from hpckpt.cli.run.processes import descendants, stop_job
from hpckpt.cli.run.report import unreported
from hpckpt.core import job_files
from hpckpt.core.errors import InterruptedRunError

POLL_SECONDS = 0.1


@dataclass
class Outcome:
    """How a launched job ended."""

    ok: bool
    launcher_code: int | None
    run: job_files.RunFiles
    message: str | None = None
    seconds: float = 0.0


@dataclass
class _LogTail:
    """The launcher's output so far (it is small: the workers write their own logs)."""

    path: Path
    text: str = ""
    _offset: int = field(default=0, repr=False)

    def read(self) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                new = f.read()
        except OSError:
            return self.text
        self._offset += len(new)
        self.text += new.decode("utf-8", "replace")
        return self.text


def launch(plan: LaunchPlan, on_progress: Callable[[job_files.RunFiles], None] | None = None) -> Outcome:
    """Start the launcher, follow the ranks' files, stop everything at the first failure (or on
    Ctrl-C: the exception is raised again once no worker is left)."""
    import subprocess

    plan.run_dir.mkdir(parents=True, exist_ok=True)
    # one per node: the nodes of a job may share the log directory (then each sees every rank)
    launcher_log = plan.run_dir / ("launcher.log" if plan.nnodes == 1 else f"launcher-node{plan.node_rank}.log")
    env = {**os.environ, **plan.env_changes()}
    started = time.monotonic()
    with open(launcher_log, "ab") as log:
        proc = subprocess.Popen(plan.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    tail, known = _LogTail(launcher_log), {}
    try:
        while True:
            code = proc.poll()
            known.update(descendants(proc.pid))
            run = job_files.read_run(plan.run_dir, results=False)
            if on_progress is not None:
                on_progress(run)
            output = tail.read()
            worker_died = bool(MSRUN_WORKER_EXIT.search(output))  # msrun itself waits for its timeout
            if run.failed() or worker_died or (code is not None and code != 0):
                time.sleep(POLL_SECONDS)  # a peer's report written in the same instant joins this one
                stop_job(proc, known)
                run = job_files.read_run(plan.run_dir)
                if not run.failed() and not unreported(plan, run):
                    return Outcome(True, proc.returncode, run, died_after_success(run, tail.read(), plan.run_dir),
                                   time.monotonic() - started)
                message = root_cause(run, tail.read(), proc.returncode if code is not None else None,
                                     plan.run_dir, launcher_log)
                return Outcome(False, proc.returncode, run, message, time.monotonic() - started)
            if code == 0:
                stop_job(proc, known, grace=0.5)  # nothing should be left; a stray worker must not be
                run = job_files.read_run(plan.run_dir)
                return Outcome(True, 0, run, None, time.monotonic() - started)
            time.sleep(POLL_SECONDS)
    except BaseException as exc:
        stop_job(proc, known)
        if isinstance(exc, InterruptedRunError):  # too late to stop it: every rank had finished
            run = job_files.read_run(plan.run_dir)
            if not run.failed() and not unreported(plan, run):
                name = signal.Signals(exc.exit_code - 128).name
                return Outcome(True, proc.returncode, run, f"{name} came after every rank had finished; the job's "
                               "output is complete and nothing was undone", time.monotonic() - started)
        raise
