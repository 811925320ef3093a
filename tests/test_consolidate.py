"""`hpckpt consolidate`: every fixture merged into whole tensors, read back with the real libraries.

Outputs are checked with independent readers (safetensors, `torch.load(weights_only=True)`, the
index JSON parsed by hand) against the fixtures' ground truth (`expected.safetensors`,
`expected.json`), which HyperParallel's fixture author wrote without hpckpt. Most runs call
`hpckpt.api` or typer's CliRunner; one representative run uses the console script.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import as_json_value, FIXTURE_NAMES, FIXTURES, assert_bit_equal, expected_tensors, expected_values, torch_bytes
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.converters import open_index
from hpckpt.core.io.read import OpenFiles, read_box

runner = CliRunner()
HPCKPT = Path(sys.executable).with_name("hpckpt")


# --------------------------------------------------------------------------------------------
# helpers


def expected_torch(fixture: Path) -> dict[str, torch.Tensor]:
    return load_file(str(fixture / "expected.safetensors"))



def assert_same_tensor(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch_bytes(got) == torch_bytes(want), f"{what}: bytes differ"


def assert_values_document(document: dict, expected: dict, names=None) -> None:
    """A `values.json` side file: `{fqn: {"type", "value"}}`, type names and values as expected."""
    want = {k: v for k, v in expected.items() if names is None or k in names}
    assert set(document) == set(want)
    for fqn, item in want.items():
        assert document[fqn]["type"] == item["type"], fqn
        assert document[fqn]["value"] == item["value"], fqn


def assert_python_values(values: dict, expected: dict) -> None:
    """Real Python values (from torch.load or decode_value) against expected.json, types included."""
    assert set(values) == set(expected)
    for fqn, item in expected.items():
        got = values[fqn]
        assert type(got).__name__ == item["type"], f"{fqn}: {type(got).__name__} != {item['type']}"
        assert as_json_value(got) == item["value"], fqn


def no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate JSON keys: {keys}"
    return dict(pairs)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def cli(*args: str):
    return runner.invoke(app, [*map(str, args)])


# --------------------------------------------------------------------------------------------
# safetensors


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_safetensors_bit_exact_with_values_side_file(name, tmp_path):
    fixture = FIXTURES / name
    before = snapshot(fixture)
    out = tmp_path / "model.safetensors"
    report = api.consolidate(fixture, out, "safetensors")
    want = expected_torch(fixture)
    got = load_file(str(out))
    assert set(got) == set(want)
    for fqn, tensor in want.items():
        assert_same_tensor(got[fqn], tensor, fqn)
    assert report["bytes_written"] == sum(t.numel() * t.element_size() for t in want.values())
    side = tmp_path / "model.values.json"
    assert_values_document(json.loads(side.read_text()), expected_values(fixture))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model.safetensors.hpckpt-manifest.jsonl",
                                                          "model.values.json"]
    assert snapshot(fixture) == before


def test_zero_d_empty_shard_and_bf16_are_exact(tmp_path):
    """The three awkward cases of the M0 fixture, spelled out: a 0-d step, lm_head with an empty
    chunk on rank 3 (ceil rule), and a bf16 tensor, compared as raw bits."""
    fixture = FIXTURES / "m0-torch-4rank"
    index = open_index(fixture)
    lm_head = index.tensors["model.lm_head.weight"]
    assert any(c.box.is_empty for c in lm_head.chunks)  # the premise: an empty stored chunk
    out = tmp_path / "m.safetensors"
    api.consolidate(fixture, out, select=api.Selection.of(["model.lm_head.weight", "*.step", "model.layers.0.mlp.down_proj.weight"]))
    got = load_file(str(out))
    want = expected_torch(fixture)
    assert set(got) == {"model.lm_head.weight", "optimizer.state.0.step", "optimizer.state.1.step",
                        "model.layers.0.mlp.down_proj.weight"}
    assert got["optimizer.state.0.step"].shape == ()
    assert got["optimizer.state.0.step"].item() == want["optimizer.state.0.step"].item() != 0
    assert got["model.lm_head.weight"].shape == (5, 4)
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    for fqn in got:
        assert_same_tensor(got[fqn], want[fqn], fqn)


# --------------------------------------------------------------------------------------------
# Hugging Face shards


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_hf_shards(name, tmp_path):
    fixture = FIXTURES / name
    out = tmp_path / "hf"
    cap = 64
    result = cli("consolidate", fixture, "-o", out, "--format", "hf", "--max-shard-size", f"{cap}B", "--json")
    assert result.exit_code == 0, result.stderr
    want = expected_torch(fixture)
    document = json.loads((out / "model.safetensors.index.json").read_text(), object_pairs_hook=no_duplicate_keys)
    weight_map = document["weight_map"]
    assert set(weight_map) == set(want)  # every tensor exactly once (duplicates refused above)
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert document["metadata"]["total_size"] == total
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 1
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    seen = {}
    for shard in shards:
        tensors = load_file(str(out / shard))
        assert {k for k, f in weight_map.items() if f == shard} == set(tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= cap or len(tensors) == 1, f"{shard}: {size} bytes in {len(tensors)} tensors"
        seen.update(tensors)
    assert set(seen) == set(want)
    for fqn, tensor in want.items():
        assert_same_tensor(seen[fqn], tensor, fqn)
    assert_values_document(json.loads((out / "values.json").read_text()), expected_values(fixture))
    assert not list(tmp_path.glob(".*hpckpt-tmp*"))
    inspected = cli("inspect", "--json", out)
    assert inspected.exit_code == 0, inspected.stderr
    doc = json.loads(inspected.stdout)
    assert doc["format"] == "hf-sharded"
    assert doc["counts"]["tensors"] == len(want) and doc["counts"]["tensor_bytes"] == total


def test_hf_one_shard_when_everything_fits(tmp_path):
    fixture = FIXTURES / "m0-mindspore-1rank"
    out = tmp_path / "hf"
    api.consolidate(fixture, out, "hf")  # default 5GB
    document = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(document["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    got = load_file(str(out / "model-00001-of-00001.safetensors"))
    for fqn, tensor in expected_torch(fixture).items():
        assert_same_tensor(got[fqn], tensor, fqn)


# --------------------------------------------------------------------------------------------
# torch.save


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_pt_loads_with_weights_only(name, tmp_path):
    fixture = FIXTURES / name
    out = tmp_path / "model.pt"
    api.consolidate(fixture, out, "pt")
    loaded = torch.load(out, weights_only=True)
    want = expected_torch(fixture)
    tensors = {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == set(want)
    for fqn, tensor in want.items():
        assert_same_tensor(tensors[fqn], tensor, fqn)
    assert_python_values({k: v for k, v in loaded.items() if k not in tensors}, expected_values(fixture))


# --------------------------------------------------------------------------------------------
# one-rank HyperParallel DCP


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_dcp_one_rank(name, tmp_path):
    fixture = FIXTURES / name
    out = tmp_path / "one"
    api.consolidate(fixture, out, "dcp")
    index = open_index(out)
    assert index.format == "hyperparallel" and index.world_size == 1
    want = expected_tensors(fixture)
    values = expected_values(fixture)
    assert {f for f in index.data_files if f.endswith(".safetensors")} == {"_rank0_.safetensors"}
    assert set(index.tensors) == set(want)
    with OpenFiles() as files:
        for fqn, entry in index.tensors.items():
            assert [c.box.sizes for c in entry.chunks] == [tuple(want[fqn].shape)], fqn
            assert_bit_equal(read_box(index, entry, files=files), want[fqn], fqn)
    assert_python_values({fqn: index.decode_value(fqn) for fqn in index.values}, values)
    assert api.verify(out)["exit_code"] == 0


# --------------------------------------------------------------------------------------------
# filtering


@pytest.mark.parametrize(
    ("include", "exclude"),
    [(["model.*"], []), ([], ["*.step"]), (["optimizer.*"], ["*.step"])],
)
def test_include_exclude(include, exclude, tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    out = tmp_path / "f.safetensors"
    args = [a for g in include for a in ("--include", g)] + [a for g in exclude for a in ("--exclude", g)]
    result = cli("consolidate", fixture, "-o", out, *args, "--json")
    assert result.exit_code == 0, result.stderr

    def keep(name: str) -> bool:
        return (not include or any(fnmatch.fnmatchcase(name, g) for g in include)) and not any(
            fnmatch.fnmatchcase(name, g) for g in exclude)

    want = {k: v for k, v in expected_torch(fixture).items() if keep(k)}
    got = load_file(str(out))
    assert set(got) == set(want) and want
    for fqn, tensor in want.items():
        assert_same_tensor(got[fqn], tensor, fqn)
    values = {k for k in expected_values(fixture) if keep(k)}
    side = tmp_path / "f.values.json"
    if values:
        assert_values_document(json.loads(side.read_text()), expected_values(fixture), values)
    else:
        assert not side.exists()


def test_include_filters_pt_values_too(tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    out = tmp_path / "x.pt"
    api.consolidate(fixture, out, "pt", select=api.Selection.of(["extra_state.*"]))
    loaded = torch.load(out, weights_only=True)
    expected = {k: v for k, v in expected_values(fixture).items() if k.startswith("extra_state.")}
    assert_python_values(loaded, expected)


# --------------------------------------------------------------------------------------------
# casts


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_dtype_cast_matches_torch(name, dtype, torch_dtype, tmp_path):
    fixture = FIXTURES / name
    out = tmp_path / "c.safetensors"
    api.consolidate(fixture, out, dtype=dtype)
    got = load_file(str(out))
    want = expected_torch(fixture)
    assert set(got) == set(want)
    for fqn, tensor in want.items():
        reference = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor  # ints/bool untouched
        assert_same_tensor(got[fqn], reference, fqn)


def test_cast_rounding_matches_torch(tmp_path):
    """Values that need rounding (ties, subnormals, overflow to inf), not just the fixtures' exact
    ones: every non-NaN element is bit-identical to torch's cast, NaNs stay NaN."""
    rng = np.random.default_rng(1)
    bits = np.concatenate([
        rng.integers(0, 2**32, size=4000, dtype=np.uint64).astype(np.uint32),
        np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x80000000,
                  0x00000001, 0x00008000, 0x00018000, 0x477FF000, 0x477FE000, 0x7FC00000], dtype=np.uint32),
    ])
    f32 = torch.from_numpy(bits.view(np.float32).copy())
    source = {
        "f32": f32,
        "f16": torch.from_numpy(np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16).copy()),
        "bf16": torch.from_numpy(np.arange(2**16, dtype=np.uint32).astype(np.int16).copy()).view(torch.bfloat16),
        "f64": torch.from_numpy(rng.standard_normal(4000) * np.exp(rng.uniform(-30, 30, 4000))),
        "i32": torch.arange(-5, 5, dtype=torch.int32),
    }
    src = tmp_path / "src.safetensors"
    save_file(source, str(src))
    for dtype, torch_dtype in [("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp16", torch.float16)]:
        out = tmp_path / f"{dtype}.safetensors"
        with warnings.catch_warnings():
            # numpy's overflow RuntimeWarning is the subject of the next test, not of this one
            warnings.simplefilter("ignore", RuntimeWarning)
            api.consolidate(src, out, dtype=dtype, settings=api.WriteSettings(max_memory=4096))
        got = load_file(str(out))
        for fqn, tensor in source.items():
            reference = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
            assert got[fqn].dtype == reference.dtype, (dtype, fqn)
            if not reference.is_floating_point():
                assert torch.equal(got[fqn], reference)
                continue
            nan = torch.isnan(reference)
            assert torch.equal(torch.isnan(got[fqn]), nan), (dtype, fqn)
            keep = ~nan
            a = got[fqn][keep].contiguous().view(torch.int16 if reference.element_size() == 2 else torch.int32)
            b = reference[keep].contiguous().view(torch.int16 if reference.element_size() == 2 else torch.int32)
            mismatch = (a != b).nonzero()
            assert mismatch.numel() == 0, f"{dtype} {fqn}: {mismatch.numel()} elements differ from torch"


def test_cast_overflow_is_quiet_on_the_command_line(tmp_path):
    """Out-of-range values become inf as in torch, without numpy warnings leaking to stderr."""
    src = tmp_path / "big.safetensors"
    big = torch.tensor([1e5, -7e4, 1.0, 3.0e38], dtype=torch.float32)
    huge = torch.tensor([1e300, -1e300, 0.5], dtype=torch.float64)
    save_file({"big": big, "huge": huge}, str(src))
    out = tmp_path / "h.safetensors"
    proc = subprocess.run([str(HPCKPT), "consolidate", str(src), "-o", str(out), "--dtype", "fp16", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(out))
    assert_same_tensor(got["big"], big.half(), "big")
    assert_same_tensor(got["huge"], huge.half(), "huge")
    assert proc.stderr == "", proc.stderr


# --------------------------------------------------------------------------------------------
# usage errors and refusing to overwrite


def test_bad_format_is_a_usage_error(tmp_path):
    out = tmp_path / "x"
    result = cli("consolidate", FIXTURES / "m0-torch-4rank", "-o", out, "--format", "onnx")
    assert result.exit_code == 2
    assert "--format" in result.output or "--format" in result.stderr
    assert not out.exists()
    with pytest.raises(ValueError, match="onnx"):
        api.consolidate(FIXTURES / "m0-torch-4rank", out, "onnx")


@pytest.mark.parametrize(("fmt", "name"), [("safetensors", "o.safetensors"), ("pt", "o.pt"), ("hf", "hf"), ("dcp", "dcp")])
def test_existing_output_needs_force(fmt, name, tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    out = tmp_path / name
    if fmt in ("hf", "dcp"):
        out.mkdir()
        (out / "keep").write_text("old")
    else:
        out.write_text("old")
    result = cli("consolidate", fixture, "-o", out, "--format", fmt)
    assert result.exit_code == 14, (result.exit_code, result.stderr)
    assert "exists" in result.stderr
    if out.is_dir():
        assert sorted(p.name for p in out.iterdir()) == ["keep"] and (out / "keep").read_text() == "old"
    else:
        assert out.read_text() == "old"
    if fmt != "safetensors":  # (a .safetensors name is sniffed as safetensors: --force replaces it)
        refused = cli("consolidate", fixture, "-o", out, "--format", fmt, "--force")
        assert refused.exit_code == 16 and "refusing to replace" in refused.stderr, refused.stderr
        ours = tmp_path / f"ours-{name}"  # --force replaces an output of hpckpt's
        api.consolidate(fixture, ours, fmt)
        shutil.copytree(ours, out, dirs_exist_ok=True) if out.is_dir() else os.replace(ours, out)
        if out.is_dir():  # the checkpoint and a file that is not its: refused, the file kept
            refused = cli("consolidate", fixture, "-o", out, "--format", fmt, "--force")
            assert refused.exit_code == 16 and "keep is not part of its checkpoint" in refused.stderr, refused.stderr
            assert (out / "keep").read_text() == "old"
            (out / "keep").unlink()
    result = cli("consolidate", fixture, "-o", out, "--format", fmt, "--force", "--json")
    assert result.exit_code == 0, result.stderr
    want = expected_tensors(fixture)
    if fmt == "pt":
        loaded = torch.load(out, weights_only=True)
        assert {k for k, v in loaded.items() if isinstance(v, torch.Tensor)} == set(want)
    else:
        if fmt in ("hf", "dcp"):
            assert not (out / "keep").exists()
        assert set(open_index(out).tensors) == set(want)
    assert not [p for p in tmp_path.iterdir() if ".hpckpt-tmp-" in p.name]


def test_console_script_consolidate(tmp_path):
    fixture = FIXTURES / "m0-torch-4rank-rankLocal"
    out = tmp_path / "m.safetensors"
    proc = subprocess.run([str(HPCKPT), "consolidate", str(fixture), "-o", str(out), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["command"] == "consolidate" and report["format"] == "safetensors"
    assert report["bytes_written"] == os.path.getsize(out) - 8 - int.from_bytes(out.read_bytes()[:8], "little")
    got = load_file(str(out))
    for fqn, tensor in expected_torch(fixture).items():
        assert_same_tensor(got[fqn], tensor, fqn)
    again = subprocess.run([str(HPCKPT), "consolidate", str(fixture), "-o", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 14 and "exists" in again.stderr
