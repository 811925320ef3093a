"""Outputs are whole or absent: where a run may write, what it may replace, a full disk, failed
writes, sidecars, leftovers and their names, and a fan-out finalized from changed files.

Killed runs, signals and two runs on one destination: test_kill.py.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import kill_harness as kh
from _util import write_row_sharded
from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.core.geometry.layout import LayoutSpec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-hp"
PAGE = 4096
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def snapshot(path: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every name under `path` (hidden ones too), a file with its bytes and mtime."""
    return {p.relative_to(path).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(path.rglob("*"))}


@pytest.fixture
def src(tmp_path):
    """A writable copy of the tiny checkpoint: that it does not change is checked, not assumed."""
    copy = tmp_path / "src"
    shutil.copytree(TINY, copy)
    return copy


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# -- where an output may go -----------------------------------------------------------------


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["", "force"])
def test_a_destination_overlapping_the_source_is_refused(src, tmp_path, force):
    before = snapshot(src)
    link = tmp_path / "link"
    link.symlink_to(src)
    for dst in (src, src / "inside", tmp_path, link):
        result = cli("reshard", src, "-o", dst, "-w", "2", *force)
        assert result.exit_code == 16, (dst, result.exit_code, result.stderr)
        assert "source" in result.stderr and "Traceback" not in result.stderr
    result = cli("consolidate", src, "-o", src / "model.safetensors", *force)
    assert result.exit_code == 16, result.stderr
    assert snapshot(src) == before


def test_a_single_file_source_may_have_its_output_beside_it_but_not_over_it(src, tmp_path):
    one = tmp_path / "one.safetensors"
    assert cli("consolidate", src, "-o", one).exit_code == 0
    before = one.read_bytes()
    assert cli("convert", one, "-o", tmp_path / "two.pt").exit_code == 0  # same directory: fine
    for dst, extra in ((one, ["--force"]), (tmp_path, ["--to", "hf", "--force"])):
        result = cli("convert", one, "-o", dst, *extra)
        assert result.exit_code == 16, (dst, result.exit_code, result.stderr)
    assert one.read_bytes() == before


def test_force_replaces_only_checkpoints_and_empty_directories(src, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for i in range(12):
        (home / f"file{i}.txt").write_text("mine")
    before = snapshot(home)
    result = cli("reshard", src, "-o", home, "-w", "2", "--force")
    assert result.exit_code == 16, result.stderr
    assert f"refusing to replace {home}: it holds 12 entries and no checkpoint" in result.stderr
    assert snapshot(home) == before
    notes = tmp_path / "notes.pt"
    notes.write_text("not a checkpoint")
    assert cli("consolidate", src, "-o", notes, "--format", "pt", "--force").exit_code == 16
    assert notes.read_text() == "not a checkpoint"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("reshard", src, "-o", empty, "-w", "2", "--force").exit_code == 0
    assert cli("reshard", src, "-o", empty, "-w", "3", "--force").exit_code == 0  # one of ours
    assert api.verify(empty)["exit_code"] == 0 and (empty / "_rank2_.safetensors").is_file()


def test_odd_destinations_are_documented_errors(src, tmp_path):
    result = cli("consolidate", src, "-o", "/dev/null")
    assert result.exit_code == 14, result.stderr
    result = cli("consolidate", src, "-o", "/dev/null", "--force")
    assert result.exit_code == 16 and "neither a regular file nor a directory" in result.stderr, result.stderr
    assert Path("/dev/null").is_char_device() and not list(Path("/dev").glob(".null.hpckpt-*"))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for extra in ([], ["--parents"]):
        result = cli("reshard", src, "-o", a_file / "out", "-w", "2", *extra)
        assert result.exit_code == 3 and "is not a directory" in result.stderr, result.stderr
    folder = tmp_path / "folder"
    folder.mkdir()
    result = cli("consolidate", src, "-o", folder, "--force")  # a file output never replaces a directory
    assert result.exit_code == 14 and "is a directory" in result.stderr, result.stderr


def test_missing_parents_are_an_error_unless_asked_for(src, tmp_path):
    dst = tmp_path / "a" / "b" / "out"
    result = cli("reshard", src, "-o", dst, "-w", "2")
    assert result.exit_code == 3 and "--parents" in result.stderr, result.stderr
    assert not (tmp_path / "a").exists()
    assert cli("reshard", src, "-o", dst, "-w", "2", "--parents").exit_code == 0
    assert api.verify(dst)["exit_code"] == 0
    api.reshard(src, tmp_path / "c" / "out", LayoutSpec.for_world_size(2), settings=api.WriteSettings(parents=True))


# -- sidecars -------------------------------------------------------------------------------


def test_an_existing_sidecar_is_part_of_the_destination(src, tmp_path):
    out = tmp_path / "model.safetensors"
    sidecar = tmp_path / "model.values.json"
    sidecar.write_text('{"step": {"type": "int", "value": 1}}\n')
    out.write_bytes(b"")  # the file of that sidecar: replacing the output replaces both
    result = cli("consolidate", src, "-o", out)
    assert result.exit_code == 14 and str(out) in result.stderr, result.stderr
    assert sidecar.read_text().startswith('{"step"')
    out.unlink()  # a sidecar of ours whose file is gone describes nothing: replaced, no --force needed
    assert cli("consolidate", src, "-o", out).exit_code == 0
    assert api.verify(out)["exit_code"] == 0 and '"step"' not in sidecar.read_text()
    sidecar.write_text('{"step": {"type": "int", "value": 1}}\n')
    assert cli("consolidate", src, "-o", out, "--force").exit_code == 0  # a values sidecar: replaced
    assert api.verify(out)["exit_code"] == 0 and '"step"' not in sidecar.read_text()
    # a new output without values takes the old sidecar away with the old file
    assert cli("consolidate", src, "-o", out, "--include", "model.*", "--force").exit_code == 0
    assert not sidecar.exists() and not api.inspect(out)["counts"]["values"]
    sidecar.write_text("not json")
    assert cli("consolidate", src, "-o", out, "--force").exit_code == 16  # not a sidecar of ours
    assert sidecar.read_text() == "not json"


def test_leftovers_are_named_with_the_command_that_removes_them(src, tmp_path):
    out = tmp_path / "model.safetensors"
    assert cli("consolidate", src, "-o", out).exit_code == 0
    out.unlink()
    result = cli("inspect", tmp_path / "model.values.json")
    assert result.exit_code == 4, result.stderr
    assert "values sidecar of" in result.stderr and f"rm {tmp_path / 'model.values.json'}" in result.stderr
    pid = dead_pid()
    staging = tmp_path / f".out.hpckpt-tmp-{pid}"
    shutil.copytree(TINY, staging)  # even a whole checkpoint in it
    result = cli("verify", staging)
    assert result.exit_code == 4, result.stderr
    assert (f"{staging} is the staging directory of an unfinished hpckpt run (pid {pid}, no longer running); "
            f"remove it with `rm -r {staging}` or rerun the command") in result.stderr, result.stderr
    running = tmp_path / f".out.hpckpt-tmp-{os.getpid()}"
    running.mkdir()
    result = cli("inspect", running)
    assert result.exit_code == 4 and "still running" in result.stderr and "rm " not in result.stderr
    lock = tmp_path / ".out.hpckpt-lock"
    lock.write_text(f"{pid}\n")
    result = cli("inspect", lock)
    assert result.exit_code == 4 and "lock file" in result.stderr and "rm " in result.stderr


def test_a_run_removes_its_own_leftovers_and_only_those(src, tmp_path):
    dead = dead_pid()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        removed = [f".out.hpckpt-tmp-{dead}", f".out.hpckpt-tmp-old-{dead}"]
        kept = [f".out.hpckpt-tmp-{alive.pid}", f".other.hpckpt-tmp-{dead}", ".out.hpckpt-tmp-*",
                f".out.hpckpt-tmp-{dead}x", f"..out.hpckpt-tmp-{dead}", f"out.hpckpt-tmp-{dead}"]
        for name in removed + kept:
            (tmp_path / name).mkdir()
            (tmp_path / name / "f").write_text("x")
        shutil.copytree(TINY, tmp_path / "out")  # (so the old output moved aside is not put back)
        assert cli("reshard", src, "-o", tmp_path / "out", "-w", "2", "--force").exit_code == 0
        assert sorted(os.listdir(tmp_path)) == sorted(kept + ["out", "src"])
    finally:
        alive.kill()
        alive.wait()


def test_an_old_output_a_killed_run_moved_aside_is_put_back(src, tmp_path):
    """Killed while replacing (`--force`) between moving the old output aside and renaming the new
    one in: the next run puts the old one back, and without --force leaves it there."""
    aside = tmp_path / f".out.hpckpt-tmp-old-{dead_pid()}"
    shutil.copytree(TINY, aside)
    result = cli("reshard", src, "-o", tmp_path / "out", "-w", "2")
    assert result.exit_code == 14, result.stderr
    assert snapshot(tmp_path / "out") == snapshot(TINY)  # the same files, bytes and mtimes
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


# -- a full disk, a failed write ------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MiB tmpfs (None where mounting is not allowed: the tests inject ENOSPC instead)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        yield None
        return
    try:
        (disk / "keep.txt").write_text("was there before")
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """3.8 MiB: more than the small disk holds."""
    return write_row_sharded(tmp_path_factory.mktemp("big") / "src")


WRITES = {"reshard": (["reshard", "-w", "3"], "out"), "consolidate": (["consolidate"], "model.safetensors")}


def command(which: str, source: Path, folder: Path) -> list[str]:
    args, name = WRITES[which]
    return [args[0], str(source), "-o", str(folder / name), *args[1:], "--jobs", "1"]


def run_logged(args: list[str], tmp_path: Path, actions: kh.Actions = kh.Actions()) -> tuple[int, str]:
    log = tmp_path / "stderr.txt"
    code, _ = kh.run(args, actions, stderr=log)
    return code, log.read_text()


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill_to(disk: Path, left: int) -> None:
    """Take space until exactly `left` bytes are free (tmpfs counts whole pages)."""
    with open(disk / "filler", "wb") as f:
        f.write(bytes(free(disk) - left))
    assert free(disk) == left, (free(disk), left)


@pytest.mark.parametrize("which", WRITES)
def test_an_output_that_cannot_fit_fails_before_writing(which, small_disk, big, tmp_path):
    before_src = snapshot(big)
    if small_disk is None:
        pytest.skip("cannot mount a tmpfs here: test_a_full_disk_during_the_write injects ENOSPC instead")
    before = snapshot(small_disk)
    code, stderr = run_logged(command(which, big, small_disk), tmp_path)
    assert code == 18, stderr
    dst = small_disk / WRITES[which][1]
    assert stderr.startswith(f"error: no space left on device writing {dst} (needed ~3.8 MiB, free 2.0 MiB)"), stderr
    assert snapshot(small_disk) == before and snapshot(big) == before_src


@pytest.mark.parametrize("which", WRITES)
def test_a_disk_filling_up_during_the_write_leaves_nothing(which, small_disk, tmp_path):
    """The free-space check passes (the data files fit) but the whole output does not: one page
    short. ENOSPC comes from the engine or the metadata write, never as an internal error."""
    reference = tmp_path / "reference"
    reference.mkdir()
    assert cli(*command(which, TINY, reference)).exit_code == 0
    pages = sum(-(-p.stat().st_size // PAGE) for p in reference.rglob("*") if p.is_file())
    if small_disk is None:  # no tmpfs: the same failure, injected where the engine writes
        code, stderr = run_logged(command(which, TINY, tmp_path), tmp_path,
                                  kh.Actions(fail_at=kh.Point(1, "pwrite"), fail_errno=errno.ENOSPC))
        assert code == 18 and "no space left on device" in stderr, stderr
        return
    fill_to(small_disk, pages * PAGE)  # a page for the lock file, one page short for the output
    before = snapshot(small_disk)
    code, stderr = run_logged(command(which, TINY, small_disk), tmp_path)
    assert code == 18, stderr
    assert stderr.startswith("error: no space left on device writing ") and "Traceback" not in stderr, stderr
    assert snapshot(small_disk) == before


@pytest.mark.parametrize(("point", "err", "code"), [
    ("ftruncate:2", errno.EDQUOT, 18), ("fsync:1", errno.EIO, 19), ("mkdir:1", errno.EACCES, 19),
    ("write:1", errno.EROFS, 19), ("commit", errno.EIO, 19)])
@pytest.mark.parametrize("which", WRITES)
def test_a_failed_write_is_one_documented_error_and_leaves_nothing(which, point, err, code, tmp_path):
    out = tmp_path / "out-dir"
    out.mkdir()
    if point == "commit":  # the rename into place (a file's sidecar is already linked in by then)
        point = {"reshard": "rename:1", "consolidate": "replace:1"}[which]
    failing = kh.Actions(fail_at=kh.Point.parse(point), fail_errno=err)
    got, stderr = run_logged(command(which, TINY, out), tmp_path, failing)
    assert got == code, (point, stderr)
    lines = stderr.splitlines()
    assert lines[0].startswith("error: ") and "Traceback" not in stderr and len(lines) <= 2, stderr
    assert ("no space left" if code == 18 else os.strerror(err)) in lines[0], stderr
    assert os.listdir(out) == []


def test_a_full_disk_in_a_mapped_copy_is_the_disk_error(tmp_path):
    """A run of 4 MiB or more is written from a mapping of its source (`engine.MAP_MIN`): a write
    failing there is still exit 18, not the mapping's BufferError when it is closed under the
    failed write's traceback."""
    from safetensors.numpy import save_file

    from hpckpt.core.io import box_filler as engine  # where the mapped copies are

    src = tmp_path / "big.safetensors"
    save_file({"w": np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024)}, str(src))
    assert src.stat().st_size > 2 * engine.MAP_MIN
    out = tmp_path / "out-dir"
    out.mkdir()
    args = ["reshard", str(src), "-o", str(out / "ckpt"), "-w", "1", "--jobs", "1"]
    code, stderr = run_logged(args, tmp_path, kh.Actions(fail_at=kh.Point(4, "pwrite"), fail_errno=errno.ENOSPC))
    assert code == 18 and stderr.startswith("error: no space left on device writing "), stderr
    assert "Traceback" not in stderr and "BufferError" not in stderr, stderr
    assert os.listdir(out) == []
    code, stderr = run_logged(args, tmp_path)  # and the same copy, not failed, is whole
    assert code == 0, stderr
    assert cli("diff", src, out / "ckpt").exit_code == 0


@pytest.mark.parametrize("rows", [3072, 512], ids=["mapped-12MiB", "buffered-2MiB"])
def test_a_source_truncated_during_the_copy_is_corrupt_data(rows, tmp_path):
    """A source cut short after it was read (another process truncates it while the run waits
    before its first data write) is found where the copy reads it, mapped (the size check before
    mapping: no SIGBUS) or through the piece buffer: exit 9, one line, nothing left."""
    import time

    from safetensors.numpy import save_file

    src = tmp_path / "src.safetensors"
    save_file({"w": np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)}, str(src))
    out = tmp_path / "out-dir"
    out.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    err = tmp_path / "stderr.txt"
    child = kh.start(["reshard", str(src), "-o", str(out / "ckpt"), "-w", "1", "--jobs", "1"],
                     kh.Actions(pause_at=kh.Point(2, "pwrite"), folder=marks), stderr=err)
    try:
        deadline = time.monotonic() + 60
        while not (marks / "paused").exists():
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.01)
        os.truncate(src, 4096)
    finally:
        (marks / "resume").touch()
        code, _ = kh.finish(child)
    stderr = err.read_text()
    lines = stderr.splitlines()
    assert code == 9, stderr
    assert lines[0].startswith(f"error: {src}: truncated: needed bytes ") and "Traceback" not in stderr, stderr
    assert "changed during the run" in stderr and len(lines) <= 2, stderr
    assert os.listdir(out) == []


# -- fan-out --------------------------------------------------------------------------------


def test_finalize_refuses_a_fragment_changed_after_its_job(src, tmp_path):
    fan = tmp_path / "fan"
    for rank in (0, 1):
        api.reshard(src, fan, LayoutSpec.for_world_size(2), ranks=[rank])
    rank1 = fan / "_rank1_.safetensors"
    whole = rank1.read_bytes()
    rank1.write_bytes(whole[:100])  # truncated
    result = cli("reshard", "--finalize", fan)
    assert result.exit_code == 9 and str(rank1) in result.stderr, result.stderr
    rank1.write_bytes(whole[:-4] + b"\0\0\0\0")  # same size, other bytes, written later
    result = cli("reshard", "--finalize", fan)
    assert result.exit_code == 9 and "changed since" in result.stderr, result.stderr
    assert not (fan / ".metadata").exists()
    api.reshard(src, fan, LayoutSpec.for_world_size(2), ranks=[1])  # the rank rerun: finalize works
    assert cli("reshard", "--finalize", fan).exit_code == 0
    assert api.verify(fan)["exit_code"] == 0
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []  # the lock file went with finalize
