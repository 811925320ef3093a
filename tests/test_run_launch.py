"""`hpckpt run` without launching a job: the launcher command lines (both launchers, one node and
several), the option checks, the process-tree stop, and the report and root cause built from
rank files written by hand. The real jobs are in test_run_jobs_selftest.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from _util import REPO
from typer.testing import CliRunner

from hpckpt.core import errors
from hpckpt.cli.run import failures, launch_plan, processes, report, supervise
from hpckpt.cli.app import app
from hpckpt.core import job_files


def cli(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def dry_run(*args) -> tuple[dict[str, str], list[str], dict]:
    """The printed command line: (the variables in front, the command, the job spec)."""
    result = cli("run", "--dry-run", *args)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    words = shlex.split(lines[0])
    env = {}
    while "=" in words[0] and not words[0].startswith("/"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    spec = json.loads(words[words.index("--spec-json") + 1])
    return env, words, spec


def flags_before_script(words: list[str]) -> list[str]:
    return words[1:words.index(str(launch_plan.ENTRY_SCRIPT))]


def worker_args(words: list[str]) -> list[str]:
    return words[words.index(str(launch_plan.ENTRY_SCRIPT)) + 1:]


@pytest.fixture(autouse=True)
def _no_inherited_job_id(monkeypatch):
    monkeypatch.delenv("HPCKPT_JOB_ID", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


# -- command lines ------------------------------------------------------------------------------

def test_torchrun_single_node_is_standalone(tmp_path):
    env, words, spec = dry_run("--nproc-per-node", 3, "--log-dir", tmp_path / "logs", "selftest", "--fail-rank", 1)
    assert Path(words[0]) == Path(sys.executable).with_name("torchrun")
    assert flags_before_script(words) == ["--standalone", "--nproc-per-node", "3", "--max-restarts", "0"]
    assert worker_args(words)[:8] == ["--run-dir", str(tmp_path / "logs"), "--launcher", "torchrun",
                                      "--node-rank", "0", "--nproc-per-node", "3"]
    assert spec == {"job": "selftest", "fail_rank": 1, "crash_rank": None, "bytes": None, "step_seconds": 0.0}
    assert env == {"HPCKPT_JOB_ID": "logs", "OMP_NUM_THREADS": "1"}
    assert not (tmp_path / "logs").exists()  # a dry run launches and creates nothing


def test_torchrun_multi_node_flags_and_one_job_id_on_every_node(tmp_path):
    ids = set()
    for node in (0, 1):
        env, words, _ = dry_run("--nnodes", 2, "--node-rank", node, "--master-addr", "10.1.2.3", "--master-port", 29400,
                                "--nproc-per-node", 4, "--log-dir", tmp_path / f"node{node}", "selftest")
        assert flags_before_script(words) == ["--nnodes", "2", "--node-rank", str(node), "--master-addr", "10.1.2.3",
                                              "--master-port", "29400", "--nproc-per-node", "4", "--max-restarts", "0"]
        assert worker_args(words)[4:6] == ["--node-rank", str(node)]
        ids.add(env["HPCKPT_JOB_ID"])
    assert len(ids) == 1 and "10.1.2.3" in ids.pop()


def test_msrun_single_node_gets_a_local_scheduler_and_our_python_first(tmp_path):
    env, words, _ = dry_run("--launcher", "msrun", "--nproc-per-node", 2, "--log-dir", tmp_path, "selftest")
    assert Path(words[0]) == Path(sys.executable).with_name("msrun")
    flags = flags_before_script(words)
    port = next(f for f in flags if f.startswith("--master_port=")).split("=")[1]
    assert 1024 <= int(port) <= 65535
    assert flags == ["--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1", f"--master_port={port}",
                     "--node_rank=0", f"--log_dir={tmp_path / 'msrun'}", "--join=True",
                     f"--cluster_time_out={launch_plan.MSRUN_CLUSTER_TIMEOUT}"]
    assert env["PATH"] == f"{Path(sys.executable).parent}:$PATH"  # msrun starts `python` from PATH
    assert env["HPCKPT_JOB_ID"] == tmp_path.name


def test_msrun_multi_node_counts_every_node_s_workers(tmp_path):
    env, words, spec = dry_run("--launcher", "msrun", "--nnodes", 3, "--node-rank", 2, "--master-addr", "node0",
                               "--master-port", 8118, "--nproc-per-node", 4, "--log-dir", tmp_path,
                               "reshard", "src", "-o", "dst", "--world-size", 64)
    flags = flags_before_script(words)
    assert flags[:5] == ["--worker_num=12", "--local_worker_num=4", "--master_addr=node0", "--master_port=8118",
                         "--node_rank=2"]
    assert spec["job"] == "reshard" and spec["world_size"] == 64
    assert spec["src"] == str(Path("src").absolute()) and spec["out"] == str(Path("dst").absolute())
    assert env["HPCKPT_JOB_ID"] == "hpckpt-run-node0-8118"


def test_specs_carry_every_option_with_unset_ones_null(tmp_path):
    _, _, save = dry_run("--nproc-per-node", 8, "save", "-o", tmp_path / "ck", "--size", "1.5GiB", "--dtype", "bf16",
                         "--mesh", "2x4", "--placements", "R,S0", "--coordination", "storage", "--async")
    assert save == {"job": "save", "out": str(tmp_path / "ck"), "size": int(1.5 * 2**30), "dtype": "bf16",
                    "from": None, "mesh": "2x4", "placements": "R,S0", "rules": None, "layout_files": None,
                    "split": "balanced", "coordination": "storage", "async": True, "force": False, "fail_rank": None}
    _, _, load = dry_run("--nproc-per-node", 2, "load", tmp_path / "ck", "--check", "--no-strict")
    assert load == {"job": "load", "ckpt": str(tmp_path / "ck"), "mesh": None, "placements": None, "rules": None,
                    "layout_files": None, "split": "balanced", "check": True, "strict": False,
                    "broadcast_shared": "auto", "storage_bandwidth": None, "network_bandwidth": None}
    for given, want in (("always", True), ("never", False)):
        _, _, load = dry_run("--nproc-per-node", 2, "load", tmp_path / "ck", "--broadcast", given,
                             "--storage-bandwidth", "2GiB/s", "--network-bandwidth", "1000")
        assert (load["broadcast_shared"], load["storage_bandwidth"], load["network_bandwidth"]) == (want, 2**31, 1000)
    _, _, bench = dry_run("bench", "--from", tmp_path / "ck", "--rounds", 2)
    assert bench == {"job": "bench", "size": None, "from": str(tmp_path / "ck"), "dtype": None, "mesh": None,
                     "placements": None, "rules": None, "split": "balanced", "rounds": 2, "out": None}
    _, _, reshard = dry_run("reshard", tmp_path / "ck", "-o", tmp_path / "o", "--mesh", "2x2", "--placements", "S0,R",
                            "--include", "model.*", "--max-memory", "8MiB", "--no-fsync")
    assert set(reshard) == {"job", "src", "out", "to", "keep_replicas", "world_size", "split", "mesh", "placements", "rules", "layout_files",
                            "keep_layout", "include", "exclude", "dtype", "framework", "max_memory", "no_fsync",
                            "force", "parents", "no_manifest"}
    assert reshard["include"] == ["model.*"] and reshard["exclude"] is None and reshard["no_fsync"] is True
    assert reshard["to"] == "hyperparallel" and reshard["keep_replicas"] is False


# -- option checks ------------------------------------------------------------------------------

USAGE_ERRORS = [
    (["--nnodes", 2, "--node-rank", 2, "--master-addr", "a", "--master-port", 1, "selftest"], "--node-rank 2"),
    (["--nnodes", 2, "selftest"], "--master-addr and --master-port"),
    (["--launcher", "mpirun", "selftest"], "mpirun"),
    (["--nproc-per-node", 0, "selftest"], "--nproc-per-node"),
    (["--nproc-per-node", 2, "selftest", "--fail-rank", 2], "--fail-rank 2"),
    (["save", "-o", "x"], "exactly one of --size"),
    (["save", "-o", "x", "--size", "1MiB", "--from", "y"], "exactly one of --size"),
    (["save", "-o", "x", "--size", "lots"], "not a size"),
    (["--nproc-per-node", 4, "save", "-o", "x", "--size", "1MiB", "--mesh", "2x4", "--placements", "R,S0"], "holds 8 ranks"),
    (["--nproc-per-node", 4, "save", "-o", "x", "--size", "1MiB", "--mesh", "2x2"], "--mesh needs --placements"),
    (["--nproc-per-node", 4, "save", "-o", "x", "--size", "1MiB", "--mesh", "2x2", "--placements", "R"], "one placement per mesh dim"),
    (["--nproc-per-node", 4, "load", "x", "--placements", "S0"], "--placements needs --mesh"),
    (["--nproc-per-node", 4, "load", "x", "--mesh", "4", "--placements", "Q7"], "Q7"),
    (["reshard", "src", "-o", "dst"], "give exactly one target"),
    (["bench"], "exactly one of --size"),
]


@pytest.mark.parametrize("args, said", USAGE_ERRORS)
def test_wrong_options_are_one_usage_line(args, said):
    result = cli("run", "--dry-run", *args)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and said in result.stderr.splitlines()[0], result.stderr
    assert result.stdout == ""  # nothing launched, nothing printed


def test_a_missing_launcher_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    result = cli("run", "--launcher", "msrun", "--log-dir", tmp_path / "logs", "selftest", env={"PATH": str(tmp_path)})
    assert result.exit_code == errors.LauncherNotFoundError.exit_code
    assert result.stderr.splitlines()[0] == f"error: msrun not found next to {tmp_path / 'python'} nor on PATH"
    assert not (tmp_path / "logs").exists()


def test_the_cli_imports_no_framework_to_print_a_launch(tmp_path):
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "hpckpt", "run", "--dry-run", "--launcher", "msrun",
                          "--nproc-per-node", "2", "save", "-o", str(tmp_path), "--size", "1MiB"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "hpckpt" in imported and not imported & {"torch", "mindspore"}


def test_the_entry_script_sits_alone_and_is_installed():
    entry = launch_plan.ENTRY_SCRIPT
    assert entry.is_file()
    assert {p.name for p in entry.parent.iterdir()} - {"__pycache__"} == {"__init__.py", entry.name}
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {"hpckpt.dist.jobs", "hpckpt.dist.jobs.entry"} <= set(packages)


# -- stopping a job: the whole process tree ----------------------------------------------------

def test_stop_reaches_workers_in_sessions_of_their_own(tmp_path):
    """msrun puts each worker in a new session: killing the launcher's group would orphan them."""
    marker = tmp_path / "started"
    launcher = subprocess.Popen(["sh", "-c", f"setsid sleep 61 & setsid sleep 62 & touch {marker}; wait"],
                                start_new_session=True)
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = processes.descendants(launcher.pid)
    assert len(workers) == 2
    started = time.monotonic()
    processes.stop_job(launcher, {})
    assert time.monotonic() - started < processes.STOP_GRACE_SECONDS + 1
    assert launcher.returncode is not None
    assert not any(processes._alive(pid, start) for pid, start in workers.items())


# -- rank files, report and root cause ----------------------------------------------------------

def test_progress_files_are_throttled_and_summed(tmp_path):
    first, second = job_files.ProgressFile(tmp_path, 0), job_files.ProgressFile(tmp_path, 1)
    first.start(1000)
    second.start(500)
    for _ in range(100):
        first.advance(10)  # within one interval: written at most once
    assert job_files.read_run(tmp_path).progress()[0] < 1000
    first.phase("writing")
    assert job_files.read_run(tmp_path).progress() == (1000, 1500)
    assert job_files.read_run(tmp_path).phase(0) == "writing"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written aside, renamed


def _rank(run_dir: Path, rank: int, state: str, t: float = 0.0, **status):
    job_files.write_json(job_files.status_path(run_dir, rank),
                         {"rank": rank, "state": state, "kind": None, "exit_code": None, "error": None, "time": t,
                          **status})


def _plan(run_dir: Path, nproc: int, node_rank: int = 0, nnodes: int = 1) -> launch_plan.LaunchPlan:
    return launch_plan.LaunchPlan("torchrun", nproc, {"job": "selftest"}, run_dir, nnodes, node_rank, None, None)


def test_report_lists_this_node_s_ranks_and_totals(tmp_path):
    for rank, (nbytes, seconds) in {3: (100, 2.5), 2: (50, 4.0)}.items():
        _rank(tmp_path, rank, "ok", exit_code=0)
        job_files.write_json(job_files.result_path(tmp_path, rank),
                             {"rank": rank, "pid": 7, "bytes_written": nbytes, "seconds": seconds, "files": 1,
                              "format": "hp", "job_bytes_written": 150, "wait_seconds": seconds / 2})
    plan = _plan(tmp_path, 2, node_rank=1, nnodes=2)
    run = job_files.read_run(tmp_path)
    report.check_complete(plan, run)
    document = report.report(plan, run)
    assert [r["rank"] for r in document["ranks"]] == [2, 3]
    # seconds: the slowest rank's; job_*: the whole job's, the same on every rank
    assert document["totals"] == {"bytes_written": 150, "seconds": 4.0, "files": 2, "job_bytes_written": 150,
                                  "wait_seconds": 2.0}
    assert (document["job"], document["launcher"], document["world_size"], document["nodes"]) == ("selftest", "torchrun", 4, 2)
    assert document["log_dir"] == str(tmp_path)


def test_report_says_what_the_ranks_left_out_once_in_its_envelope(tmp_path):
    """A reshard's ranks each report what their share left out or warned of (the same entries,
    or none for a rank that wrote nothing): the document lists each once, the rows none."""
    skipped = [{"name": "extra.step", "reason": "not in the format"}]
    for rank, notes in {0: (skipped, ["layout: x"]), 1: (skipped + [{"name": "b", "reason": "r"}], ["layout: x"]),
                        2: ([], [])}.items():
        _rank(tmp_path, rank, "ok", exit_code=0)
        job_files.write_json(job_files.result_path(tmp_path, rank),
                             {"rank": rank, "bytes_written": 1, "skipped": notes[0], "converted": [], "warnings": notes[1]})
    document = report.report(_plan(tmp_path, 3), job_files.read_run(tmp_path))
    assert document["skipped"] == skipped + [{"name": "b", "reason": "r"}]
    assert document["warnings"] == ["layout: x"] and document["converted"] == []
    assert all(set(r) == {"rank", "bytes_written"} for r in document["ranks"])


def test_a_rank_without_result_makes_the_job_incomplete(tmp_path):
    _rank(tmp_path, 0, "ok")
    job_files.write_json(job_files.result_path(tmp_path, 0), {})
    _rank(tmp_path, 1, "running")
    with pytest.raises(errors.JobFailedError, match="rank 1 ended without reporting success") as err:
        report.check_complete(_plan(tmp_path, 2), job_files.read_run(tmp_path))
    assert err.value.exit_code == 22 and err.value.kind == "job-failed"


def test_root_cause_is_the_earliest_failure_not_about_another_rank(tmp_path):
    _rank(tmp_path, 2, "failed", 5.0, kind="save-failed", error="rank 0 failed: disk full")
    _rank(tmp_path, 1, "failed", 7.0, kind="corrupt-data", error="later")
    _rank(tmp_path, 0, "failed", 6.0, kind="no-space", error="no space left on device (/ck)")
    _rank(tmp_path, 3, "running")
    message = failures.root_cause(job_files.read_run(tmp_path), "", 1, tmp_path, tmp_path / "launcher.log")
    assert message == f"rank 0 failed: no space left on device (/ck) (log: {tmp_path / 'rank-0.log'})"


TORCHRUN_SUMMARY = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
/work/main/dist/jobs/entry/hpckpt_run_worker.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_01:48:45
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 12516)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 12516
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_01:48:45
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12517)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12517
=======================================================
"""  # torchrun 2.13's summary when rank 1 was SIGKILLed and torchrun stopped rank 0


def test_a_rank_that_died_without_a_report_is_named_from_the_launcher(tmp_path):
    _rank(tmp_path, 0, "running", pid=100)
    _rank(tmp_path, 1, "running", pid=101)
    run = job_files.read_run(tmp_path)
    log = tmp_path / "launcher.log"
    assert failures.root_cause(run, TORCHRUN_SUMMARY, 1, tmp_path, log) == (
        f"rank 1 exited without a report (killed by SIGKILL) (log: {tmp_path / 'rank-1.log'})")
    msrun = "[ERROR] ME(1:2,MainProcess): Worker process 101 exit with exception. Error code: 11.\n"
    assert failures.root_cause(run, msrun, None, tmp_path, log).startswith("rank 1 exited without a report (exit code 11)")
    msrun_unknown = "Worker process 555 exit with exception. Error code: 1.\n"
    assert failures.root_cause(run, msrun_unknown, None, tmp_path, log) == (
        f"a worker (pid 555) exited without a report (exit code 1) (log: {log})")
    assert failures.root_cause(run, "", 1, tmp_path, log) == f"rank 0 exited without a report (log: {tmp_path / 'rank-0.log'})"
    assert failures.root_cause(job_files.RunFiles(), "", 2, tmp_path, log) == (
        f"the launcher exited with exit code 2 before any rank reported (log: {log})")


def test_run_dir_default_is_new_under_one_documented_directory(monkeypatch, tmp_path):
    run_dir = launch_plan.default_run_dir("save")
    assert run_dir.parent == Path(os.environ.get("TMPDIR", "/tmp")) / "hpckpt-runs" and run_dir.name.startswith("save-")
    assert run_dir.name.endswith(f"-{os.getpid()}") and not run_dir.exists()
    monkeypatch.setenv("HPCKPT_LOG_DIR", str(tmp_path))
    assert launch_plan.default_run_dir("load").parent == tmp_path


def test_terminal_progress_sums_the_ranks_and_shows_rank_0_s_phase(tmp_path):
    from hpckpt.cli.run.progress import JobProgress as _JobProgress

    for rank, (done, total, phase) in enumerate([(10, 40, "writing"), (30, 60, "reading")]):
        job_files.write_json(job_files.progress_path(tmp_path, rank), {"done": done, "total": total, "phase": phase})
    with _JobProgress("save (2 ranks)") as progress:
        progress._terminal.enabled = True  # as on a terminal
        progress.show(job_files.read_run(tmp_path))
        (task,) = progress._terminal._progress.tasks
        assert (task.completed, task.total, task.description) == (40, 100, "save (2 ranks): writing")


def test_a_launcher_failing_after_the_ranks_is_said_so(tmp_path):
    _rank(tmp_path, 0, "ok", exit_code=0)
    run, log = job_files.read_run(tmp_path), tmp_path / "launcher.log"
    assert failures.root_cause(run, "", 1, tmp_path, log) == (
        f"the launcher exited with exit code 1 after every rank reported success (log: {log})")
    scheduler = "[ERROR] ME(9084:1,MainProcess): [_api.py:385] Scheduler process 9094 exit with exception.\n"
    assert failures.root_cause(run, scheduler, 1, tmp_path, log) == (
        f"msrun's scheduler failed (log: {tmp_path / 'scheduler.log'})")


ABORT_AFTER_OK = """
import json, os, sys
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
for rank in (0, 1):  # what the workers write before their barrier and teardown
    if rank == 1 and os.environ.get("UNREPORTED"):
        continue
    for name, doc in (("result", {"rank": rank, "seconds": 1.0}), ("status", {"rank": rank, "state": "ok", "time": 0})):
        with open(os.path.join(run_dir, f"{name}-{rank}.json"), "w") as f:
            json.dump(doc, f)
print(\"\"\"Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_08:02:03
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 2718)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 2718\"\"\")
sys.exit(1)
"""


def test_a_rank_dying_after_every_rank_reported_success_is_a_warning(tmp_path, monkeypatch):
    """torchrun exits 1 because rank 1 aborted in its interpreter's teardown, after every rank had
    reported success and its results: the job succeeded (its results stand), and the warning
    names the rank and its log. Without rank 1's report it is the failure it always was."""
    launcher = tmp_path / "fake_torchrun.py"
    launcher.write_text(ABORT_AFTER_OK)
    for unreported, ok in (("", True), ("1", False)):
        run_dir = tmp_path / f"run{unreported}"
        plan = launch_plan.LaunchPlan("torchrun", 2, {"job": "selftest"}, run_dir)
        monkeypatch.setattr(plan, "command", lambda: [sys.executable, str(launcher), *plan.worker_args()])
        monkeypatch.setenv("UNREPORTED", unreported)
        outcome = supervise.launch(plan)
        assert outcome.ok is ok and outcome.launcher_code == 1, outcome
        if ok:
            assert outcome.message == (f"rank 1 (killed by SIGABRT) died at exit after every rank had reported success: "
                                       f"the results stand; its interpreter's teardown failed "
                                       f"(log: {run_dir / 'rank-1.log'})")
            assert not report.unreported(plan, outcome.run)
        else:
            assert outcome.message.startswith("rank 1 exited without a report (killed by SIGABRT)"), outcome.message


def test_what_node_0_can_tell_is_refused_before_any_launcher_starts(tmp_path):
    """A missing source, an existing destination, a destination inside the source: one line,
    the error's own exit code, and no log directory (nothing was launched)."""
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "x").write_text("x")
    cases = [(3, ["load", tmp_path / "missing"], "no such file or directory"),
             (14, ["save", "-o", tmp_path / "ck", "--size", "1MiB"], "exists"),
             (16, ["reshard", tmp_path / "ck", "-o", tmp_path / "ck" / "out", "--world-size", "2"], "lies inside the source")]
    for code, args, said in cases:
        logs = tmp_path / f"logs-{code}"
        result = cli("run", "--nproc-per-node", 2, "--log-dir", logs, *args)
        assert result.exit_code == code, (args, result.stderr)
        assert said in result.stderr.splitlines()[0] and not logs.exists(), result.stderr
