"""The launcher's command line: torchrun or msrun, their flags for one node or several, the
worker entry script and the job's spec, and the variables set for them.

Framework-free (the CLI must start without torch or mindspore): the workers are started by file
path and talk to the CLI only through the files of `hpckpt.core.job_files` in the run directory.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hpckpt.core.errors import LauncherNotFoundError

LAUNCHERS = ("torchrun", "msrun")
ENTRY_SCRIPT = Path(__file__).resolve().parents[2] / "dist" / "jobs" / "entry" / "hpckpt_run_worker.py"
MSRUN_CLUSTER_TIMEOUT = 300  # seconds msrun waits for every worker to join


def find_launcher(name: str) -> Path:
    """The launcher next to this Python first (the active environment), then on PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return beside
    found = shutil.which(name)
    if found:
        return Path(found)
    package = "torch" if name == "torchrun" else "mindspore"
    raise LauncherNotFoundError(f"{name} not found next to {sys.executable} nor on PATH",
                                hint=f"install {package} in this environment (pip install hpckpt[{package}])")


def free_port() -> int:
    """A port nothing listens on now (the single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Where `hpckpt run` keeps each job's logs and reports unless `--log-dir` says: one directory for
#: all runs, each run a new `JOB-STAMP-PID/` in it.
LOG_ROOT_VARIABLE = "HPCKPT_LOG_DIR"


def log_root() -> Path:
    """`$HPCKPT_LOG_DIR`, else `hpckpt-runs/` under the temp directory."""
    return Path(os.environ.get(LOG_ROOT_VARIABLE) or Path(tempfile.gettempdir()) / "hpckpt-runs")


def default_run_dir(job: str = "run") -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return log_root() / f"{job}-{stamp}-{os.getpid()}"


@dataclass
class LaunchPlan:
    """Everything the launcher's command line is made of."""

    launcher: str
    nproc_per_node: int
    spec: dict
    run_dir: Path
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher_path: Path | None = None  # found when the plan is made; the bare name in tests

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def standalone(self) -> bool:
        return self.nnodes == 1 and self.master_addr is None and self.master_port is None

    def worker_args(self) -> list[str]:
        return [str(ENTRY_SCRIPT), "--run-dir", str(self.run_dir), "--launcher", self.launcher,
                "--node-rank", str(self.node_rank), "--nproc-per-node", str(self.nproc_per_node),
                "--spec-json", json.dumps(self.spec, separators=(",", ":"))]

    def command(self) -> list[str]:
        exe = str(self.launcher_path or self.launcher)
        if self.launcher == "torchrun":
            if self.standalone:
                flags = ["--standalone", "--nproc-per-node", str(self.nproc_per_node)]
            else:  # torchrun's default rendezvous, "static": node 0 hosts the store at addr:port
                flags = ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                         "--master-addr", self.master_addr or "127.0.0.1", "--master-port", str(self.master_port),
                         "--nproc-per-node", str(self.nproc_per_node)]
            return [exe, *flags, "--max-restarts", "0", *self.worker_args()]
        flags = [f"--worker_num={self.world_size}", f"--local_worker_num={self.nproc_per_node}",
                 f"--master_addr={self.master_addr or '127.0.0.1'}", f"--master_port={self.master_port}",
                 f"--node_rank={self.node_rank}", f"--log_dir={self.run_dir / 'msrun'}", "--join=True",
                 f"--cluster_time_out={MSRUN_CLUSTER_TIMEOUT}"]
        return [exe, *flags, *self.worker_args()]

    def job_id(self) -> str:
        """The same on every node of one job (storage-coordinated saves meet under it): the run
        directory's name on one node; the rendezvous address across nodes (unless HPCKPT_JOB_ID
        is set already)."""
        if os.environ.get("HPCKPT_JOB_ID"):
            return os.environ["HPCKPT_JOB_ID"]
        if self.nnodes == 1:
            return self.run_dir.name
        return f"hpckpt-run-{self.master_addr}-{self.master_port}"

    def env_changes(self) -> dict[str, str]:
        """The variables set for the launcher (and so for the workers) on top of ours."""
        changes = {"HPCKPT_JOB_ID": self.job_id()}
        if "OMP_NUM_THREADS" not in os.environ:
            changes["OMP_NUM_THREADS"] = "1"
        if self.launcher == "msrun":  # msrun starts `python` from PATH: ours, not another one
            changes["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
            # MindSpore's cluster polls with a retry interval of up to several seconds; 0-1 s halves the
            # time from the job's end to msrun's exit (docs/design-figures.md)
            for name, value in (("MS_RETRY_INTERVAL_LOWER", "0"), ("MS_RETRY_INTERVAL_UPPER", "1")):
                if name not in os.environ:
                    changes[name] = value
        return changes

    def display(self) -> str:
        """The exact command line, shell-quoted, with the variables that matter in front."""
        shown = {k: v for k, v in self.env_changes().items() if k != "PATH"}
        if "PATH" in self.env_changes():
            shown["PATH"] = f"{Path(sys.executable).parent}:$PATH"
        prefix = " ".join(f"{k}={shlex.quote(v) if k != 'PATH' else v}" for k, v in shown.items())
        return f"{prefix} {shlex.join(self.command())}"
