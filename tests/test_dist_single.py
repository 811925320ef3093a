"""`hpckpt.dist` in one process (world size 1, real torch, real files): the commit, what a killed
save leaves, refusals before any byte is written, the plan cache, async errors, and `load` from
every format hpckpt reads. The multi-rank proofs are in test_dist_fsdp.py and test_dist_fixtures.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from _util import MANIFEST, assert_manifest_matches, manifest_content

import hpckpt.dist as hdist
from hpckpt.core.errors import EntryMismatchError, HpckptError, UnsafePickleError

HPCKPT = Path(sys.executable).with_name("hpckpt")


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(5, 3, generator=g), "h": torch.randn(4, generator=g).bfloat16(),
                      "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)},
            "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3, generator=g)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]},
            "step": 7}


def _blank() -> dict:
    s = _state()
    for t in (s["model"]["w"], s["model"]["h"], s["model"]["ids"], s["optim"]["state"]["w"]["exp_avg"],
              s["optim"]["state"]["w"]["step"]):
        t.zero_()
    s["optim"]["param_groups"] = [{"lr": None, "betas": None, "params": None}]
    s["step"] = None
    return s


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(HPCKPT), "verify", str(path)], capture_output=True, text=True)


def test_save_commits_once_and_loads_back_bit_exact(tmp_path):
    ckpt = tmp_path / "ckpt"
    result = hdist.save(_state(), ckpt)
    assert result.committed and result.world_size == 1 and result.plan_cache == "miss"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging, lock or exchange file beside it
    assert sorted(os.listdir(ckpt)) == [".hpckpt-manifest.jsonl", ".metadata", "_rank0_.bytes", "_rank0_.safetensors"]
    assert _verify(ckpt).returncode == 0
    assert_manifest_matches(ckpt)
    target = _blank()
    loaded = hdist.load(target, ckpt)
    assert _equal(target, _state())
    assert loaded.tensors == 5 and loaded.values == 4 and loaded.read_amplification == 1.0
    assert loaded.bytes_read == loaded.job_bytes_wanted == 60 + 8 + 48 + 4 + 60
    # the same state again: the cached plan, the same bytes, the old checkpoint replaced
    before = {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt) if n != MANIFEST}
    manifest_before = manifest_content(ckpt / MANIFEST)
    assert hdist.save(_state(), ckpt).plan_cache == "hit"
    assert {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt) if n != MANIFEST} == before
    assert manifest_content(ckpt / MANIFEST) == manifest_before
    changed = _state()
    changed["model"]["w"] = torch.randn(6, 3)
    assert hdist.save(changed, ckpt).plan_cache == "miss"  # a new shape is a new plan
    assert hdist.save(changed, ckpt, plan_cache=False).plan_cache == "off"


def test_a_killed_save_leaves_nothing_that_loads_and_the_next_save_cleans_up(tmp_path):
    ckpt = tmp_path / "ckpt"
    staging = tmp_path / ".ckpt.hpckpt-tmp-dist"
    staging.mkdir()  # what a job killed while writing leaves: data, exchange files, no .metadata
    (staging / "_rank0_.safetensors").write_bytes(b"\0" * 16)
    (staging / ".hpckpt-plan-0.json").write_text("{}")
    for command in ("inspect", "verify"):
        run = subprocess.run([str(HPCKPT), command, str(staging)], capture_output=True, text=True)
        assert run.returncode != 0 and "unfinished distributed save" in run.stderr, run.stderr
    run = subprocess.run([str(HPCKPT), "inspect", str(ckpt)], capture_output=True, text=True)
    assert run.returncode == 3
    hdist.save(_state(), ckpt)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and _verify(ckpt).returncode == 0


def test_refusals_come_before_any_byte_is_written(tmp_path):
    class Custom:
        pass

    with pytest.raises(UnsafePickleError, match="extra.obj: a Custom value cannot be saved"):
        hdist.save({"w": torch.ones(2), "extra": {"obj": Custom()}}, tmp_path / "a")
    with pytest.raises(HpckptError):  # not a checkpoint: never replaced
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "mine.txt").write_text("keep me")
        hdist.save(_state(), tmp_path / "notes")
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="coordination must be one of"):
        hdist.save(_state(), tmp_path / "b", coordination="gossip")
    assert sorted(os.listdir(tmp_path)) == ["notes"]


def test_async_save_keeps_the_values_at_the_call_and_raises_its_errors(tmp_path):
    state = _state()
    at_call = _state()
    handle = hdist.async_save(state, tmp_path / "a")
    state["model"]["w"].add_(100)  # the training loop goes on at once
    state["optim"]["param_groups"][0]["lr"] = 5.0
    result = handle.result(timeout=60)
    assert handle.done() and result.committed and result.blocked <= result.planning + result.writing + 60
    target = _blank()
    hdist.load(target, tmp_path / "a")
    assert _equal(target, at_call)
    (tmp_path / "file").write_text("x")  # a parent that is a file: refused before anything is copied
    with pytest.raises(HpckptError, match="is not a directory"):
        hdist.async_save(_state(), tmp_path / "file" / "ckpt")


def test_a_full_disk_in_the_background_is_raised_by_result_and_commits_nothing(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.fail("cannot mount a tmpfs (the suite runs as root in CI)")
    try:
        handle = hdist.async_save({"big": torch.ones(1024, 1024)}, disk / "ckpt")  # 4 MiB onto 1 MiB
        with pytest.raises(HpckptError, match="no space left on device"):
            handle.result(timeout=60)
        assert os.listdir(disk) == []  # no checkpoint, no staging, no lock
        hdist.save({"small": torch.ones(8)}, disk / "ckpt")  # the next save succeeds
        assert sorted(os.listdir(disk)) == ["ckpt"] and _verify(disk / "ckpt").returncode == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_load_strictness_shapes_and_dtype_conversion(tmp_path):
    hdist.save(_state(), tmp_path / "c")
    extra = _blank()
    extra["model"]["new"] = torch.zeros(2)
    with pytest.raises(EntryMismatchError, match="has no 'model.new'"):
        hdist.load(extra, tmp_path / "c")
    loaded = hdist.load(extra, tmp_path / "c", strict=False)
    assert loaded.missing == ("model.new",) and _equal(extra["model"]["w"], _state()["model"]["w"])
    wrong = _blank()
    wrong["model"]["w"] = torch.zeros(3, 5)
    with pytest.raises(EntryMismatchError, match="model.w: the checkpoint holds it as \\[5, 3\\]"):
        hdist.load(wrong, tmp_path / "c")
    cast = _blank()
    cast["model"]["h"] = torch.zeros(4, dtype=torch.float32)
    loaded = hdist.load(cast, tmp_path / "c")
    assert loaded.converted == (("model.h", "bfloat16 -> float32"),)
    assert torch.equal(cast["model"]["h"], _state()["model"]["h"].float())
    part = {"model": {"w": torch.zeros(5, 3)}}
    assert "model.h" in hdist.load(part, tmp_path / "c").unused


def test_load_reads_every_format(tmp_path):
    """A Hugging Face file, a torch.save file, a MindSpore .ckpt and a PyTorch DCP checkpoint load
    straight into tensors."""
    tensors = {"a.weight": torch.randn(4, 3), "a.bias": torch.arange(3, dtype=torch.int32)}
    save_file(tensors, tmp_path / "model.safetensors")
    torch.save(tensors, tmp_path / "model.pt")
    import mindspore

    mindspore.save_checkpoint([{"name": k, "data": mindspore.Tensor(v.numpy())} for k, v in tensors.items()],
                              str(tmp_path / "model.ckpt"))
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": {"weight": tensors["a.weight"], "bias": tensors["a.bias"]}}, checkpoint_id=str(tmp_path / "dcp"))
    for name in ("model.safetensors", "model.pt", "model.ckpt", "dcp"):
        target = {"a": {"weight": torch.zeros(4, 3), "bias": torch.zeros(3, dtype=torch.int32)}}
        loaded = hdist.load(target, tmp_path / name)
        assert torch.equal(target["a"]["weight"], tensors["a.weight"]), name
        assert torch.equal(target["a"]["bias"], tensors["a.bias"]), name
        assert loaded.read_amplification == 1.0 or name == "model.ckpt"


def test_core_and_cli_never_import_torch():
    code = ("import sys, hpckpt.core.geometry.global_plan, hpckpt.cli.app, hpckpt.api; "
            "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


class _ChunkInfo:
    """HyperParallel's ChunkInfo: the box a plain tensor holds of a larger one."""

    def __init__(self, offsets, sizes, global_shape):
        self.chunk = type("Chunk", (), {"offsets": offsets, "sizes": sizes})()
        self.global_shape = global_shape


def test_tensors_carrying_chunk_info_are_saved_and_loaded_as_their_box(tmp_path):
    whole = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    part = whole[1:3].clone()
    part.chunk_info = _ChunkInfo((1, 0), (2, 3), (4, 3))
    with pytest.raises(HpckptError, match="w: the ranks' shards hold 6 elements of a tensor of 12"):
        hdist.save({"w": part}, tmp_path / "partial")  # the only rank holds half the tensor: refused
    assert not (tmp_path / "partial").exists()
    held = whole.clone()
    held.chunk_info = _ChunkInfo((0, 0), (4, 3), (4, 3))
    hdist.save({"w": held}, tmp_path / "c")
    target = torch.zeros(2, 3)
    target.chunk_info = _ChunkInfo((1, 0), (2, 3), (4, 3))  # a rank's box of the global tensor
    loaded = hdist.load({"w": target}, tmp_path / "c")
    assert torch.equal(target, whole[1:3]) and loaded.bytes_read == 24
    wrong = torch.zeros(2, 3)
    wrong.chunk_info = _ChunkInfo((3, 0), (2, 3), (4, 3))  # rows 3..5 of 4
    with pytest.raises(HpckptError, match="does not fit"):
        hdist.load({"w": wrong}, tmp_path / "c")


def test_a_converted_load_goes_through_a_bounded_buffer(tmp_path, monkeypatch):
    """A box read for a dtype conversion is read a block of rows at a time, never whole."""
    live_load = sys.modules["hpckpt.dist.load"]  # (`hpckpt.dist.load` is the function)

    big = torch.randn(9, 5).bfloat16()
    hdist.save({"w": big}, tmp_path / "c")
    monkeypatch.setattr(live_load, "TILE_BYTES", 2 * 5 * 2)  # two rows of bf16 per read
    reads = []
    real = live_load.read_box
    monkeypatch.setattr(live_load, "read_box", lambda *a, **k: reads.append(a[2].sizes) or real(*a, **k))
    target = {"w": torch.zeros(9, 5)}
    assert hdist.load(target, tmp_path / "c").converted == (("w", "bfloat16 -> float32"),)
    assert torch.equal(target["w"], big.float())
    assert reads == [(2, 5)] * 4 + [(1, 5)]


def test_a_save_of_many_chunks_commits_from_the_plan_arrays(tmp_path, monkeypatch):
    """From `COLUMNS_FROM` chunks (thousands of ranks; here the threshold is lowered) the
    coordinator takes the files and `.metadata` from the plan's arrays: the same data files, a
    `.metadata` that reads as the stock one, verified and loaded back bit exact."""
    import hpckpt.converters.hyperparallel.writer as hp_writer
    from hpckpt.core.safety.unpickle import METADATA, loads

    stock = tmp_path / "stock"
    hdist.save(_state(), stock, plan_cache=False)
    calls = []
    from_arrays = hp_writer.HyperParallelWriter.from_global_plan
    monkeypatch.setattr(hp_writer, "COLUMNS_FROM", 0)
    monkeypatch.setattr(hp_writer.HyperParallelWriter, "from_global_plan",
                        lambda self, gp: calls.append(len(gp.tid)) or from_arrays(self, gp))
    ckpt = tmp_path / "ckpt"
    assert hdist.save(_state(), ckpt, plan_cache=False).committed and calls == [5]
    for name in ("_rank0_.safetensors", "_rank0_.bytes"):
        assert (ckpt / name).read_bytes() == (stock / name).read_bytes()
    metadata = [(d / ".metadata").read_bytes() for d in (stock, ckpt)]
    assert metadata[0] != metadata[1]  # (the columns' encoding)
    read = [loads(m, what=".metadata", kind=METADATA) for m in metadata]
    assert read[0].state_dict_metadata == read[1].state_dict_metadata and read[0].storage_data == read[1].storage_data
    assert read[0].planner_data == read[1].planner_data and read[0].version == read[1].version
    assert _verify(ckpt).returncode == 0
    assert_manifest_matches(ckpt)
    target = _blank()
    hdist.load(target, ckpt)
    assert _equal(target, _state())
