"""What real producers write at the edges, each once found giving a wrong answer with exit 0 or an
internal error: names that flatten alike, entries a name preset drops, a lone Hugging Face shard,
duplicates an index resolves, torch dtype/device and numpy values, DTensors pickled whole, and
PyTorch DCP's safetensors serialization."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hpckpt import api
from hpckpt.converters import open_index


def run_hpckpt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("state", [
    {0: torch.ones(1), "0": torch.zeros(1)},
    {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}},
    {"model": {"w": torch.ones(1)}, "model.w": torch.zeros(1)},
    {"state": {1: "x", "1": "y"}, "w": torch.ones(1)},
], ids=["int-vs-str-key", "dotted-vs-nested", "prefix", "values"])
def test_names_that_flatten_alike_are_refused_not_merged(tmp_path, state):
    src = tmp_path / "src.pt"
    torch.save(state, src)
    for argv in (["inspect", src], ["convert", src, "-o", tmp_path / "out.safetensors"]):
        proc = run_hpckpt(*argv)
        assert proc.returncode == 9 and "same name" in proc.stderr, (argv, proc.stderr)
    assert not (tmp_path / "out.safetensors").exists()


def test_entries_a_name_preset_drops_are_reported_skipped(tmp_path):
    import mindspore as ms
    from mindspore import Parameter, Tensor

    src = tmp_path / "train.ckpt"
    params = {"0.weight": np.ones((2, 3), np.float32), "moment1.0.weight": np.zeros((2, 3), np.float32),
              "moment2.0.weight": np.zeros((2, 3), np.float32), "beta1_power": np.array(0.729, np.float32),
              "beta2_power": np.array(0.997, np.float32), "global_step": np.array(3, np.int32)}
    ms.save_checkpoint([{"name": k, "data": Parameter(Tensor(v), name=k)} for k, v in params.items()], str(src))
    proc = run_hpckpt("convert-ms-torch", src, "-o", tmp_path / "out.pt", "--json")
    assert proc.returncode == 0, proc.stderr
    skipped = {s["name"]: s["reason"] for s in json.loads(proc.stdout)["skipped"]}
    assert {"beta1_power", "beta2_power"} <= set(skipped) and "beta**step" in skipped["beta1_power"]
    assert any(line.startswith("warning: not written") and "beta1_power" in line for line in proc.stderr.splitlines())
    written = set(torch.load(tmp_path / "out.pt", weights_only=True))
    assert not {"beta1_power", "beta2_power"} & written


def test_a_lone_hugging_face_shard_says_what_it_is(tmp_path):
    from safetensors.torch import save_file

    shard = tmp_path / "shard"  # (an output inside the source directory is refused)
    shard.mkdir()
    save_file({"a": torch.ones(2)}, shard / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    proc = run_hpckpt("convert", shard, "-o", tmp_path / "out.pt")
    assert proc.returncode == 0
    assert any(line.startswith("warning: source:") and "shard 1 of 2" in line for line in proc.stderr.splitlines())


def test_a_tensor_in_two_bin_shards_is_read_from_the_one_the_index_names(tmp_path):
    bins = tmp_path / "bins"  # (an output inside the source directory is refused)
    bins.mkdir()
    torch.save({"w": torch.ones(2), "a": torch.ones(1)}, bins / "pytorch_model-00001-of-00002.bin")
    torch.save({"w": torch.zeros(2), "b": torch.ones(1)}, bins / "pytorch_model-00002-of-00002.bin")
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin",
        "w": "pytorch_model-00002-of-00002.bin"}}))
    api.convert(bins, tmp_path / "out.pt")
    assert torch.load(tmp_path / "out.pt", weights_only=True)["w"].sum() == 0


def test_torch_dtype_and_device_values_keep_their_kind(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2), "dtype": torch.bfloat16, "device": torch.device("cpu"),
                "nested": {"d": [torch.float8_e4m3fn, torch.device("cuda", 1)]}}, src)
    api.convert(src, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["dtype"] is torch.bfloat16 and got["device"] == torch.device("cpu")
    assert got["nested.d"] == [torch.float8_e4m3fn, torch.device("cuda", 1)]
    api.convert(src, tmp_path / "hp", "hp")  # HyperParallel pickles them naming torch's own globals
    payload = (tmp_path / "hp" / "_rank0_.bytes").read_bytes()
    assert b"hpckpt" not in payload and b"torch" in payload
    assert run_hpckpt("verify", tmp_path / "hp").returncode == 0
    api.convert(tmp_path / "hp", tmp_path / "again.pt")
    assert torch.load(tmp_path / "again.pt", weights_only=True)["dtype"] is torch.bfloat16
    report = api.convert(src, tmp_path / "out.safetensors")
    converted = {c["name"] for c in report["converted"]}
    assert {"dtype", "device"} <= converted
    sidecar = json.loads((tmp_path / "out.values.json").read_text())
    assert sidecar["dtype"]["value"] == "torch.bfloat16" and sidecar["device"]["value"] == "cpu"


@pytest.mark.parametrize("target", ["out.pt", "torch-dcp"])
def test_values_torch_cannot_load_are_converted_or_skipped_never_an_internal_error(tmp_path, target):
    import datetime

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2), "acc": np.float64(0.5), "epoch": np.int64(3), "arr": np.arange(3),
                "when": datetime.date(2026, 1, 2)}, src)
    out = tmp_path / target
    proc = run_hpckpt("convert", src, "-o", out, "--json", *(["--to", "torch-dcp"] if target == "torch-dcp" else []))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {s["name"] for s in report["skipped"]} == {"arr", "when"}
    assert {c["name"] for c in report["converted"]} == {"acc", "epoch"}
    if target == "out.pt":
        got = torch.load(out, weights_only=True)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(out), str(tmp_path / "back.pt"))
        got = torch.load(tmp_path / "back.pt", weights_only=True)
    assert got["acc"] == 0.5 and type(got["acc"]) is float and got["epoch"] == 3 and type(got["epoch"]) is int
    assert "arr" not in got and "when" not in got


def test_a_dtensor_pickled_whole_is_an_unknown_format_not_an_unsafe_pickle(tmp_path):
    script = tmp_path / "save.py"
    script.write_text(textwrap.dedent(f"""
        import time
        import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        dt = distribute_tensor(torch.arange(6.0).reshape(2, 3), init_device_mesh("cpu", (1,)), [Shard(0)])
        dcp.save({{"a": {{"b": dt}}, "w": torch.ones(2)}}, checkpoint_id="{tmp_path}/ckpt",
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
        dist.destroy_process_group()
        time.sleep(0.05)  # torch's exit abort: README, "Clean exits"
    """))
    subprocess.run([sys.executable, str(script)], check=True, capture_output=True, timeout=120,
                   env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    proc = run_hpckpt("convert", tmp_path / "ckpt", "-o", tmp_path / "out.pt")
    assert proc.returncode == 5 and "tensor subclass" in proc.stderr, proc.stderr
    assert not (tmp_path / "out.pt").exists()


def test_torch_dcp_saved_as_safetensors_is_read(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    state = {"w": torch.arange(4.0), "m": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    writer = dcp.FileSystemWriter(str(tmp_path / "ckpt"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(state, storage_writer=writer, no_dist=True)
    index = open_index(tmp_path / "ckpt")
    assert index.format == "torch-dcp" and set(index.tensors) == {"w", "m"}
    assert run_hpckpt("verify", tmp_path / "ckpt").returncode == 0
    api.convert(tmp_path / "ckpt", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    for k, t in state.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k


def test_an_entry_the_index_names_as_a_tensor_is_not_also_a_value(tmp_path):
    torch.save({"w": 3, "a": torch.ones(1)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "pytorch_model-00001-of-00002.bin", "w": "pytorch_model-00002-of-00002.bin"}}))
    index = open_index(tmp_path)
    assert "w" in index.tensors and "w" not in index.values
