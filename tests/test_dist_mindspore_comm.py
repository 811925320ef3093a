"""`mindspore_tensors.Comm` in one real msrun job (CPU backend "mccl"): tests/dist_scripts/
ms_comm_job.py checks all_gather_json, barrier, groups + broadcast and release inside the job
and exits 0 only when every rank passed every check.

Three workers, not two: with two, every set of two or more ranks is the world, and the subgroup
path (`create_group` / `destroy_group`) would go untested; the third worker costs about 1-2 s
of the job's ~20 s (measured here: 2 workers 20.3 s, 3 workers 21.7 s).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

pytestmark = pytest.mark.dist

JOB = Path(__file__).parent / "dist_scripts" / "ms_comm_job.py"
WORKERS = 3
CLUSTER_TIME_OUT = 60  # s: a worker that never reaches init() ends the job after this
TIMEOUT = 240  # s for the whole msrun job (it takes about 20 s here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_msrun(workers: int, script: Path, log_dir: Path) -> tuple[int | None, str]:
    """A real msrun job on this machine; its exit code (None: killed after TIMEOUT) and its
    console output followed by every worker's log."""
    bin_dir = str(Path(sys.executable).parent)  # msrun runs `python` from PATH
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
           "GLOG_v": "3",  # MindSpore's errors only: readable logs
           "MS_NODE_TIMEOUT": "10",  # a dead worker is seen by the scheduler in ~10 s, not ~30 s
           # retries of the cluster's RPCs 0-1 s apart: the job ends ~3 s sooner after the last
           # worker is done (measured: 2.3-4.4 s from ready to exit, against 4.6-9.1 s)
           "MS_RETRY_INTERVAL_LOWER": "0", "MS_RETRY_INTERVAL_UPPER": "1",
           "OMP_NUM_THREADS": "1"}
    msrun = Path(bin_dir) / "msrun"
    cmd = [str(msrun), f"--worker_num={workers}", f"--local_worker_num={workers}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "--join=True", f"--log_dir={log_dir}",
           f"--cluster_time_out={CLUSTER_TIME_OUT}", str(script)]
    with open(log_dir.parent / "msrun.out", "w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=log_dir.parent)
        try:
            rc = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            rc = None
        out.seek(0)
        text = out.read()
    for r in range(workers):
        log = log_dir / f"worker_{r}.log"
        text += f"\n===== worker {r} =====\n" + (log.read_text(errors="replace") if log.exists() else "(no log)")
    return rc, text


def test_comm_in_an_msrun_job(tmp_path):
    log_dir = tmp_path / "logs"
    started = time.monotonic()
    rc, text = run_msrun(WORKERS, JOB, log_dir)
    took = time.monotonic() - started
    assert rc == 0, f"msrun exited {rc} after {took:.1f} s\n{text[-12000:]}"
    for r in range(WORKERS):
        log = (log_dir / f"worker_{r}.log").read_text(errors="replace")
        assert f"MS_COMM_JOB_OK rank={r} world={WORKERS}" in log, f"worker {r}:\n{log[-6000:]}"
