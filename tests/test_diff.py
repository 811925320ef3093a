"""`hpckpt diff`: what a user runs after a conversion. Real checkpoints (HyperParallel's own
fixture, hpckpt's outputs, files written by the safetensors library), expected figures computed
independently with numpy and torch."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from _util import FIXTURES
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from hpckpt.api.diff import diff
from hpckpt.cli.app import app

FIXTURE = FIXTURES / "m0-torch-4rank"
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_a_reshard_is_bit_identical_to_its_source(tmp_path):
    assert cli("reshard", FIXTURE, "-o", tmp_path / "r8", "--world-size", "8", "-q").exit_code == 0
    result = cli("diff", FIXTURE, tmp_path / "r8", "--json")
    assert result.exit_code == 0, result.stdout
    doc = json.loads(result.stdout)
    assert doc["equal"] and doc["counts"] == {"identical": 15} and not doc["only_a"] and not doc["only_b"]
    assert len(doc["values"]) == 9 and all(v["equal"] for v in doc["values"])


def test_a_cast_is_reported_with_its_exact_errors_and_passes_with_tolerances(tmp_path):
    out = tmp_path / "bf.safetensors"
    assert cli("convert", FIXTURE, "-o", out, "--dtype", "bf16", "-q").exit_code == 0
    strict = cli("diff", FIXTURE, out, "--json")
    assert strict.exit_code == 25
    doc = json.loads(strict.stdout)
    full = load_file(str(FIXTURE / "expected.safetensors"))
    floats = {n for n, t in full.items() if t.is_floating_point()}
    assert set(doc["dtype_changed"]) == {n for n in floats if full[n].dtype != torch.bfloat16}
    for t in doc["tensors"]:  # the errors, computed here with torch's own rounding
        a = full[t["name"]].double()
        b = full[t["name"]].to(torch.bfloat16).double() if t["name"] in floats else a
        err = (a - b).abs()
        assert t["differing"] == int((err > 0).sum()), t
        assert t["max_abs"] == pytest.approx(float(err.max()) if err.numel() else 0.0), t
    loose = cli("diff", FIXTURE, out, "--allow-dtype", "--rtol", "0.01", "--atol", "0.01")
    assert loose.exit_code == 0, loose.stdout
    assert "equal (atol 0.01, rtol 0.01)" in loose.stdout


def _safetensors(path, tensors, metadata=None):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def test_one_changed_element_nans_missing_entries_and_shapes(tmp_path):
    base = {"w": torch.arange(300_000, dtype=torch.float32).reshape(3000, 100), "n": torch.tensor([1.0, math.nan]),
            "i": torch.arange(10), "gone": torch.ones(2), "s": torch.zeros(4)}
    other = {k: v.clone() for k, v in base.items() if k != "gone"}
    other["w"][2999, 99] += 0.25  # the very last element: found only if every block is read
    other["i"][3] = 7
    other["s"] = torch.zeros(2, 2)
    other["new"] = torch.ones(1)
    _safetensors(tmp_path / "a.safetensors", base)
    _safetensors(tmp_path / "b.safetensors", other)
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", max_memory=64 * 1024)  # ~100 blocks
    by = {t.name: t for t in report.tensors}
    assert (by["w"].status, by["w"].differing, by["w"].max_abs) == ("differ", 1, 0.25)
    assert by["w"].max_rel == pytest.approx(0.25 / 299_999.25)
    assert by["n"].status == "identical"  # NaN against the same NaN
    assert (by["i"].status, by["i"].differing, by["i"].max_abs) == ("differ", 1, 4.0)
    assert by["s"].status == "shape"
    assert report.only_a == ["gone"] and report.only_b == ["new"] and not report.equal
    assert diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", atol=0.25, select=_only("w")).equal
    result = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert result.exit_code == 25 and "DIFFERENT" in result.stdout and "1 of 300000" in result.stdout


def _only(*names):
    from hpckpt.api import Selection

    return Selection.of(include=list(names))


def test_a_nan_against_a_number_is_a_difference_at_any_tolerance(tmp_path):
    _safetensors(tmp_path / "a.safetensors", {"x": torch.tensor([1.0, math.nan, math.inf])})
    _safetensors(tmp_path / "b.safetensors", {"x": torch.tensor([1.0, 2.0, math.inf])})
    report = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", atol=1e9)
    (t,) = report.tensors
    assert (t.status, t.differing, t.max_abs) == ("differ", 1, math.inf)
    doc = report.to_json()
    assert doc["tensors"][0]["max_abs"] == "inf"  # JSON has no infinity
    json.dumps(doc, allow_nan=False)


def test_values_are_compared_by_type_and_value(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(FIXTURE, a)
    shutil.copytree(FIXTURE, b)
    import hpckpt.dist as hdist  # one process writes both, with one value changed in type only

    state = {"w": torch.ones(3), "betas": (0.9, 0.99), "lr": 1e-3}
    hdist.save(state, a / "ck")
    hdist.save({**state, "betas": [0.9, 0.99]}, b / "ck")
    report = diff(a / "ck", b / "ck")
    values = {v["name"]: v for v in report.values}
    assert not values["betas"]["equal"] and values["lr"]["equal"]
    assert values["betas"]["a"] == "tuple (0.9, 0.99)" and values["betas"]["b"] == "list [0.9, 0.99]"
    assert not report.equal


def test_names_map_a_mindspore_checkpoint_onto_its_torch_conversion(tmp_path):
    pytest.importorskip("mindspore")
    import mindspore as ms
    from mindspore import nn

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = nn.LayerNorm((4,)), nn.Dense(4, 3)  # gamma/beta in MindSpore, weight/bias in torch

    ms.save_checkpoint(Net(), str(tmp_path / "net.ckpt"))
    assert cli("convert", tmp_path / "net.ckpt", "-o", tmp_path / "net.pt", "--names", "ms-to-torch", "-q").exit_code == 0
    assert cli("diff", tmp_path / "net.ckpt", tmp_path / "net.pt").exit_code == 25  # other names
    result = cli("diff", tmp_path / "net.ckpt", tmp_path / "net.pt", "--names", "ms-to-torch", "--json")
    assert result.exit_code == 0, result.stdout
    assert json.loads(result.stdout)["counts"] == {"identical": 4}


def test_an_unreadable_side_is_its_documented_error(tmp_path):
    result = cli("diff", FIXTURE, tmp_path / "missing")
    assert result.exit_code == 3 and "no such file" in result.stderr.lower()
