"""Test-wide settings: the index cache stays out of the user's home directory, and a test that
needs the HyperParallel fixtures fails (never aborts the collection) when they are missing."""

from __future__ import annotations

import compileall
import os
import re
from pathlib import Path

import pytest

from _util import FIXTURES, missing_fixtures


def pytest_sessionstart(session) -> None:
    """Write the bytecode of hpckpt's modules (and the tests' helpers) once, before the suite
    starts its hundreds of `hpckpt` and job processes: where PYTHONDONTWRITEBYTECODE is set (the
    machines here set it), a fresh clone has none, and every process would compile each module it imports again
    (`hpckpt inspect` of a tiny checkpoint: 0.5-0.6 s instead of 0.33 s)."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller has written it
        return
    skip = re.compile(r"[/\\](\.venv|\.git|\.node|node_modules|fixtures)([/\\]|$)")
    compileall.compile_dir(Path(__file__).resolve().parent.parent, rx=skip, quiet=2)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most 4. The test files were sized for
    two cores, and each real job starts several processes of its own: more workers than cores
    would only slow those jobs down, and past four they wait on each other."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache_dir(tmp_path_factory):
    os.environ["HPCKPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("hpckpt-cache"))
    yield


@pytest.fixture(autouse=True)
def _fixtures_present(request):
    """Modules that import FIXTURES use the fixtures; say plainly when they are not there."""
    if getattr(request.module, "FIXTURES", None) is FIXTURES:
        missing = missing_fixtures()
        if missing:
            pytest.fail(f"HyperParallel fixtures missing from {FIXTURES}: {', '.join(missing)} "
                        "(they ship in tests/fixtures/hyperparallel; HPCKPT_FIXTURES overrides the place)")
