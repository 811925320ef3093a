"""`hpckpt run`'s launcher side: the launcher's command line, supervising it, the report.

Framework-free (the CLI must start without torch or mindspore): the workers talk to this process
only through the files of `hpckpt.core.job_files` in the run directory. A failure on one rank
stops the whole job at once, instead of leaving its peers inside a collective until a timeout
(msrun waits `--cluster_time_out`, 40 s and more, measured).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpckpt.core import job_files
from hpckpt.core.errors import JobFailedError, LauncherNotFoundError

LAUNCHERS = ("torchrun", "msrun")
ENTRY_SCRIPT = Path(__file__).resolve().parents[1] / "dist" / "jobs" / "entry" / "hpckpt_run_worker.py"
MSRUN_CLUSTER_TIMEOUT = 300  # seconds msrun waits for every worker to join
POLL_SECONDS = 0.1
STOP_GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL
# a failure reported about another rank, not a root cause of its own
SECONDARY_KINDS = {"save-failed", "worker-failed", "interrupted"}  # reports about another rank's failure
IDENTITY_FIELDS = {"rank", "world_size", "local_rank", "node_rank", "pid"}


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


def default_run_dir() -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return Path(tempfile.gettempdir()) / f"hpckpt-run-{stamp}-{os.getpid()}"


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
            # time from the job's end to msrun's exit (measured: 4.6-9.1 s -> 2.3-4.4 s)
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


# -- the processes ------------------------------------------------------------------------------

def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)", which may hold spaces
        table[int(entry)] = (int(fields[1]), fields[0], fields[19])
    return table


def descendants(root: int) -> dict[int, str]:
    """Every process under `root` (pid -> start time). msrun puts each worker in a session of
    its own, so killing the launcher's process group does not reach them (measured): they are
    followed through the process tree instead."""
    if not os.path.isdir("/proc"):
        return {}
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][2]
        todo.extend(children.get(pid, []))
    return found


def _alive(pid: int, started: str | None) -> bool:
    """Running, and still the process we saw (not a reused pid, not a zombie left unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] not in ("Z", "X") and (started is None or fields[19] == started)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_job(launcher: Any, known: dict[int, str], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM to the launcher's process group and every process seen under it, SIGKILL to what
    is left after `grace` seconds; the launcher is reaped."""
    known = {**known, **descendants(launcher.pid)}
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    for pid, started in known.items():
        if _alive(pid, started):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        known.update(descendants(launcher.pid))
        if launcher.poll() is not None and not any(_alive(p, s) for p, s in known.items()):
            break
        time.sleep(0.05)
    for pid, started in known.items():
        if _alive(pid, started):
            _signal(pid, signal.SIGKILL)
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    launcher.wait()


# -- what went wrong ----------------------------------------------------------------------------

_MSRUN_EXIT = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
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
    dead += [DeadRank(by_pid.get(int(p)), int(p), int(c)) for p, c in _MSRUN_EXIT.findall(launcher_output)]
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


# -- supervision --------------------------------------------------------------------------------

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
            worker_died = bool(_MSRUN_EXIT.search(output))  # msrun itself waits for its timeout
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
    except BaseException:
        stop_job(proc, known)
        raise


# -- the report ---------------------------------------------------------------------------------

def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def totals(results: list[dict]) -> dict[str, float]:
    """The ranks' numeric figures summed, but `seconds`/`*_seconds` (the slowest rank's: the
    job's wall time) and `job_*` (a figure of the whole job that every rank reports: its largest)."""
    out: dict[str, float] = {}
    for result in results:
        for key, value in result.items():
            if key in IDENTITY_FIELDS or not _numeric(value):
                continue
            if key == "seconds" or key.endswith("_seconds") or key.startswith("job_"):
                out[key] = max(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0) + value
    return out


def report(plan: LaunchPlan, run: job_files.RunFiles) -> dict:
    """The `--json` document of a job that succeeded: this node's ranks, and their totals."""
    results = []
    for rank, files in run.ranks.items():
        result = files.result if isinstance(files.result, dict) else {"value": files.result}
        results.append({"rank": rank, **{k: v for k, v in result.items() if k != "rank"}})
    return {"job": plan.spec["job"], "launcher": plan.launcher, "world_size": plan.world_size, "nodes": plan.nnodes,
            "ranks": results, "totals": totals(results), "log_dir": str(plan.run_dir)}


def unreported(plan: LaunchPlan, run: job_files.RunFiles) -> list[int]:
    """This node's ranks that have not reported success with a result."""
    expected = range(plan.node_rank * plan.nproc_per_node, (plan.node_rank + 1) * plan.nproc_per_node)
    return [r for r in expected if run.ranks.get(r) is None or run.ranks[r].state != job_files.OK
            or run.ranks[r].result is None]


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


def check_complete(plan: LaunchPlan, run: job_files.RunFiles) -> None:
    """A launcher that exited 0 while this node's ranks did not all report ok is a failure too."""
    missing = unreported(plan, run)
    if missing:
        r = missing[0]
        raise JobFailedError(f"rank {r} ended without reporting success (log: {job_files.log_path(plan.run_dir, r)})",
                             hint=f"logs of every rank: {plan.run_dir}")
