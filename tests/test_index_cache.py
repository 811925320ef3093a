"""The index snapshot of large HyperParallel checkpoints: same answers, invalidated by any change."""

from __future__ import annotations

import os
import shutil

import pytest
from _util import REPO

from hpckpt import api
from hpckpt.converters import index_cache, open_index
from hpckpt.core.io.read import read_box


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "MIN_METADATA_BYTES", 0)  # cache even the tiny example
    monkeypatch.setenv("HPCKPT_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "ckpt"
    shutil.copytree(REPO / "examples" / "tiny-hp", root)
    (root / ".hpckpt-manifest.jsonl").unlink()  # a manifest's listing comes first (tested below)
    return root


def test_a_checkpoint_with_a_manifest_is_listed_from_it_and_not_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(index_cache, "MIN_METADATA_BYTES", 0)
    monkeypatch.setenv("HPCKPT_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "ckpt"
    shutil.copytree(REPO / "examples" / "tiny-hp", root)
    listed = api.inspect(root)
    assert _cache_files(tmp_path) == []
    (root / ".hpckpt-manifest.jsonl").unlink()
    without = api.inspect(root)
    assert [t["fqn"] for t in listed["tensors"]] == [t["fqn"] for t in without["tensors"]]
    assert listed["tensors"] == without["tensors"] and listed["values"] == without["values"]


def _cache_files(tmp_path):
    return sorted((tmp_path / "cache").glob("*.idx")) if (tmp_path / "cache").exists() else []


def test_second_inspect_comes_from_the_snapshot_and_says_the_same(ckpt, tmp_path):
    first = api.inspect(ckpt, shards=["*"])
    assert len(_cache_files(tmp_path)) == 1
    cached = open_index(ckpt, use_cache=True)
    assert all(e._chunks is None for e in cached.tensors.values())  # chunk lists are not stored
    assert api.inspect(ckpt, shards=["*"]) == first


def test_chunks_and_reads_through_a_cached_index(ckpt):
    api.inspect(ckpt)
    cached = open_index(ckpt, use_cache=True)
    fresh = open_index(ckpt)
    for fqn, entry in fresh.tensors.items():
        assert [(c.box, c.file, c.key) for c in cached.tensors[fqn].chunks] == [(c.box, c.file, c.key) for c in entry.chunks]
        assert read_box(cached, cached.tensors[fqn]).tobytes() == read_box(fresh, entry).tobytes()


def test_any_change_to_the_metadata_misses_the_snapshot(ckpt, tmp_path):
    api.inspect(ckpt)
    (old,) = _cache_files(tmp_path)
    stat = os.stat(ckpt / ".metadata")
    os.utime(ckpt / ".metadata", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    api.inspect(ckpt)
    assert len(_cache_files(tmp_path)) == 2 and old in _cache_files(tmp_path)


def test_a_damaged_snapshot_is_ignored(ckpt, tmp_path):
    first = api.inspect(ckpt)
    (snapshot,) = _cache_files(tmp_path)
    snapshot.write_bytes(b"HPCKPT-INDEX-2\n{not json")
    assert api.inspect(ckpt) == first


def test_hpckpt_no_cache_turns_it_off(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HPCKPT_NO_CACHE", "1")
    api.inspect(ckpt)
    assert _cache_files(tmp_path) == []
