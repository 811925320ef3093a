"""HyperParallel metadata versions and incremental saves (format delta A2-A6), on chains built as
HyperParallel's "2.0" writer builds them (`incremental_chain`)."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from incremental_chain import build_chain, expected, full, write

from hpckpt.cli.app import app
from hpckpt.converters.hyperparallel.reader import _read_pickle
from hpckpt.core.codecs.hyperparallel_metadata import StorageInfo, dumps_metadata

runner = CliRunner()


def hpckpt(*args: str, code: int = 0) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, (args, result.exit_code, result.output)
    return result.output


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    return build_chain(tmp_path)


def test_an_incremental_chain_is_read_and_written_self_contained(chain, tmp_path):
    step = chain / "global_step_300"
    doc = json.loads(hpckpt("inspect", str(step), "--json"))
    assert doc["format_version"] == "2.0" and doc["based_on"] == ["../global_step_100", "../global_step_200"]
    assert any(f["path"] == "../global_step_100/_rank0_.safetensors" for f in doc["files"]), doc["files"]
    assert re.search(r"Based on +\.\./global_step_100, \.\./global_step_200", hpckpt("inspect", str(step)))
    assert json.loads(hpckpt("verify", str(step), "--json"))["ok"] is True
    # every value as the chain says: w from step 200, b from 300, e from 100, the value from 300
    hpckpt("consolidate", str(step), "-o", str(tmp_path / "one.safetensors"))
    got = load_file(str(tmp_path / "one.safetensors"))
    for name, array in expected().items():
        np.testing.assert_array_equal(got[name], array)
    assert json.loads((tmp_path / "one.values.json").read_text())["step"]["value"] == 300
    # the live library loads it too (one process here: the chain is the same for every rank)
    import torch

    import hpckpt.dist as hdist

    state = {name: torch.zeros(array.shape, dtype=torch.from_numpy(array).dtype) for name, array in expected().items()}
    state["step"] = 0
    hdist.load(state, checkpoint_id=str(step), no_dist=True)
    for name, array in expected().items():
        np.testing.assert_array_equal(state[name].numpy(), array)
    assert state["step"] == 300
    # a reshard is self-contained, keeps the source's version, and needs no baseline afterwards
    hpckpt("reshard", str(step), "-o", str(tmp_path / "out"), "--world-size", "3")
    out = json.loads(hpckpt("inspect", str(tmp_path / "out"), "--json"))
    assert out["based_on"] == [] and out["format_version"] == "2.0"
    assert not any(f["path"].startswith("..") for f in out["files"])
    shutil.rmtree(chain / "global_step_100")
    shutil.rmtree(chain / "global_step_200")
    hpckpt("consolidate", str(tmp_path / "out"), "-o", str(tmp_path / "again.safetensors"))
    got = load_file(str(tmp_path / "again.safetensors"))
    for name, array in expected().items():
        np.testing.assert_array_equal(got[name], array)
    # and without its baselines the incremental checkpoint says which file is missing
    out = hpckpt("verify", str(step), code=8)
    assert "global_step_100" in out or "global_step_200" in out, out


def test_a_broken_baseline_and_outputs_into_it(chain, tmp_path):
    step = chain / "global_step_300"
    base = chain / "global_step_100" / "_rank1_.safetensors"
    data = base.read_bytes()
    base.write_bytes(data[:-8])  # truncated: verify checks the baseline files the chain uses
    out = hpckpt("verify", str(step), code=9)
    assert "global_step_100/_rank1_.safetensors" in out, out
    base.write_bytes(data)
    # writing into a baseline would destroy what the source reads: refused, --force or not
    before = {p.name: p.read_bytes() for p in (chain / "global_step_100").iterdir()}
    out = hpckpt("reshard", str(step), "-o", str(chain / "global_step_100"), "--world-size", "1", "--force", code=16)
    assert "source" in out, out
    assert {p.name: p.read_bytes() for p in (chain / "global_step_100").iterdir()} == before


@pytest.mark.parametrize("path", [
    "../../global_step_100/_rank0_.safetensors",  # climbs past the parent
    "../plain/_rank0_.safetensors",  # a sibling that is no checkpoint
    "../global_step_100/../plain/_rank0_.safetensors",  # leaves the baseline again
    "../linked/_rank0_.safetensors",  # a sibling that is a link to a checkpoint elsewhere
    "/etc/passwd",
])
def test_any_other_path_that_leaves_stays_refused(chain, tmp_path, path):
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    shutil.copytree(chain / "global_step_100", outside)
    try:
        (chain / "linked").symlink_to(outside, target_is_directory=True)
        (chain / "plain").mkdir()
        shutil.copy(chain / "global_step_100" / "_rank0_.safetensors", chain / "plain")
        step = chain / "global_step_300"
        metadata = _read_pickle(step, ".metadata")
        storage = {key: (StorageInfo(path, info.offset, info.length, None) if key.fqn == "e" else info)
                   for key, info in metadata.storage_data.items()}
        (step / ".metadata").write_bytes(dumps_metadata(replace(metadata, storage_data=storage)))
        out = hpckpt("consolidate", str(step), "-o", str(tmp_path / "x.safetensors"), code=12)
        assert "leaves the checkpoint" in out or "not relative" in out, out
        assert not (tmp_path / "x.safetensors").exists()
    finally:
        shutil.rmtree(outside)


@pytest.mark.parametrize(("version", "shown", "warned"), [(None, "1.0", False), ("1.0", "1.0", False),
                                                          ("2.0", "2.0", False), ("10.0", "10.0", True)])
def test_versions_are_labels(tmp_path, version, shown, warned):
    """Missing, "1.0" and "2.0" read alike; another version warns, names itself, and is read."""
    root = tmp_path / "ckpt"
    write(root, full(1), 1)
    metadata = _read_pickle(root, ".metadata")
    if version is None:
        del metadata.__dict__["version"]
    else:
        metadata.version = version
    (root / ".metadata").write_bytes(dumps_metadata(metadata))
    os.remove(root / ".hpckpt-manifest.jsonl")  # (it records the old .metadata's digest)
    doc = json.loads(hpckpt("inspect", str(root), "--json"))
    assert doc["format_version"] == shown
    assert any("metadata version '10.0' is not one hpckpt knows" in n for n in doc["notes"]) is warned, doc["notes"]
    hpckpt("reshard", str(root), "-o", str(tmp_path / "out"), "--world-size", "1")
    written = _read_pickle(tmp_path / "out", ".metadata").__dict__.get("version")
    assert written == (version if version in ("1.0", "2.0") else "1.0")


def read_as_the_2_0_line_does(root: Path) -> dict[str, np.ndarray]:
    """HyperParallel's "2.0" loader, as far as it keys on anything (format delta A4.2-3): each
    chunk's `StorageInfo` looked up by `(fqn, offset, index)` (`index`, the chunk's position, is
    part of that line's `MetadataIndex` equality), and the tensor read from the file by its plain
    name (that line ignores `tensor_key`)."""
    from safetensors import safe_open

    metadata = _read_pickle(root, ".metadata")
    by_key = {(k.fqn, tuple(k.offset), k.index): info for k, info in metadata.storage_data.items()}
    out = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if not hasattr(entry, "chunks"):
            continue
        parts = []
        for i, chunk in enumerate(entry.chunks):
            info = by_key[(fqn, tuple(chunk.offsets), i)]
            with safe_open(str(root / info.relative_path), "np") as f:
                parts.append((chunk, f.get_tensor(fqn)))
        full = np.zeros(tuple(entry.size), parts[0][1].dtype)
        for chunk, part in parts:
            full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = part
        out[fqn] = full
    return out


def test_the_2_0_lines_loader_reads_hpckpts_output(chain, tmp_path):
    """What hpckpt writes from a "2.0" source keeps "2.0" and is read by that line's lookups."""
    hpckpt("reshard", str(chain / "global_step_300"), "-o", str(tmp_path / "out"), "--world-size", "3")
    assert _read_pickle(tmp_path / "out", ".metadata").version == "2.0"
    got = read_as_the_2_0_line_does(tmp_path / "out")
    assert sorted(got) == sorted(expected())
    for name, array in expected().items():
        np.testing.assert_array_equal(got[name], array)


def test_relative_roots_resolve_against_the_current_directory_each_time(tmp_path, monkeypatch):
    """Resolved paths are cached per absolute root: the same relative name in another directory
    (after a chdir, in one process) is another checkpoint."""
    from hpckpt import api

    for step in (1, 2):
        (tmp_path / f"d{step}").mkdir()
        write(tmp_path / f"d{step}" / "ck", full(step), step)
    for step in (1, 2):
        monkeypatch.chdir(tmp_path / f"d{step}")
        api.consolidate("ck", f"one-{step}.safetensors")
        np.testing.assert_array_equal(load_file(f"one-{step}.safetensors")["w"], full(step)["w"])
