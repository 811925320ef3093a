"""Outputs are whole or absent, whatever stops the run.

- kill -9 at 20 seeded-random points (file-system calls, counted by `kill_harness`) of every
  writing command: the destination is absent, refused by `verify`, or (killed after the commit
  rename) byte-identical to an uninterrupted run's; whatever else is left is a name `inspect` and
  `verify` explain with the command that removes it; the rerun's output is byte-identical to an
  uninterrupted run's and leaves nothing else behind;
- the same with `--force` over an older output: the old output, the new one, or nothing that
  verifies, never a mixture (a new sidecar with the old file);
- SIGINT, SIGTERM and SIGHUP during the write and during start-up: 130/143/129 within a second,
  one error line, no traceback, no staging data left;
- two runs on one destination: the second stops at once (exit 17, naming the first's pid) and
  removes nothing of the first, which completes.

The sweeps fork the test process (hpckpt already imported) for each run, two at a time, and
write onto a tmpfs when one can be mounted (real fsyncs cost a disk ~5 ms each, hundreds of them).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kill_harness as kh
from _util import file_tree, normalized_tree, write_row_sharded
from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.core.commit.leftovers import leftover
from hpckpt.core.errors import HpckptError

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "examples" / "tiny-hp"
HARNESS = Path(__file__).with_name("kill_harness.py")
HPCKPT = Path(sys.executable).with_name("hpckpt")
POINTS, SEED = 20, 10

# name -> (arguments after the source, destination name)
COMMANDS = {
    "reshard-hp": (["reshard", "-w", "3"], "out"),
    "consolidate-safetensors": (["consolidate"], "model.safetensors"),
    "consolidate-hf": (["consolidate", "--format", "hf"], "hf"),
    "consolidate-pt": (["consolidate", "--format", "pt"], "model.pt"),
    "consolidate-ms": (["consolidate", "--format", "ms"], "model.ckpt"),
    "consolidate-torch-dcp": (["consolidate", "--format", "torch-dcp"], "dcp"),
    "consolidate-hp": (["consolidate", "--format", "hp"], "hp"),
    "convert-hyperparallel": (["convert", "--to", "hyperparallel"], "hp"),
    "convert-torch-dcp": (["convert", "--to", "torch-dcp"], "dcp"),
    "convert-hf-sharded": (["convert", "--to", "hf-sharded"], "hf"),
    "convert-mindspore-ckpt": (["convert", "--to", "mindspore-ckpt"], "model.ckpt"),
    "convert-safetensors": (["convert", "--to", "safetensors"], "model.safetensors"),
    "convert-torch-save": (["convert", "--to", "torch-save"], "model.pt"),
    "convert-ms-torch": (["convert-ms-torch", "--to-format", "mindspore-ckpt"], "model.ckpt"),
}


def argv(name: str, dst: Path, *extra: str, src: Path = SRC) -> list[str]:
    command, _ = COMMANDS[name]
    jobs = [] if command[0] == "convert-ms-torch" else ["--jobs", "1"]  # (it has no --jobs)
    return [command[0], str(src), "-o", str(dst), *command[1:], *jobs, *extra]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every name under `root` (hidden ones too): a file's bytes, None for a directory; a
    manifest without the fields naming its run (`normalized_tree`)."""
    return normalized_tree(file_tree(root))


def verifies(path: Path) -> bool:
    try:
        return api.verify(path)["exit_code"] == 0
    except HpckptError:
        return False


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A tmpfs for the sweeps (a plain directory where mounting is not allowed)."""
    root = tmp_path_factory.mktemp("kill")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(root)],
                             capture_output=True).returncode == 0
    CliRunner().invoke(app, argv("reshard-hp", root / "warm-up"))  # imports done before forking
    yield root
    if mounted:
        subprocess.run(["umount", "-l", str(root)], check=False)


def in_pairs(jobs: list[tuple[list[str], kh.Actions]]) -> list[tuple[int, int | None]]:
    """Run forked children two at a time (the machine has two cores)."""
    results = []
    for i in range(0, len(jobs), 2):
        children = [kh.start(args, actions) for args, actions in jobs[i:i + 2]]
        results.extend(kh.finish(child) for child in children)
    return results


def kill_points(name: str, total: int) -> list[int]:
    return sorted(random.Random(f"{SEED}-{name}").sample(range(1, total + 1), min(POINTS, total)))


def outcome(folder: Path, out_name: str, complete: list[dict]) -> str:
    """What a killed run left in `folder`: no output, one `verify` refuses, or a whole one."""
    dst = folder / out_name
    state = tree(folder)
    kept = {k: v for k, v in state.items() if not k.startswith(".")}  # the output and its sidecar
    leftovers = sorted(k for k in state if k.startswith(".") and os.sep not in k)
    for name in leftovers:  # each one explained, with the command that removes it
        assert leftover(folder / name) is not None, (name, sorted(state))
    if not os.path.lexists(dst):
        for name in kept:
            assert leftover(folder / name) is not None, (name, sorted(state))  # an orphan sidecar
        return "absent"
    if not verifies(dst):
        return "refused"
    assert kept in complete, f"{dst} verifies but is neither the old nor the new output: {sorted(kept)}"
    return "complete"


@pytest.mark.parametrize("name", COMMANDS)
def test_kill_9_anywhere_leaves_nothing_that_verifies(name, scratch):
    root = scratch / name
    (root / "ref").mkdir(parents=True)
    _, out_name = COMMANDS[name]
    code, total = kh.run(argv(name, root / "ref" / out_name))
    assert code == 0 and total, (code, total)
    expected = tree(root / "ref")
    points = kill_points(name, total)
    folders = [root / f"kill-{n}" for n in points]
    for folder in folders:
        folder.mkdir()
    killed = in_pairs([(argv(name, f / out_name), kh.Actions(kill_at=kh.Point(n))) for f, n in zip(folders, points)])
    seen = {}
    for n, folder, (code, _) in zip(points, folders, killed):
        assert code == -signal.SIGKILL, f"call {n} of {total}: exit {code}, not killed"
        seen[n] = outcome(folder, out_name, [expected])
    # killed after the commit, the output is there: rerunning the command means replacing it
    reruns = in_pairs([(argv(name, f / out_name, *(["--force"] if seen[n] == "complete" else [])), kh.Actions())
                       for f, n in zip(folders, points)])
    for n, folder, (code, _) in zip(points, folders, reruns):
        assert code == 0, f"rerun after a kill at call {n} of {total}: exit {code}"
        assert tree(folder) == expected, f"rerun after a kill at call {n} of {total}: {sorted(tree(folder))}"
    print(f"{name}: {total} calls, killed at {points}: {sorted(seen.values()).count('absent')} absent, "
          f"{list(seen.values()).count('refused')} refused by verify, {list(seen.values()).count('complete')} complete")


# an older output, different from what the command writes now (fewer entries, another layout)
OLDER = {"consolidate-safetensors": ["--exclude", "optimizer.*"], "reshard-hp": ["-w", "2"],
         "convert-torch-save": ["--exclude", "optimizer.*"]}


@pytest.mark.parametrize("name", OLDER)
def test_kill_9_while_replacing_leaves_the_old_output_or_the_new(name, scratch):
    root = scratch / f"force-{name}"
    _, out_name = COMMANDS[name]
    (root / "old").mkdir(parents=True)
    (root / "new").mkdir()
    old_args = argv(name, root / "old" / out_name)
    old_args[old_args.index("--jobs"):old_args.index("--jobs")] = OLDER[name]
    assert kh.run(old_args)[0] == 0
    code, total = kh.run(argv(name, root / "new" / out_name, "--force"))
    assert code == 0
    old, new = tree(root / "old"), tree(root / "new")
    assert old != new
    points = kill_points(name + "-force", total)
    folders = [root / f"kill-{n}" for n in points]
    for folder in folders:
        folder.mkdir()
        for rel, data in old.items():
            (folder / rel).mkdir() if data is None else (folder / rel).write_bytes(data)
    killed = in_pairs([(argv(name, f / out_name, "--force"), kh.Actions(kill_at=kh.Point(n)))
                       for f, n in zip(folders, points)])
    moved_aside = []
    for n, folder, (code, _) in zip(points, folders, killed):
        assert code == -signal.SIGKILL, f"call {n} of {total}: exit {code}, not killed"
        outcome(folder, out_name, [old, new])
        if any(".hpckpt-tmp-old-" in name for name in os.listdir(folder)) and not (folder / out_name).exists():
            moved_aside.append(folder)
    # killed with the old output moved aside: the next run puts it back (and, without --force, keeps it)
    again = in_pairs([(argv(name, f / out_name), kh.Actions()) for f in moved_aside])
    for folder, (code, _) in zip(moved_aside, again):
        assert code == 14 and {k: v for k, v in tree(folder).items() if not k.startswith(".")} == old, folder
    reruns = in_pairs([(argv(name, f / out_name, "--force"), kh.Actions()) for f in folders])
    for n, folder, (code, _) in zip(points, folders, reruns):
        assert code == 0 and tree(folder) == new, f"rerun after a kill at call {n}: exit {code}"
    print(f"{name} --force: {total} calls, {len(moved_aside)} of {len(points)} kills left the old output "
          "moved aside (put back by the next run)")


# -- fan-out: jobs writing their own ranks into one directory, then --finalize ----------------

FAN_OUT = [["reshard", str(SRC), "-o", "{out}", "-w", "4", "--rank", "0-1", "--jobs", "1"],
           ["reshard", str(SRC), "-o", "{out}", "-w", "4", "--rank", "2-3", "--jobs", "1"],
           ["reshard", "--finalize", "{out}"]]


def test_kill_9_anywhere_in_a_fan_out_never_leaves_a_checkpoint_that_verifies_too_early(scratch):
    """Each step of a fan-out (two shares, then --finalize) killed at seeded points: before the
    finalize has written the metadata nothing verifies; rerunning the killed step and the rest
    gives the one-process reshard's bytes and nothing else."""
    import shutil

    root = scratch / "fan-out"
    (root / "ref").mkdir(parents=True)
    assert kh.run(["reshard", str(SRC), "-o", str(root / "ref" / "out"), "-w", "4", "--jobs", "1"])[0] == 0
    expected = tree(root / "ref")
    before = root / "before-0"  # the state each step starts from
    before.mkdir()
    outcomes = []
    for step, template in enumerate(FAN_OUT):
        probe = root / f"probe-{step}"
        shutil.copytree(before, probe, symlinks=True)
        step_argv = [a.format(out=probe / "out") for a in template]
        code, total = kh.run(step_argv)
        assert code == 0 and total, (step, code)
        points = kill_points(f"fan-out-{step}", total)[:7]
        folders = [root / f"step{step}-kill-{n}" for n in points]
        for folder in folders:
            shutil.copytree(before, folder, symlinks=True)
        argvs = [[a.format(out=f / "out") for a in template] for f in folders]
        killed = in_pairs([(a, kh.Actions(kill_at=kh.Point(n))) for a, n in zip(argvs, points)])
        for n, folder, (code, _) in zip(points, folders, killed):
            assert code == -signal.SIGKILL, f"step {step}, call {n} of {total}: exit {code}, not killed"
            done = step == len(FAN_OUT) - 1 and verifies(folder / "out")
            if not done:
                assert not verifies(folder / "out"), f"step {step}, call {n}: verifies before --finalize ended"
            outcomes.append("complete" if done else "refused")
        # the killed step again (a finalize that got its metadata out has nothing left to do), then the rest
        for folder in folders:
            for later, rest in enumerate(FAN_OUT[step:], start=step):
                args = [a.format(out=folder / "out") for a in rest]
                code = kh.run(args)[0]
                finished_already = later == len(FAN_OUT) - 1 and code == 4 and verifies(folder / "out")
                assert code == 0 or finished_already, (step, folder.name, later, code)
            assert tree(folder) == expected, (step, folder.name, sorted(set(tree(folder)) ^ set(expected)))
        before = probe
    print(f"fan-out: {len(outcomes)} kills, {outcomes.count('complete')} after the metadata was written")


# -- signals ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
    """4 MB in row shards over 2 ranks; resharded to column shards every tile is gathered."""
    return write_row_sharded(tmp_path_factory.mktemp("big") / "src")


def as_from_a_terminal() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job gets it (a test run in the
    background inherits it ignored, and hpckpt leaves an ignored signal ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.002)


def stopped(proc: subprocess.Popen, signum: int) -> float:
    """Send `signum`; the seconds until the process has exited."""
    sent = time.monotonic()
    proc.send_signal(signum)
    proc.wait(timeout=30)
    return time.monotonic() - sent


SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_the_write_stops_the_run_within_a_second(signum, tmp_path, big_source):
    marks, out = tmp_path / "marks", tmp_path / "out"
    marks.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), "--mark-at", "ftruncate:2", "--slow", "0.05", "--dir", str(marks), "--",
         "reshard", str(big_source), "-o", str(out), "--mesh", "2", "--placements", "S1", "--max-memory", "64KiB"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_terminal)
    wait_for(marks / "marked", proc)  # the engine is filling its first file, slowly
    time.sleep(0.2)
    staging = tmp_path / f".out.hpckpt-tmp-{proc.pid}"
    assert staging.is_dir() and os.listdir(staging)
    seconds = stopped(proc, signum)
    stderr = proc.communicate()[1]
    assert proc.returncode == 128 + signum, (proc.returncode, stderr)
    assert stderr == f"error: interrupted ({signal.Signals(signum).name})\n"
    assert seconds < 1.0, seconds
    assert sorted(os.listdir(tmp_path)) == ["marks"]  # no staging data, no lock file, no output
    print(f"{signal.Signals(signum).name} during the write: exit {proc.returncode} after {seconds:.3f} s")


def handler_installed(pid: int) -> bool:
    """True once the process catches SIGTERM: hpckpt's handlers are in (SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_start_up_exits_cleanly(signum, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([str(HPCKPT), "reshard", str(SRC), "-o", str(out), "-w", "3"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_terminal)
    deadline = time.monotonic() + 30
    while not handler_installed(proc.pid):  # the first thing hpckpt does; its imports follow
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.0005)
    seconds = stopped(proc, signum)
    stderr = proc.communicate()[1]
    assert proc.returncode == 128 + signum, (proc.returncode, stderr)
    assert stderr == f"error: interrupted ({signal.Signals(signum).name})\n"
    assert seconds < 1.0, seconds
    assert os.listdir(tmp_path) == []


# -- two runs, one destination --------------------------------------------------------------


def test_a_second_run_on_one_destination_stops_at_once(tmp_path):
    marks, out = tmp_path / "marks", tmp_path / "out"
    marks.mkdir()
    first = subprocess.Popen([sys.executable, str(HARNESS), "--pause-at", "pwrite:2", "--dir", str(marks), "--",
                              "reshard", str(SRC), "-o", str(out), "-w", "3", "--jobs", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(marks / "paused", first)  # the first run is in the middle of its write
        staging = tmp_path / f".out.hpckpt-tmp-{first.pid}"
        held = tree(staging)
        for extra in ([], ["--force"]):
            started = time.monotonic()
            second = subprocess.run([str(HPCKPT), "reshard", str(SRC), "-o", str(out), "-w", "3", *extra],
                                    capture_output=True, text=True, timeout=60)
            seconds = time.monotonic() - started
            assert second.returncode == 17, (second.returncode, second.stderr)
            assert f"pid {first.pid}" in second.stderr and "Traceback" not in second.stderr
            assert seconds < 1.5, seconds  # start-up included (~0.3 s on an idle machine)
            assert tree(staging) == held  # nothing of the first run removed
        (marks / "resume").touch()
        assert first.wait(timeout=60) == 0, first.stderr.read()
    finally:
        (marks / "resume").touch()
        first.wait(timeout=60)
        first.stderr.close()
    assert verifies(out)
    assert sorted(os.listdir(tmp_path)) == ["marks", "out"]  # the lock file went with the run
    print(f"second run on a locked destination: exit 17 after {seconds:.3f} s (start-up included)")
