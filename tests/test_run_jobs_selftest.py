"""`hpckpt run ... selftest` as users run it: the installed `hpckpt`, real torchrun and msrun.

Few jobs, each checking much: success on 2 ranks (gather, progress, report), a failing rank on
3 (exit 22, the rank and its log named, the job stopped at once, no worker left), a rank killed
without a report, two nodes on one host sharing a log directory (a `load --check` job: each node
reports every rank), Ctrl-C, and one msrun success and one msrun failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpckpt.core import job_files

pytestmark = pytest.mark.dist

HPCKPT = Path(sys.executable).with_name("hpckpt")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID", "HPCKPT_JOB_ID", "RANK_ID", "RANK_SIZE", "MS_ROLE", "MS_WORKER_NUM")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}


def hpckpt_run(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(HPCKPT), "run", *map(str, args)], capture_output=True, text=True, env=_env(),
                          timeout=timeout)


def workers_left(run_dir: Path) -> list[str]:
    """Command lines of live processes that belong to this run (its directory is on them)."""
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(run_dir) in cmdline and state not in ("Z", "X"):
            left.append(cmdline)
    return left


def test_torchrun_two_ranks_gather_report_and_progress(tmp_path):
    run_dir = tmp_path / "logs"
    out = hpckpt_run("--nproc-per-node", 2, "--log-dir", run_dir, "selftest", "--bytes", "3MiB", "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    assert (document["job"], document["launcher"], document["world_size"], document["nodes"]) == ("selftest", "torchrun", 2, 1)
    ranks = document["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert {r["framework"] for r in ranks} == {"torch"} and [r["local_rank"] for r in ranks] == [0, 1]
    peers = ranks[0]["peers"]
    assert peers == ranks[1]["peers"] and [p["pid"] for p in peers] == [r["pid"] for r in ranks]
    assert len({p["pid"] for p in peers}) == 2
    assert document["totals"]["bytes"] == 2 * 3 * 2**20
    run = job_files.read_run(run_dir)
    assert run.progress() == (2 * 3 * 2**20, 2 * 3 * 2**20)
    assert {r.state for r in run.ranks.values()} == {"ok"}
    assert "selftest job: rank 1 of 2" in job_files.log_path(run_dir, 1).read_text()
    assert document["log_dir"] == str(run_dir) and not workers_left(run_dir)


def test_a_failing_rank_stops_the_job_at_once_and_is_named(tmp_path):
    run_dir = tmp_path / "logs"
    started = time.time()
    out = hpckpt_run("--nproc-per-node", 3, "--log-dir", run_dir, "selftest", "--fail-rank", 1,
                     "--step-seconds", 30, "--bytes", 8)  # the others would sit in a 4-minute job
    ended = time.time()
    assert out.returncode == 22, out.stderr
    log = job_files.log_path(run_dir, 1)
    first = out.stderr.splitlines()[0]
    assert first == f"error: rank 1 failed: failing on purpose (--fail-rank 1) (log: {log})", out.stderr
    assert f"hint: logs of every rank: {run_dir}" in out.stderr
    assert "SelftestFailure: failing on purpose" in log.read_text()  # the traceback is in the rank's log
    failed_at = job_files.read_json(job_files.status_path(run_dir, 1))["time"]
    assert ended - failed_at < 6, f"stopped {ended - failed_at:.1f} s after the failure"
    assert ended - started < 60
    assert not workers_left(run_dir)


def test_a_rank_killed_without_a_report_is_named_from_the_launcher(tmp_path):
    run_dir = tmp_path / "logs"
    out = hpckpt_run("--nproc-per-node", 2, "--log-dir", run_dir, "selftest", "--crash-rank", 1,
                     "--bytes", 8, "--step-seconds", 30)
    assert out.returncode == 22, out.stderr
    assert out.stderr.splitlines()[0] == (f"error: rank 1 exited without a report (killed by SIGKILL) "
                                          f"(log: {job_files.log_path(run_dir, 1)})"), out.stderr
    assert job_files.read_json(job_files.status_path(run_dir, 1))["state"] == "running"
    assert not workers_left(run_dir)


def test_two_nodes_on_one_host_load_as_one_world(tmp_path):
    """Two `hpckpt run --nnodes 2` processes on loopback, one log directory (as on shared
    storage): one world of two ranks, every box checked, and each node's report covers both."""
    import torch

    import hpckpt.dist as hdist
    from hpckpt.cli.run.launch_plan import free_port

    hdist.save({"w": torch.arange(24, dtype=torch.float32).reshape(6, 4), "step": 3}, tmp_path / "ck")
    port, logs = free_port(), tmp_path / "logs"
    nodes = [subprocess.Popen([str(HPCKPT), "run", "--launcher", "torchrun", "--nnodes", "2", "--node-rank", str(node),
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1",
                               "--log-dir", str(logs), "load", str(tmp_path / "ck"), "--check", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for node in (0, 1)]
    outputs = [node.communicate(timeout=180) for node in nodes]
    for node, (stdout, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr
    for stdout, _ in outputs:
        document = json.loads(stdout)
        assert document["world_size"] == 2 and document["nodes"] == 2
        assert [(r["rank"], r["checked_boxes"], r["checked_values"]) for r in document["ranks"]] == [(0, 1, 1), (1, 1, 1)]
        assert document["totals"]["checked_bytes"] == 96
    assert (logs / "launcher-node0.log").exists() and (logs / "launcher-node1.log").exists()


def _sigint_as_on_a_terminal() -> None:
    """A test run started in the background (`pytest &`) ignores SIGINT, and so would the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_worker(tmp_path):
    run_dir = tmp_path / "logs"
    proc = subprocess.Popen([str(HPCKPT), "run", "--nproc-per-node", "2", "--log-dir", str(run_dir), "selftest",
                             "--bytes", "8", "--step-seconds", "30"], stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=_sigint_as_on_a_terminal)
    deadline = time.monotonic() + 120
    while job_files.read_run(run_dir).progress()[1] < 16 and time.monotonic() < deadline:
        time.sleep(0.1)  # both ranks are inside the job
    assert len(workers_left(run_dir)) >= 3  # the launcher and two workers
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted (SIGINT)" in stderr, stderr
    assert time.monotonic() - sent < 6
    assert not workers_left(run_dir)


def test_msrun_two_ranks(tmp_path):
    run_dir = tmp_path / "logs"
    started = time.monotonic()
    out = hpckpt_run("--launcher", "msrun", "--nproc-per-node", 2, "--log-dir", run_dir, "selftest", "--bytes", 1000,
                     "--json")
    seconds = time.monotonic() - started
    assert out.returncode == 0, out.stderr + "\n" + (run_dir / "launcher.log").read_text()[-3000:]
    document = json.loads(out.stdout)
    assert document["launcher"] == "msrun" and document["world_size"] == 2
    ranks = document["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["framework"] for r in ranks} == {"mindspore"}
    assert [r["local_rank"] for r in ranks] == [0, 1] and ranks[0]["peers"] == ranks[1]["peers"]
    assert document["totals"]["bytes"] == 2000
    assert (run_dir / "scheduler.log").exists() and (run_dir / "msrun").is_dir()
    assert not workers_left(run_dir), f"after {seconds:.0f} s"


def test_msrun_failing_rank_is_named_and_nothing_is_left(tmp_path):
    run_dir = tmp_path / "logs"
    out = hpckpt_run("--launcher", "msrun", "--nproc-per-node", 2, "--log-dir", run_dir, "selftest", "--fail-rank", 0)
    ended = time.time()
    assert out.returncode == 22, out.stderr
    assert out.stderr.splitlines()[0] == (f"error: rank 0 failed: failing on purpose (--fail-rank 0) "
                                          f"(log: {job_files.log_path(run_dir, 0)})")
    assert ended - job_files.read_json(job_files.status_path(run_dir, 0))["time"] < 6  # not msrun's timeout
    assert not workers_left(run_dir)


def test_signals_remove_what_the_job_staged_and_come_too_late_after_it_finished(tmp_path):
    """Real signals to `hpckpt run`: SIGTERM during a save removes the staging the ranks share and
    the lock (exit 143, nothing left beside the destination); what a killed run (SIGKILL, no
    cleanup) left is named by inspect and verify with the command that removes it; a SIGINT after
    every rank finished is too late to undo anything: exit 0, and said."""
    dest = tmp_path / "ck"
    proc = subprocess.Popen([str(HPCKPT), "run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "save",
                             "-o", str(dest), "--size", "600MiB"], stderr=subprocess.PIPE, text=True, env=_env())
    staging = tmp_path / ".ck.hpckpt-tmp-dist"
    deadline = time.monotonic() + 120
    while not staging.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert staging.exists(), "the save never staged"
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "interrupted (SIGTERM)" in stderr, stderr
    assert "removed what the stopped job left" in stderr and str(staging) in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"], sorted(tmp_path.iterdir())
    assert not workers_left(tmp_path / "logs")
    # what a run killed outright left (it could not clean up): named, with the command that removes it
    staging.mkdir()
    (staging / "_rank0_.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / ".ck.hpckpt-lock").write_text("999999999\n")
    for command in ("inspect", "verify"):
        done = subprocess.run([str(HPCKPT), command, str(dest)], capture_output=True, text=True, env=_env())
        assert done.returncode == 3, done.stderr
        assert ".ck.hpckpt-tmp-dist" in done.stderr and ".ck.hpckpt-lock" in done.stderr, done.stderr
        assert "hint: remove them with `rm -r " in done.stderr and str(staging) in done.stderr, done.stderr
    # a signal once every rank has reported success: the job's output stands
    logs = tmp_path / "logs2"
    proc = subprocess.Popen([str(HPCKPT), "run", "--nproc-per-node", "2", "--log-dir", str(logs), "selftest",
                             "--bytes", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=_sigint_as_on_a_terminal)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        run = job_files.read_run(logs)
        if len(run.ranks) == 2 and all(r.state == job_files.OK and r.result is not None for r in run.ranks.values()):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal could be sent"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "SIGINT came after" in stderr and "nothing was undone" in stderr, stderr
    assert "selftest done on 2 ranks" in stdout, stdout
