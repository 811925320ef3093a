"""Sources written by torch and Hugging Face's tools, read as checkpoints:

1. torch.save files with tensors inside lists, tuples and nested dicts (real `torch.save`);
2. Hugging Face's older layout, `pytorch_model.bin.index.json` + torch.save shards, in the form
   `transformers`' `save_pretrained(safe_serialization=False)` writes it;
3. the per-rank output of `torch.distributed.checkpoint`'s `HuggingFaceStorageWriter`
   (`save_distributed=True`), made by a real 2-rank gloo job;
4. one per-rank file read on its own: a note and a warning, never a piece passed off as a tensor;
5. a safetensors source's own `__metadata__` keys, carried to safetensors and hf outputs.

Every output is read back by its own consumer (`test_convert.check_output`) and compared bit for
bit with the tensors torch saved.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_convert import OUT_NAME, TARGETS, check_output, cli, error_lines, tensor_key

from hpckpt import api
from hpckpt.converters import detect, open_index
from hpckpt.core.io.read import read_box

def read_all(path: Path) -> dict[str, tuple]:
    """Every tensor of a checkpoint through hpckpt, as `test_convert.tensor_key`s."""
    index = open_index(path)
    return {fqn: tensor_key(torch.from_numpy(read_box(index, e).copy()).view(getattr(torch, e.dtype.name))
                            if e.dtype.name == "bfloat16" else torch.from_numpy(read_box(index, e).copy()))
            for fqn, e in index.tensors.items()}


def assert_same(got: dict[str, tuple], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for fqn, t in want.items():
        assert got[fqn] == tensor_key(t), fqn


# --------------------------------------------------------------------------------------------
# 1. tensors inside lists, tuples and nested dicts


def nested_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(3, 4, generator=g),
        "hist.0": torch.randn(2, generator=g),
        "hist.1": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "tup.0": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "opt.state.0.exp_avg": torch.randn(3, 4, generator=g),
        "opt.state.0.step": torch.tensor(5.0),
    }


NESTED_VALUES = {"tup.1": 3, "opt.lr": 0.1, "plain": [1, 2], "groups": [{"lr": 0.5}], "name": "run"}


@pytest.fixture()
def nested_pt(tmp_path) -> Path:
    t = nested_tensors()
    path = tmp_path / "x.pt"
    torch.save({"w": t["w"], "hist": [t["hist.0"], t["hist.1"]], "tup": (t["tup.0"], 3),
                "opt": {"state": {0: {"exp_avg": t["opt.state.0.exp_avg"], "step": t["opt.state.0.step"]}},
                        "lr": 0.1},
                "plain": [1, 2], "groups": [{"lr": 0.5}], "name": "run"}, path)
    return path


def test_nested_torch_save_inspect_names_every_tensor(nested_pt):
    result = cli("inspect", nested_pt, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert sorted(t["fqn"] for t in doc["tensors"]) == sorted(nested_tensors())
    values = {v["fqn"]: v["value"] for v in doc["values"]}
    # entries that hold no tensor stay one value, as before: `plain`, `groups`
    assert values == {"tup.1": 3, "opt.lr": 0.1, "plain": [1, 2], "groups": [{"lr": 0.5}], "name": "run"}
    assert "TensorRecord" not in result.stdout
    assert_same(read_all(nested_pt), nested_tensors())


@pytest.mark.parametrize("target", TARGETS)
def test_nested_torch_save_to_every_target(nested_pt, tmp_path, target):
    out = tmp_path / OUT_NAME[target]
    report = api.convert(nested_pt, out, target)
    check_output(target, out, nested_tensors(), NESTED_VALUES, report.to_json(), tmp_path)


def test_nested_clash_is_one_error_line(tmp_path):
    path = tmp_path / "clash.pt"
    torch.save({"a.0": torch.zeros(1), "a": [torch.ones(1)]}, path)
    result = cli("inspect", path)
    assert result.exit_code != 0 and len(error_lines(result.stderr)) == 1, result.output
    assert "a.0" in result.stderr


# --------------------------------------------------------------------------------------------
# 2. pytorch_model.bin.index.json + torch.save shards


def hf_bin_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    embed = torch.randn(5, 3, generator=g)
    return {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.randn(3, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(4, 3, generator=g).to(torch.float16),
        "model.position_ids": torch.arange(6, dtype=torch.int64).reshape(1, 6),
        "lm_head.weight": embed,  # tied, as transformers saves tied weights
        "model.layers.0.scale": torch.tensor(0.5),
    }


def save_hf_bin(root: Path, shards: list[list[str]]) -> Path:
    """What `save_pretrained(safe_serialization=False)` writes: `torch.save` of each shard's flat
    dict, `pytorch_model-0000i-of-0000n.bin`, and the index `json.dumps(..., indent=2,
    sort_keys=True) + "\\n"` of `{"metadata": {"total_size"}, "weight_map"}`."""
    tensors = hf_bin_tensors()
    root.mkdir()
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin"
        torch.save({k: tensors[k] for k in names}, root / name)
        for k in names:
            weight_map[k] = name
            total += tensors[k].numel() * tensors[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return root


@pytest.fixture()
def hf_bin(tmp_path) -> Path:
    names = list(hf_bin_tensors())
    return save_hf_bin(tmp_path / "hf-bin", [names[:3], names[3:]])


def test_hf_bin_inspect_and_verify(hf_bin):
    assert detect(hf_bin).name == "hf-torch-bin"
    doc = json.loads(cli("inspect", hf_bin, "--json").stdout)
    assert doc["format"] == "hf-torch-bin" and doc["framework"] == "torch"
    assert {t["fqn"]: t["dtype"] for t in doc["tensors"]} == {
        k: str(t.dtype).removeprefix("torch.") for k, t in hf_bin_tensors().items()}
    assert [f["path"] for f in doc["files"]][0] == "pytorch_model.bin.index.json"
    assert_same(read_all(hf_bin), hf_bin_tensors())
    assert cli("verify", hf_bin).exit_code == 0
    # the index file itself names the checkpoint too
    assert open_index(hf_bin / "pytorch_model.bin.index.json").format == "hf-torch-bin"


@pytest.mark.parametrize("target", TARGETS)
def test_hf_bin_to_every_target(hf_bin, tmp_path, target):
    out = tmp_path / OUT_NAME[target]
    command = ["consolidate", hf_bin, "--format", target, "-o", out] if target != "ms" else \
        ["convert", hf_bin, "-o", out]
    result = cli(*command, "--json")
    assert result.exit_code == 0, result.output
    check_output(target, out, hf_bin_tensors(), {}, json.loads(result.stdout), tmp_path)


def test_hf_bin_single_file_directory(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    torch.save(hf_bin_tensors(), root / "pytorch_model.bin")
    (root / "config.json").write_text("{}")
    assert detect(root).name == "hf-torch-bin"
    assert_same(read_all(root), hf_bin_tensors())


def test_hf_bin_unreadable_variants_say_what_to_do(tmp_path, hf_bin):
    legacy = tmp_path / "legacy"
    shutil.copytree(hf_bin, legacy)
    shard = legacy / "pytorch_model-00002-of-00002.bin"
    torch.save(torch.load(shard, weights_only=True), shard, _use_new_zipfile_serialization=False)
    result = cli("inspect", legacy)
    assert result.exit_code != 0
    (line,) = error_lines(result.stderr)
    assert "pytorch_model-00002-of-00002.bin" in line and "legacy" in line, result.stderr

    tf = tmp_path / "tf"
    tf.mkdir()
    (tf / "tf_model.h5.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"w": "tf_model.h5"}}))
    result = cli("inspect", tf)
    (line,) = error_lines(result.stderr)
    assert "TensorFlow" in line and result.exit_code != 0

    missing = tmp_path / "missing"
    shutil.copytree(hf_bin, missing)
    (missing / "pytorch_model-00001-of-00002.bin").unlink()
    result = cli("inspect", missing)
    (line,) = error_lines(result.stderr)
    assert "pytorch_model-00001-of-00002.bin" in line


# --------------------------------------------------------------------------------------------
# 3. and 4. torch DCP's HuggingFaceStorageWriter, per rank

HF_WRITER_JOB = textwrap.dedent('''
    import os, sys, time
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp


    def full():
        g = torch.Generator().manual_seed(7)
        return {
            "model.w": torch.randn(6, 4, generator=g),
            "model.odd": torch.randn(5, 3, generator=g),
            "model.cols": torch.randn(3, 4, generator=g).to(torch.bfloat16),
            "model.ids": torch.arange(8, dtype=torch.int64),
            "model.rep": torch.randn(4, generator=g),
            "model.half": torch.randn(2, 6, generator=g).to(torch.float16),
        }


    def worker(rank, out, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        from torch.distributed.checkpoint import save
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        place = {"model.w": Shard(0), "model.odd": Shard(0), "model.cols": Shard(1), "model.ids": Shard(0),
                 "model.rep": Replicate(), "model.half": Shard(1)}
        # tensors only: the HF writer turns non-tensor values into a corrupt file (platform notes)
        state = {k: distribute_tensor(v.clone(), mesh, [place[k]]) for k, v in full().items()}
        save(state, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
        dist.barrier()
        if rank == 0:
            torch.save(full(), os.path.join(os.path.dirname(out), "full.pt"))
        dist.destroy_process_group()
        time.sleep(0.05)  # torch's exit abort: README, "Clean exits"


    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
''')


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("hf-writer")
    script = root / "job.py"
    script.write_text(HF_WRITER_JOB)
    port = 29500 + os.getpid() % 400
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(root / "out"), str(port)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out", torch.load(root / "full.pt", weights_only=True)


def test_per_rank_files_are_what_torch_writes(per_rank):
    """The premise: pieces, with their offsets only in `__metadata__["DCP_SHARDING_INFO"]`."""
    out, _full = per_rank
    files = sorted(p.name for p in out.iterdir())
    assert files == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    with safe_open(str(out / files[1]), "pt") as f:
        info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        assert info["model.w"]["saved_offsets"] == [3, 0]
        assert tuple(f.get_slice("model.w").get_shape()) == (3, 4)


def test_per_rank_output_is_read_assembled(per_rank):
    out, full = per_rank
    index = open_index(out)
    assert index.format == "hf-sharded" and index.world_size == 2
    assert {k: tuple(e.shape) for k, e in index.tensors.items()} == {k: tuple(t.shape) for k, t in full.items()}
    assert index.tensors["model.w"].n_chunks == 2 and index.tensors["model.rep"].n_chunks == 1
    assert_same(read_all(out), full)
    doc = json.loads(cli("inspect", out, "--json").stdout)
    assert any("HuggingFaceStorageWriter" in n for n in doc["notes"])
    assert cli("verify", out).exit_code == 0


@pytest.mark.parametrize("target", TARGETS)
def test_per_rank_output_to_every_target(per_rank, tmp_path, target):
    out_dir, full = per_rank
    out = tmp_path / OUT_NAME[target]
    result = cli("convert", out_dir, "--to", target, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    check_output(target, out, full, {}, json.loads(result.stdout), tmp_path)


def test_per_rank_output_agrees_with_torchs_own_reader(per_rank, tmp_path):
    """torch's `HuggingFaceStorageReader` loads the same directory into the same tensors (its
    consolidation, `consolidate_safetensors_files`, fails on integer tensors: platform notes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    out_dir, full = per_rank
    state = {k: torch.zeros_like(t) for k, t in full.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(out_dir)), no_dist=True)
    ours = tmp_path / "ours.safetensors"
    assert cli("consolidate", out_dir, "--format", "safetensors", "-o", ours).exit_code == 0
    assert {k: tensor_key(v) for k, v in load_file(str(ours)).items()} == {k: tensor_key(v) for k, v in state.items()}


def test_per_rank_output_with_a_rank_missing_is_refused(per_rank, tmp_path):
    out_dir, _full = per_rank
    broken = tmp_path / "broken"
    shutil.copytree(out_dir, broken)
    (broken / "shard-00001-model-00001-of-00001.safetensors").unlink()
    result = cli("convert", broken, "--to", "safetensors", "-o", tmp_path / "o.safetensors")
    assert result.exit_code != 0
    (line,) = error_lines(result.stderr)
    assert "model." in line and "no stored chunk holds" in line, line  # rank 1's pieces alone leave gaps
    doc = json.loads(cli("inspect", broken, "--json").stdout)
    assert any("no file of rank(s) 0" in n for n in doc["notes"])


def test_one_per_rank_file_alone_says_it_is_a_piece(per_rank, tmp_path):
    out_dir, full = per_rank
    piece = out_dir / "shard-00002-model-00001-of-00001.safetensors"
    doc = json.loads(cli("inspect", piece, "--json").stdout)
    assert doc["format"] == "safetensors"
    (note,) = doc["notes"]
    assert "pieces of larger tensors" in note and "model." in note and "consolidate" in note
    shapes = {t["fqn"]: t["shape"] for t in doc["tensors"]}
    assert shapes["model.w"] == [3, 4]  # the stored piece, not passed off as the [6, 4] tensor
    human = cli("inspect", piece)
    assert "Note" in human.stdout and "pieces" in human.stdout
    result = cli("convert", piece, "--to", "pt", "-o", tmp_path / "piece.pt")
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert any("pieces of larger tensors" in w for w in warnings), result.stderr
    assert tensor_key(torch.load(tmp_path / "piece.pt", weights_only=True)["model.w"]) == tensor_key(full["model.w"][3:])


def test_one_hyperparallel_rank_file_alone_says_it_is_a_piece(tmp_path):
    from _util import FIXTURES

    rank_file = FIXTURES / "m0-torch-4rank" / "_rank1_.safetensors"
    doc = json.loads(cli("inspect", rank_file, "--json").stdout)
    notes = " ".join(doc["notes"])
    assert "__dcp_chunk_" in notes and "HyperParallel" in notes and ".metadata" in notes
    result = cli("convert", rank_file, "--to", "safetensors", "-o", tmp_path / "r.safetensors")
    assert result.exit_code == 0, result.output
    assert "warning: source: _rank1_.safetensors" in result.stderr
    # a whole checkpoint's file says nothing of the kind
    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.zeros(2)}, str(whole))
    assert json.loads(cli("inspect", whole, "--json").stdout)["notes"] == []


# --------------------------------------------------------------------------------------------
# 5. user __metadata__ carried


def test_user_metadata_is_carried_to_safetensors_and_hf(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file({"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16)}, str(src),
              metadata={"format": "flax", "author": "x", "license": "mit"})
    doc = json.loads(cli("inspect", src, "--json").stdout)
    assert any("author, license" in n and "carried" in n for n in doc["notes"])
    st = tmp_path / "out.safetensors"
    result = cli("convert", src, "--to", "safetensors", "-o", st, "--json")
    assert result.exit_code == 0, result.output
    with safe_open(str(st), "pt") as f:
        assert f.metadata() == {"author": "x", "license": "mit", "format": "pt"}  # hpckpt's own key wins
    hf = tmp_path / "hf"
    assert cli("convert", src, "--to", "hf", "-o", hf, "--max-shard-size", "8B").exit_code == 0
    shards = sorted(hf.glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert f.metadata() == {"author": "x", "license": "mit", "format": "pt"}
    # from an hf-sharded source on, too; a key whose value differs between shards is not carried
    with safe_open(str(shards[0]), "pt") as f:
        first = {k: f.get_tensor(k) for k in f.keys()}
    save_file(first, str(shards[0]), metadata={"format": "pt", "author": "x", "license": "other"})
    again = tmp_path / "again.safetensors"
    result = cli("convert", hf, "--to", "safetensors", "-o", again)
    assert result.exit_code == 0, result.output
    with safe_open(str(again), "pt") as f:
        assert f.metadata() == {"author": "x", "format": "pt"}
    assert "license" in result.stderr and "differ" in result.stderr


def test_ms_flavour_still_wins_and_no_user_keys_means_no_change(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file({"w": torch.arange(4.0)}, str(src), metadata={"format": "pt"})
    out = tmp_path / "o.safetensors"
    assert cli("convert", src, "--to", "safetensors", "--framework", "mindspore", "-o", out).exit_code == 0
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"format": "ms"}
