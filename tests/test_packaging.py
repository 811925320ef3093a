"""The package installs as one `hpckpt` package, starts without frameworks, and CI runs the README."""

from __future__ import annotations

import json
import re
import subprocess
import sys

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
        "import sys, hpckpt.core.unpickle, hpckpt.core.read, hpckpt.core.validate, hpckpt.converters, hpckpt.api, hpckpt.cli.app\n"
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
        for top in ("api", "cli", "core", "converters") for p in (REPO / top).rglob("__init__.py")
    }
    assert listed == found


def test_readme_library_example_runs(tmp_path):
    """The README's Python block is what a user types: it must run as shown, from the repo root."""
    import shutil

    readme = (REPO / "README.md").read_text()
    code = re.search(r"## Library use.*?```python\n(.*?)```", readme, re.S).group(1)
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    out = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "torch-dcp" / ".metadata").is_file() and (tmp_path / "out" / "model.ckpt").is_file()
