"""Test-wide settings: the index cache stays out of the user's home directory, and a test that
needs the HyperParallel fixtures fails (never aborts the collection) when they are missing."""

from __future__ import annotations

import os

import pytest

from _util import FIXTURES, missing_fixtures


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
