"""Test-wide settings: keep hpckpt's index cache out of the user's home directory."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache_dir(tmp_path_factory):
    os.environ["HPCKPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("hpckpt-cache"))
    yield
