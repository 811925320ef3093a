"""`hpckpt.dist` inside a real FSDP2 job: save on 4 ranks, load on 2, on 3 and on HSDP 2x2.

Four torchrun jobs in all (gloo, CPU, tests/dist_scripts/fsdp_job.py), one per configuration:

* `save` (4 ranks, 1-D mesh): 2 AdamW steps, `hpckpt.dist.save` of model + optimizer; the
  full state dict (rank 0) and the step-3 loss as the reference; inside the same job the plan cache
  (hit on the same state, byte-identical files; miss on a new or reshaped tensor) and `async_save`
  (the checkpoint holds the values at the call although the caller modified them right after).
* `load` with MESH 2, 3 and 2x2 (HSDP): a fresh model with other values, `hpckpt.dist.load` into
  its sharded state dict, `set_state_dict`, then every parameter and optimizer state tensor bit for
  bit equal to the reference, the step-3 loss exactly the saved one, every box read once.

The job script checks inside the job and exits non-zero on any failed check; the tests here assert
the exit codes (showing the log) and check what the save job wrote with hpckpt's own tools: the
`hpckpt verify` CLI, `open_index` and a conversion to one safetensors file compared with the
reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from math import prod
from pathlib import Path

import pytest
from _util import run_torchrun

pytestmark = pytest.mark.dist

JOB = Path(__file__).parent / "dist_scripts" / "fsdp_job.py"
TIMEOUT = 240  # seconds per torchrun job (each takes about 10-15 s here)


@dataclass
class Job:
    returncode: int | None  # None: killed after TIMEOUT
    log: str

    def assert_ok(self, what: str) -> None:
        assert self.returncode == 0, f"{what}: torchrun exited {self.returncode}\n{self.log[-12000:]}"


def _torchrun(nproc: int, *args: str, log_file: Path) -> Job:
    return Job(*run_torchrun(nproc, [str(JOB), *args], log_file, {**os.environ, "OMP_NUM_THREADS": "1"}, TIMEOUT))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Job]:
    """The save job (4 ranks), run once for the module; its OUTDIR holds ckpt/, the other
    checkpoints of the job, reference.pt and save.json."""
    out = tmp_path_factory.mktemp("fsdp")
    return out, _torchrun(4, "save", str(out), log_file=out / "save.log")


@pytest.fixture
def checkpoint(saved) -> Path:
    out, job = saved
    if job.returncode != 0:
        pytest.fail(f"the save job failed (exit {job.returncode}); see test_save_job\n{job.log[-3000:]}")
    return out


def test_save_job(saved):
    """4-rank FSDP2 save; inside the job: plan cache hit/miss, byte-identical re-save, async_save."""
    out, job = saved
    job.assert_ok("save job")
    info = json.loads((out / "save.json").read_text())
    assert info["plan_cache"] == ["miss", "hit", "miss", "miss", "hit", "hit"], info["plan_cache"]
    # DTensors, plain tensors and values: the ranks agreed on one layout table and sent no boxes
    assert info["plan_from"] == ["layouts", "cache", "layouts", "layouts", "cache", "cache"], info["plan_from"]
    assert info["loss3"] == info["plain_loss3"], info
    assert {".metadata", "_rank0_.safetensors", "_rank3_.safetensors"} <= set(info["files"]), info["files"]
    # nothing left beside the committed checkpoints (no staging directory, no plan file)
    assert sorted(p.name for p in out.iterdir()) == sorted([*info["checkpoints"], "reference.pt", "save.json", "save.log"])
    # the async checkpoint holds the state as it was at the call: the first save's bytes
    for name in ("ckpt_again", "ckpt_async"):
        assert _files(out / name) == _files(out / "ckpt"), name


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_hpckpt_verify_accepts_the_checkpoint(checkpoint):
    hpckpt = Path(sys.executable).with_name("hpckpt")
    done = subprocess.run([str(hpckpt), "verify", str(checkpoint / "ckpt")], check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"hpckpt verify: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "OK" in done.stdout, done.stdout


def test_every_checkpoint_of_the_job_verifies_strictly(checkpoint):
    """Including the plan-cache and async ones; strict: not even a warning (leftovers, a stale
    `.hpckpt.json`)."""
    from hpckpt import api

    for name in json.loads((checkpoint / "save.json").read_text())["checkpoints"]:
        report = api.verify(checkpoint / name, strict=True)
        assert report.exit_code == 0 and report.format == "hyperparallel", (name, report.findings)


def _flat(tree, prefix=""):
    """Tensors of a nested state dict by hpckpt's dotted names (dicts descended, lists of dicts
    descended by position)."""
    import torch

    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict) or (isinstance(v, (list, tuple)) and any(isinstance(x, (dict, torch.Tensor)) for x in v)):
            out.update(_flat(v, key + "."))
    return out


def test_the_saved_checkpoint_is_the_full_state_dict(checkpoint, tmp_path):
    """Read without hpckpt.dist: the index (boxes as each rank held them, replicas stored once)
    and a conversion to one safetensors file, bit for bit the rank-0 full state dict."""
    import torch
    from safetensors.torch import load_file

    from hpckpt import api
    from hpckpt.converters import open_index

    ref = torch.load(checkpoint / "reference.pt", weights_only=True)
    want = _flat({"model": ref["model"], "optim": {"state": ref["optim"]["state"]}, "extra": ref["extra"]})
    index = open_index(checkpoint / "ckpt")
    assert index.format == "hyperparallel"
    assert {n: tuple(e.shape) for n, e in index.tensors.items()} == {n: tuple(t.shape) for n, t in want.items()}
    for fqn, entry in index.tensors.items():
        boxes = [(tuple(c.box.offsets), tuple(c.box.sizes)) for c in entry.chunks]
        assert len(set(boxes)) == len(boxes) and sum(prod(s) for _, s in boxes) == prod(entry.shape), (fqn, boxes)
    # torch's uneven split as the 4 ranks held it: 13 rows -> 4,4,4,1; 5 rows -> 2,2,1 (+ an empty shard)
    assert sorted(c.box.sizes[0] for c in index.tensors["model.l1.weight"].chunks) == [1, 4, 4, 4]
    assert sorted(c.box.sizes[0] for c in index.tensors["model.l3.weight"].chunks if prod(c.box.sizes)) == [1, 2, 2]
    assert {"meta.step", "meta.note", "optim.param_groups.0.lr"} <= set(index.values)

    api.convert(checkpoint / "ckpt", tmp_path / "full.safetensors")
    got = load_file(tmp_path / "full.safetensors")
    assert sorted(got) == sorted(want)
    for fqn, t in want.items():
        assert got[fqn].dtype == t.dtype and torch.equal(got[fqn], t), fqn


@pytest.mark.parametrize("mesh", ["2", "3", "2x2"])
def test_load_into_another_mesh(checkpoint, mesh):
    """Load the 4-rank checkpoint on 2 ranks, 3 ranks (uneven) and HSDP 2x2; the job compares the
    full state dict and the step-3 loss with the reference and checks the read accounting."""
    nproc = 4 if mesh == "2x2" else int(mesh)
    job = _torchrun(nproc, "load", str(checkpoint), mesh, log_file=checkpoint / f"load_{mesh}.log")
    job.assert_ok(f"load job on mesh {mesh}")
    assert job.log.count(": OK") == nproc, job.log[-6000:]
