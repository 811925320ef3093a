"""safetensors files (single and Hugging Face sharded) written by real torch and MindSpore."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _util import assert_bit_equal
from safetensors.torch import save_file

from hpckpt.converters import open_index
from hpckpt.core.io.read import read_box


def _raw(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


@pytest.fixture
def state():
    g = torch.Generator().manual_seed(0)
    return {
        "w_bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "w_fp16": torch.randn(4, generator=g).to(torch.float16),
        "w_fp32": torch.randn(2, 3, 4, generator=g),
        "step": torch.tensor(7.0),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
    }


def test_single_safetensors_file(tmp_path, state):
    path = tmp_path / "model.safetensors"
    save_file(state, str(path))
    for target in (path, tmp_path):  # the file, or a directory holding exactly one
        index = open_index(target)
        assert index.format == "safetensors"
        assert set(index.tensors) == set(state)
        for name, tensor in state.items():
            assert_bit_equal(read_box(index, index.tensors[name]), _raw(tensor), name)


def test_hf_sharded_with_index(tmp_path, state):
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    index = open_index(tmp_path)
    assert index.format == "hf-sharded"
    assert index.data_files == sorted(shards)
    for name, tensor in state.items():
        assert_bit_equal(read_box(index, index.tensors[name]), _raw(tensor), name)


def test_mindspore_written_safetensors(tmp_path):
    import mindspore as ms

    values = {
        "dense.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "ln.gamma": np.linspace(0, 1, 5).astype(np.float16),
        "step": np.array(3, dtype=np.int32),
    }
    params = {k: ms.Parameter(ms.Tensor(v), name=k) for k, v in values.items()}
    params["bf"] = ms.Parameter(ms.Tensor(np.array([1.5, -2.0, 0.25], dtype=np.float32), ms.bfloat16), name="bf")
    path = tmp_path / "net.safetensors"
    ms.save_checkpoint(params, str(path), format="safetensors")
    index = open_index(path)
    assert index.framework == "mindspore"
    for name, array in values.items():
        got = read_box(index, index.tensors[name])
        assert got.dtype == array.dtype and np.array_equal(got, array), name
    bf = read_box(index, index.tensors["bf"])
    expected = (np.array([1.5, -2.0, 0.25], dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert index.tensors["bf"].dtype.name == "bfloat16"
    assert np.array_equal(bf, expected)


def test_read_any_sub_box(tmp_path):
    """Column slices and inner boxes come out of ranged reads, bit-exact."""
    full = torch.arange(6 * 7 * 5, dtype=torch.float32).reshape(6, 7, 5)
    save_file({"t": full}, str(tmp_path / "m.safetensors"))
    index = open_index(tmp_path / "m.safetensors")
    from hpckpt.core.geometry.box import Box

    entry = index.tensors["t"]
    for box in (Box((0, 2, 0), (6, 1, 5)), Box((1, 1, 1), (3, 4, 2)), Box((5, 6, 4), (1, 1, 1)), Box((0, 0, 3), (6, 7, 2))):
        expected = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].numpy()
        assert_bit_equal(read_box(index, entry, box), expected, str(box))
        # a tiny read budget forces the per-row path
        from hpckpt.core.io import read as read_mod

        out = np.empty(box.sizes, dtype=np.float32)
        loc = index.locate(entry.chunks[0], entry)
        with read_mod.OpenFiles() as files:
            read_mod.read_region(files, loc, box, out, budget=16)
        assert_bit_equal(out, expected, f"{box} budget=16")
