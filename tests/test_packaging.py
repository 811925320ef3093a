"""The package installs as one `hpckpt` package, starts without frameworks, and CI runs the README."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from _util import REPO


def _run(args, cwd=None):
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd)


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    test_command = next(b.strip() for b in blocks if "pytest" in b)
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert test_command in ci_lines


def test_core_adapters_and_api_import_no_framework(tmp_path):
    code = (
        "import sys, hpckpt.core.safety.unpickle, hpckpt.core.io.read, hpckpt.core.safety.validate, hpckpt.converters, hpckpt.api, hpckpt.cli.app\n"
        "import hpckpt.dist, hpckpt.dist.stateful, hpckpt.dist.call_forms, hpckpt.dist.output_formats\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mindspore'))\n"
        "print(bad)"
    )
    out = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_only_hpckpt_is_installed_at_top_level(tmp_path):
    code = "import importlib.util as u; print([n for n in ('cli', 'core', 'converters') if u.find_spec(n)])"
    out = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    out = _run([sys.executable, "-c", "import hpckpt.core, hpckpt.cli, hpckpt.converters; print('ok')"], cwd=tmp_path)
    assert out.stdout.strip() == "ok", out.stderr


def test_version_from_console_script_and_module(tmp_path):
    from hpckpt import __version__

    from pathlib import Path

    exe = str(Path(sys.executable).parent / "hpckpt")
    for args in ([exe, "--version"], [sys.executable, "-m", "hpckpt", "--version"]):
        out = _run(args, cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.strip() == f"hpckpt {__version__}", out


def test_env_reports_what_a_bug_report_needs():
    out = _run([sys.executable, "-m", "hpckpt", "env", "--json"])
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    for key in ("hpckpt", "python", "platform", "numpy", "safetensors", "torch", "mindspore"):
        assert info[key], key
    import numpy
    assert info["numpy"] == numpy.__version__


def test_every_subpackage_is_listed_for_installation():
    """A wheel holds only the packages pyproject.toml lists: a new subpackage left out would be
    missing from every real (non-editable) install while the editable one works."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"hpckpt"} | {
        "hpckpt." + ".".join(p.parent.relative_to(REPO).parts)
        for top in ("api", "cli", "core", "converters", "dist") for p in (REPO / top).rglob("__init__.py")
    }
    assert listed == found


def test_library_example_runs(tmp_path):
    """The `hpckpt.api` example of docs/library.md is what a user types: it must run as shown, from
    the repo root, and write what it says (tests/test_docs.py runs every other block)."""
    import shutil

    page = (REPO / "docs" / "library.md").read_text()
    code = re.search(r"## `hpckpt.api`.*?```python\n(.*?)```", page, re.S).group(1)
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    out = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "torch-dcp" / ".metadata").is_file() and (tmp_path / "out" / "model.ckpt").is_file()


def _typer_bounds() -> tuple[str, str]:
    """The lowest and the exclusive upper typer version pyproject.toml allows."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if d.startswith("typer"))
    low, high = re.fullmatch(r"typer>=([\d.]+),<([\d.]+)", spec).groups()
    return low, high


@pytest.mark.parametrize("bound", ["lowest", "highest"])
def test_cli_works_with_the_lowest_and_highest_typer_allowed(tmp_path, bound):
    """The range in pyproject.toml is what is tested: each end is installed on its own (pip, from
    the registry; no network is a failure, not a skip) and the CLI's answers are checked with it."""
    low, high = _typer_bounds()
    requirement = f"typer=={low}" if bound == "lowest" else f"typer<{high}"
    target = tmp_path / "site"
    pip = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), requirement])
    assert pip.returncode == 0, pip.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}

    def hpckpt(*args):
        return subprocess.run([sys.executable, "-m", "hpckpt", *map(str, args)], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=120)

    version = subprocess.run([sys.executable, "-c", "import typer; print(typer.__version__)"], capture_output=True,
                             text=True, env=env).stdout.strip()
    numbers = tuple(int(n) for n in version.split("."))
    lowest, above = (tuple(int(n) for n in v.split(".")) for v in (low, high))
    assert numbers[:len(lowest)] == lowest if bound == "lowest" else lowest <= numbers < above, version
    for command in ("inspect", "verify", "reshard", "consolidate", "convert", "convert-ms-torch", "env", "completion"):
        assert hpckpt(command, "--help").returncode == 0, (version, command)
    wrong = hpckpt("--json", "consolidate", REPO / "examples" / "tiny-hp", "-o", "x", "--format", "onnx")
    assert wrong.returncode == 2 and "'onnx' is not one of 'hyperparallel', 'hp'" in wrong.stderr, (version, wrong)
    assert json.loads(wrong.stdout)["error"]["kind"] == "usage", (version, wrong.stdout)
    inspected = hpckpt("inspect", REPO / "examples" / "tiny-hp", "--json")
    assert inspected.returncode == 0 and json.loads(inspected.stdout)["counts"]["tensors"] == 6, (version, inspected)
    resharded = hpckpt("reshard", REPO / "examples" / "tiny-hp", "-o", "out", "--world-size", "3", "--json")
    assert resharded.returncode == 0, (version, resharded.stderr)
    assert json.loads(resharded.stdout)["written"], (version, resharded.stdout)
    for shell, name in (("bash", "hpckpt.bash"), ("zsh", "_hpckpt"), ("fish", "hpckpt.fish")):
        assert hpckpt("completion", shell).stdout == (REPO / "completions" / name).read_text(), (version, shell)
