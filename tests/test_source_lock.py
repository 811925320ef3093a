"""A checkpoint being read is never replaced under the reader, and a signal that comes while an
output is renamed into place does not fail a run whose output is complete.

- a reader (convert, paused mid-run by `kill_harness`) holds a shared lock on its source: a
  `--force` writer onto that source stops at once (exit 17) and changes nothing; the reader then
  finishes with an output byte-identical to an undisturbed run's;
- a reader started while a `--force` replacement of its source is under way stops (exit 17);
- SIGTERM inside the final renames: exit 0, one `warning:` line, an output that verifies.

Real processes (forked by `kill_harness`), real files.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import kill_harness as kh
from _util import normalized_tree
from hpckpt import api

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "tiny-hp"


def _wait_for(path: Path, child: kh.Child, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        pid, _ = os.waitpid(child.pid, os.WNOHANG)
        assert pid == 0, "the child ended before it reached the pause point"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


def _tree(root: Path) -> dict[str, bytes]:
    """Every file's bytes; a manifest without its run's command line and source path."""
    return normalized_tree({str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()})


def _checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    x, y = tmp_path / "X", tmp_path / "Y"
    assert kh.run(["reshard", str(TINY), "-o", str(x), "-w", "80", "-q", "--no-fsync"])[0] == 0
    assert kh.run(["reshard", str(TINY), "-o", str(y), "-w", "2", "-q", "--no-fsync"])[0] == 0
    return x, y


def test_force_onto_a_source_being_read_is_refused(tmp_path):
    x, y = _checkpoints(tmp_path)
    before = _tree(x)
    reference = tmp_path / "ref" / "model.safetensors"
    reference.parent.mkdir()
    assert kh.run(["convert", str(x), "-o", str(reference), "--jobs", "1", "-q"])[0] == 0

    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    # paused at its first pwrite (its destination lock's pid): the source's metadata is read
    reader = kh.start(["convert", str(x), "-o", str(out), "--jobs", "1", "-q"],
                      kh.Actions(pause_at=kh.Point(1, "pwrite"), folder=marks), stderr=tmp_path / "reader.err")
    try:
        _wait_for(marks / "paused", reader)
        err = tmp_path / "writer.err"
        code, _ = kh.run(["reshard", str(y), "-o", str(x), "--force", "-w", "80", "-q"], stderr=err)
        assert code == 17, err.read_text()
        assert f"{x} is being read by another hpckpt run; it cannot be replaced now" in err.read_text()
        assert _tree(x) == before
        assert not [n for n in os.listdir(tmp_path) if "hpckpt" in n]  # the writer left nothing
    finally:
        (marks / "resume").touch()
        code, _ = kh.finish(reader)
    assert code == 0, (tmp_path / "reader.err").read_text()
    assert _tree(out.parent) == _tree(reference.parent)

    # the reader is done: the same replacement now goes through
    assert kh.run(["reshard", str(y), "-o", str(x), "--force", "-w", "3", "-q"])[0] == 0
    assert api.inspect(x)["world_size"] == 3


def test_reading_a_source_being_replaced_is_refused(tmp_path):
    x, y = _checkpoints(tmp_path)
    marks = tmp_path / "marks"
    marks.mkdir()
    # paused at the mkdir of its staging directory: after it locked the destination it replaces
    writer = kh.start(["reshard", str(y), "-o", str(x), "--force", "-w", "3", "-q"],
                      kh.Actions(pause_at=kh.Point(1, "mkdir"), folder=marks), stderr=tmp_path / "writer.err")
    try:
        _wait_for(marks / "paused", writer)
        err = tmp_path / "reader.err"
        out = tmp_path / "model.safetensors"
        code, _ = kh.run(["convert", str(x), "-o", str(out), "--jobs", "1", "-q"], stderr=err)
        assert code == 17, err.read_text()
        assert f"{x} is being replaced by another hpckpt run" in err.read_text()
        assert not out.exists()
    finally:
        (marks / "resume").touch()
        code, _ = kh.finish(writer)
    assert code == 0, (tmp_path / "writer.err").read_text()
    assert api.inspect(x)["world_size"] == 3


def test_signal_during_the_final_renames_completes_the_run(tmp_path):
    out = tmp_path / "out"
    marks = tmp_path / "marks"
    marks.mkdir()
    err = tmp_path / "err"
    # the first rename is the staging directory's onto the destination, inside `critical()`
    child = kh.start(["reshard", str(TINY), "-o", str(out), "-w", "3", "--jobs", "1"],
                     kh.Actions(pause_at=kh.Point(1, "rename"), folder=marks), stderr=err)
    try:
        _wait_for(marks / "paused", child)
        assert not out.exists()
        os.kill(child.pid, signal.SIGTERM)
        time.sleep(0.1)  # the handler has run (it records the signal: the renames go on)
    finally:
        (marks / "resume").touch()
        code, _ = kh.finish(child)
    text = err.read_text()
    assert code == 0, text
    warnings = [line for line in text.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "SIGTERM" in warnings[0] and "after the output was complete" in warnings[0], text
    assert "error" not in text
    assert api.verify(out).exit_code == 0
    assert not [n for n in os.listdir(tmp_path) if "hpckpt" in n]
