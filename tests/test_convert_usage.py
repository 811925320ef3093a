"""`convert` / `convert-ms-torch` refusals that happen before anything is read or written: each
exits with its documented code (2 usage, 5 unknown format) and leaves no output."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from _util import FIXTURES

SOURCE = FIXTURES / "m0-torch-4rank"


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("extra, says", [
    (["--to", "bogus"], "'bogus' is not one of 'hyperparallel', 'hp', 'torch-dcp'"),
    (["--to", "pt", "--world-size", "2"], "layout options apply to hp, torch-dcp and mindformers targets"),
    (["--to", "hp", "--placements", "R"], "--placements goes with --mesh"),
    (["--to", "pt", "--names", "nosuchpreset"], "no preset or rules file 'nosuchpreset'"),
    (["--to", "pt", "--framework", "jax"], "'jax' is not one of 'torch', 'mindspore'"),
])
def test_usage_errors_exit_2_and_write_nothing(tmp_path, extra, says):
    out = tmp_path / "out"
    proc = run("convert", SOURCE, "-o", out, *extra)
    assert proc.returncode == 2, proc.stderr
    assert says in " ".join(proc.stderr.split()), proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_bad_rules_file_is_one_error_line(tmp_path):
    rules = tmp_path / "bad.toml"
    rules.write_text('[[rule]]\nmatch = "("\n')
    proc = run("convert", SOURCE, "-o", tmp_path / "x.pt", "--names", rules)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and str(rules) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.pt").exists()


def test_ms_torch_direction_that_cannot_be_told_is_refused(tmp_path):
    """A plain safetensors file with neutral names: neither its metadata nor its names say
    which framework wrote it, so convert-ms-torch asks for --to instead of guessing."""
    src = tmp_path / "anon.safetensors"
    save_file({"w": np.ones(2, np.float32)}, str(src))
    proc = run("convert-ms-torch", src, "-o", tmp_path / "out.safetensors")
    assert proc.returncode == 5, proc.stderr
    assert proc.stderr.splitlines()[0] == f"error: {src}: cannot tell whether MindSpore or PyTorch wrote it"
    assert "--to torch or --to mindspore" in proc.stderr and not (tmp_path / "out.safetensors").exists()
    proc = run("convert-ms-torch", src, "-o", tmp_path / "out.safetensors", "--to", "jax")
    assert proc.returncode == 2, proc.stderr
