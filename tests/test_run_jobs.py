"""`hpckpt run save` and `load --check` under real torchrun and msrun, across frameworks.

Four ranks of each framework save the synthetic model-shaped state; two ranks of the same and
of the other framework load it, and `--check` compares every loaded box with an independent
read. A checkpoint saved by MindSpore ranks carries MindSpore's dtype strings and safetensors
`__metadata__`, as HyperParallel's MindSpore platform writes. A rank that fails while writing
ends the job, named, and leaves no checkpoint. `save --from` lays an existing checkpoint out
anew. Few and small jobs: msrun costs ~15-25 s each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _util import assert_manifest_matches

pytestmark = pytest.mark.dist

HPCKPT = str(Path(sys.executable).with_name("hpckpt"))


def run(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([HPCKPT, "run", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env} if env else None)


def report(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _checked(doc: dict, world: int) -> None:
    assert doc["world_size"] == world and len(doc["ranks"]) == world
    for r in doc["ranks"]:
        assert r["checked_boxes"] > 0 and r["checked_values"] == 4 and not r["missing"], r
    assert sum(r["checked_bytes"] for r in doc["ranks"]) >= doc["ranks"][0]["job_bytes_wanted"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per framework, saved by four ranks: torch as 2x2 HSDP, MindSpore as a 2x2
    mesh sharding both dims, with `async_save` (planning and commit on a thread, through files)."""
    root = tmp_path_factory.mktemp("run-jobs")
    out = {"torch": root / "torch-4", "mindspore": root / "ms-4"}
    doc = report(run("--nproc-per-node", "4", "save", "-o", str(out["torch"]), "--size", "4MiB", "--mesh", "2x2",
                     "--placements", "R,S0", "--json"))
    assert doc["world_size"] == 4 and all(r["plan_cache"] in ("miss", "off") for r in doc["ranks"])
    assert all(r["plan_from"] == "layouts" for r in doc["ranks"]), doc["ranks"]  # sharded(): no boxes sent
    assert doc["command"] == "run" and doc["ok"] is True and doc["written"] == [str(out["torch"])]  # the envelope
    assert doc["totals"]["job_gib_per_s"] > 0  # binary units, as every document's
    doc = report(run("--launcher", "msrun", "--nproc-per-node", "4", "save", "-o", str(out["mindspore"]), "--size", "4MiB",
                     "--mesh", "2x2", "--placements", "S1,S0", "--async", "--json"))
    assert doc["world_size"] == 4 and all(r["blocked_seconds"] < r["seconds"] for r in doc["ranks"])
    assert all(r["plan_from"] == "layouts" for r in doc["ranks"]), doc["ranks"]  # (MindSpore, through files)
    for path in out.values():
        verified = subprocess.run([HPCKPT, "verify", "--strict", "--deep", str(path)], capture_output=True, text=True)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert "against the manifest's digests" in verified.stdout  # every rank's part joined in one manifest
        assert_manifest_matches(path)
    return out


def test_torch_saved_loads_into_two_torch_ranks_and_two_mindspore_ranks(saved):
    # every torch rank wants every box, forced to read: each reads every box itself
    doc = report(run("--nproc-per-node", "2", "load", str(saved["torch"]), "--mesh", "2", "--placements", "R",
                     "--broadcast", "never", "--check", "--json"))
    _checked(doc, 2)
    assert {(r["broadcast"], r["broadcast_reason"], r["bytes_broadcast"], r["job_read_amplification"])
            for r in doc["ranks"]} == {("read", "forced", 0, 2.0)}
    # every MindSpore rank wants every box: each is read once and broadcast over MindSpore's collectives
    # (the load's automatic choice, made to broadcast by the figures it is given)
    doc = report(run("--launcher", "msrun", "--nproc-per-node", "2", "load", str(saved["torch"]), "--mesh", "2",
                     "--placements", "R", "--check", "--json", "--network-bandwidth", "1TiB/s",
                     env={"HPCKPT_STORAGE_BANDWIDTH": "1GiB"}))
    _checked(doc, 2)
    assert all(r["bytes_broadcast"] > 0 and r["job_read_amplification"] == 1.0 for r in doc["ranks"])
    assert {(r["broadcast"], r["broadcast_reason"], r["network_bandwidth"], r["network_bandwidth_from"],
             r["storage_bandwidth_from"], r["wants_from"]) for r in doc["ranks"]} == \
        {("broadcast", "auto", 2**40, "argument", "environment", "layouts")}  # (MindSpore ranks agree on a layout table)
    bad = subprocess.run([HPCKPT, "run", "--nproc-per-node", "2", "load", str(saved["torch"]), "--network-bandwidth",
                          "fast"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--network-bandwidth: 'fast' is not a rate" in bad.stderr, bad.stderr


def test_mindspore_saved_has_mindspore_dtypes_and_loads_into_both(saved):
    from hpckpt.converters.hyperparallel.reader import _read_pickle

    md = _read_pickle(saved["mindspore"], ".metadata")
    dtypes = {item.properties.dtype for item in md.state_dict_metadata.values() if hasattr(item, "properties")}
    assert dtypes == {"BFloat16", "Float32"}
    header = (saved["mindspore"] / "_rank0_.safetensors").read_bytes()[8:200]
    assert b'"__metadata__":{"format":"ms"}' in header
    _checked(report(run("--nproc-per-node", "2", "load", str(saved["mindspore"]), "--check", "--json")), 2)
    _checked(report(run("--launcher", "msrun", "--nproc-per-node", "2", "load", str(saved["mindspore"]), "--check",
                        "--json")), 2)


def test_a_rank_failing_while_writing_ends_the_job_named_and_leaves_no_checkpoint(tmp_path):
    dest = tmp_path / "ck"
    done = run("--nproc-per-node", "3", "--log-dir", str(tmp_path / "logs"), "save", "-o", str(dest), "--size", "2MiB",
               "--fail-rank", "1", timeout=120)
    assert done.returncode == 22, done.stderr
    line = [s for s in done.stderr.splitlines() if s.startswith("error:")]
    assert len(line) == 1 and "rank 1" in line[0] and "injected failure while writing" in line[0], done.stderr
    assert str(tmp_path / "logs" / "rank-1.log") in done.stderr
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "logs"] == []  # no staging directory left either


def test_save_from_an_existing_checkpoint_lays_it_out_anew(tmp_path):
    """`save --from`: HyperParallel's own 4-rank checkpoint (uneven, ragged and nested entries)
    loaded onto 2 ranks and saved again holds the same tensors and values, in the new layout."""
    import numpy as np
    from _util import FIXTURES, assert_bit_equal, expected_tensors, expected_values

    from hpckpt.converters import open_index
    from hpckpt.core.io.read import read_box

    fixture = FIXTURES / "m0-torch-4rank"
    doc = report(run("--nproc-per-node", "2", "save", "-o", str(tmp_path / "ck"), "--from", str(fixture),
                     "--mesh", "2", "--placements", "S0", "--json"))
    assert [r["source_format"] for r in doc["ranks"]] == ["hyperparallel"] * 2
    index = open_index(tmp_path / "ck")
    assert index.world_size == 2
    for fqn, want in expected_tensors(fixture).items():
        assert_bit_equal(np.asarray(read_box(index, index.tensors[fqn])), want, fqn)
    for fqn, value in expected_values(fixture).items():
        got = index.decode_value(fqn)
        assert type(got).__name__ == value["type"] and (list(got) if value["type"] == "tuple" else got) == value["value"]
