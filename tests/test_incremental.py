"""HyperParallel metadata versions and incremental saves (format delta A2-A6).

The chain is built as HyperParallel's "2.0" writer builds it (`FileSystemWriter(incremental_from=,
changed_fqns=)`): the changed entries are written into the new step directory, every unchanged
entry keeps its baseline `StorageInfo` with `relative_path` recomputed against the new directory
(`../global_step_100/_rank0_.safetensors`, one hop however long the chain), `tensor_key` unset (that
line keys tensors by name), `MetadataIndex.index` kept, and `Metadata.version = "2.0"`.
"""

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

from hpckpt.cli.app import app
from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
from hpckpt.converters.hyperparallel.reader import _read_pickle
from hpckpt.core import dtypes
from hpckpt.core.codecs.hyperparallel_metadata import StorageInfo, dumps_metadata
from hpckpt.core.geometry.box import Box

runner = CliRunner()
SHAPES = {"w": ((8, 4), np.float32), "b": ((4,), np.float32), "e": ((6, 2), np.int64)}


def hpckpt(*args: str, code: int = 0) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, (args, result.exit_code, result.output)
    return result.output


def full(step: int) -> dict[str, np.ndarray]:
    return {name: (np.arange(np.prod(shape)).reshape(shape) * step).astype(dtype)
            for name, (shape, dtype) in SHAPES.items()}


def write(root: Path, arrays: dict[str, np.ndarray], step: int) -> None:
    """A full 2-rank checkpoint of `arrays` (row-split, as FSDP does) and the value `step`."""
    tensors = {}
    for name, array in arrays.items():
        dtype = dtypes.from_numpy(array.dtype)
        if array.ndim == 1:  # replicated, stored once by rank 0
            tensors[name] = (dtype, array.shape, [ChunkData(0, Box((0,), array.shape), array.tobytes())])
            continue
        half = array.shape[0] // 2
        tensors[name] = (dtype, array.shape, [
            ChunkData(r, Box((r * half, 0), (half, array.shape[1])), array[r * half:(r + 1) * half].tobytes())
            for r in range(2)])
    write_checkpoint(root, tensors, {"step": (0, step)})


def incremental(parent: Path, name: str, baseline: str, changed: dict[str, np.ndarray], step: int) -> None:
    """`parent/name`: the baseline's entries, those in `changed` (and the value `step`) written anew."""
    scratch = parent / f".scratch-{name}"
    write(scratch, changed, step)
    base, new = _read_pickle(parent / baseline, ".metadata"), _read_pickle(scratch, ".metadata")
    storage = {}
    for key, info in base.storage_data.items():
        if key.fqn in changed or key.fqn == "step":
            continue
        path = info.relative_path if info.relative_path.startswith("../") else f"../{baseline}/{info.relative_path}"
        storage[key] = StorageInfo(path, info.offset, info.length, None)
    for key, info in new.storage_data.items():
        storage[key] = StorageInfo(info.relative_path, info.offset, info.length, None)
    state = dict(base.state_dict_metadata)
    state.update(new.state_dict_metadata)
    (parent / name).mkdir()
    for f in scratch.iterdir():
        if f.name.startswith("_rank"):
            f.rename(parent / name / f.name)
    shutil.rmtree(scratch)
    (parent / name / ".metadata").write_bytes(
        dumps_metadata(replace(base, state_dict_metadata=state, storage_data=storage, version="2.0")))


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """global_step_100 (full), _200 (w changed), _300 (b changed): _300 reads w from _200, e from _100."""
    write(tmp_path / "global_step_100", full(100), 100)
    incremental(tmp_path, "global_step_200", "global_step_100", {"w": full(200)["w"]}, 200)
    incremental(tmp_path, "global_step_300", "global_step_200", {"b": full(300)["b"]}, 300)
    return tmp_path


def expected() -> dict[str, np.ndarray]:
    return {"w": full(200)["w"], "b": full(300)["b"], "e": full(100)["e"]}


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
