"""`hpckpt convert`: every source hpckpt reads into every target, read back by the real consumer.

Targets and the independent reader each output is checked with:

* `pt`          `torch.load(weights_only=True)`, with and without `mmap=True`
* `ms`          `mindspore.load_checkpoint` (bf16 compared as raw bits through `Tensor.view(uint16)`)
* `safetensors` `safetensors.torch.load_file` (+ the `<name>.values.json` side file)
* `hf`          the index JSON parsed by hand + `safetensors.torch.load_file` per shard (+ `values.json`)
* `hp`          hpckpt's reader, `hpckpt verify`, and the HyperParallel format itself: `.metadata`
                unpickled by the stock unpickler into stand-ins of HyperParallel's classes
                (tests/hp_reference.py), rank files read by the safetensors library
* `torch-dcp`   `torch.distributed.checkpoint.load` into full tensors, and
                `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`

Sources: the HyperParallel fixtures (ground truth `expected.safetensors` / `expected.json`, written
without hpckpt), a real `torch.save` of a model + optimizer state dict, a PyTorch DCP checkpoint saved
by two ranks under torchrun (one launch for the whole file), MindSpore `.ckpt` files written by
`mindspore.save_checkpoint`. Everything is compared bit for bit (bf16 as raw bits).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _util import FIXTURE_NAMES, FIXTURES, as_json_value, expected_values, torch_bytes
from hp_reference import HP_META, HP_STORAGE, hp_modules
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.converters import format_named, open_index
from hpckpt.core.errors import CorruptDataError, DestinationExistsError
from hpckpt.core.io.read import OpenFiles, read_box

runner = CliRunner()
DIST_SCRIPT = Path(__file__).parent / "dist_scripts" / "torch_dcp_save.py"

TARGETS = ("pt", "ms", "safetensors", "hf", "hp", "torch-dcp")
OUT_NAME = {"pt": "model.pt", "ms": "model.ckpt", "safetensors": "model.safetensors",
            "hf": "hf", "hp": "hp", "torch-dcp": "dcp"}
TORCH_DTYPE_NAMES = {
    "float64": "Float64", "float32": "Float32", "float16": "Float16", "bfloat16": "BFloat16",
    "int8": "Int8", "int16": "Int16", "int32": "Int32", "int64": "Int64", "uint8": "UInt8", "bool": "Bool",
}
MS_TO_TORCH = {ms_name: torch_name for torch_name, ms_name in TORCH_DTYPE_NAMES.items()}


# --------------------------------------------------------------------------------------------
# helpers: what is expected, and how each output is read back


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def run_hpckpt(*args) -> subprocess.CompletedProcess:
    """The command line as a user runs it: a fresh `python -m hpckpt` process."""
    return subprocess.run([sys.executable, "-m", "hpckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def fixture_values(fixture: Path) -> dict[str, Any]:
    """expected.json as Python values (tuples are stored as lists there)."""
    out = {}
    for fqn, item in expected_values(fixture).items():
        out[fqn] = tuple(item["value"]) if item["type"] == "tuple" else item["value"]
        assert type(out[fqn]).__name__ == item["type"], fqn
    return out


def tensor_key(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw row-major bytes): what two tensors must share to be bit-identical."""
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), torch_bytes(t)


def ms_tensor_key(t) -> tuple[str, tuple[int, ...], bytes]:
    """The same for a MindSpore Tensor/Parameter; bf16 is bitcast to uint16 (no numpy bf16)."""
    import mindspore as ms

    name = str(t.dtype)
    array = t.view(ms.uint16).asnumpy() if t.dtype == ms.bfloat16 else t.asnumpy()
    return MS_TO_TORCH[name], tuple(t.shape), np.ascontiguousarray(array).tobytes()


def np_key(array: np.ndarray, dtype_name: str) -> tuple[str, tuple[int, ...], bytes]:
    return dtype_name, tuple(array.shape), np.ascontiguousarray(array).tobytes()


def assert_tensors(got: dict[str, tuple], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: extra {sorted(set(got) - set(want))}, " \
                                  f"missing {sorted(set(want) - set(got))}"
    for fqn, tensor in want.items():
        expected = tensor_key(tensor)
        assert got[fqn][:2] == expected[:2], f"{what}: {fqn}: {got[fqn][:2]} != {expected[:2]}"
        assert got[fqn][2] == expected[2], f"{what}: {fqn}: bytes differ"


def assert_python_values(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert set(got) == set(want), f"{what}: value names {sorted(got)} != {sorted(want)}"
    for fqn, value in want.items():
        assert type(got[fqn]) is type(value), f"{what}: {fqn}: {type(got[fqn]).__name__} != {type(value).__name__}"
        assert got[fqn] == value, f"{what}: {fqn}: {got[fqn]!r} != {value!r}"


def values_document(values: dict[str, Any]) -> dict:
    """What a `values.json` side file must hold: type name and JSON value per entry."""
    return {fqn: {"type": type(v).__name__, "value": as_json_value(v)} for fqn, v in values.items()}


def ms_writable(value: Any) -> bool:
    return type(value) in (str, int, float, bool)


def read_pt(out: Path) -> tuple[dict, dict]:
    """torch.load, weights_only, plain and memory-mapped: both must give the same."""
    plain = torch.load(out, weights_only=True)
    mapped = torch.load(out, weights_only=True, mmap=True)
    assert type(plain) is dict and set(plain) == set(mapped)
    tensors = {k: tensor_key(v) for k, v in plain.items() if isinstance(v, torch.Tensor)}
    assert tensors == {k: tensor_key(v) for k, v in mapped.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in plain.items() if not isinstance(v, torch.Tensor)}
    return tensors, values


def read_ckpt(out: Path) -> tuple[dict, dict]:
    """mindspore.load_checkpoint: Parameters and str values."""
    import mindspore as ms

    loaded = ms.load_checkpoint(str(out))
    tensors = {k: ms_tensor_key(v) for k, v in loaded.items() if not isinstance(v, str)}
    values = {k: v for k, v in loaded.items() if isinstance(v, str)}
    return tensors, values


def read_safetensors(out: Path) -> tuple[dict, dict]:
    tensors = {k: tensor_key(v) for k, v in load_file(str(out)).items()}
    side = out.with_name(out.name.removesuffix(".safetensors") + ".values.json")
    return tensors, json.loads(side.read_text()) if side.exists() else {}


def read_hf(out: Path) -> tuple[dict, dict]:
    document = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = document["weight_map"]
    tensors: dict[str, tuple] = {}
    total = 0
    for shard in sorted(set(weight_map.values())):
        loaded = load_file(str(out / shard))
        assert {k for k, f in weight_map.items() if f == shard} == set(loaded), shard
        for k, v in loaded.items():
            tensors[k] = tensor_key(v)
            total += v.numel() * v.element_size()
    assert document["metadata"]["total_size"] == total
    side = out / "values.json"
    return tensors, json.loads(side.read_text()) if side.exists() else {}


def read_hp(out: Path) -> tuple[dict, dict]:
    """hpckpt's own reader (the format itself is checked by `check_hp_format`)."""
    index = open_index(out)
    assert index.format == "hyperparallel"
    with OpenFiles() as files:
        tensors = {fqn: np_key(read_box(index, e, files=files), e.dtype.name) for fqn, e in index.tensors.items()}
    return tensors, {fqn: index.decode_value(fqn) for fqn in index.values}


def check_hp_format(out: Path, want: dict[str, torch.Tensor], framework: str) -> Any:
    """The output is a HyperParallel DCP checkpoint: `.metadata` is a pickle of HyperParallel's own
    classes (loaded by the stock unpickler into stand-ins), every chunk is a real safetensors entry
    holding exactly its box of the full tensor, dtype strings and file metadata are `framework`'s,
    and `hpckpt verify` finds nothing. Returns the metadata."""
    with hp_modules():
        metadata = pickle.loads((out / ".metadata").read_bytes())
    assert type(metadata).__module__ == HP_META and type(metadata).__name__ == "Metadata"
    storage = metadata.storage_data
    assert all(type(k).__module__ == HP_META and type(v).__module__ == HP_STORAGE for k, v in storage.items())
    tensors = {fqn: m for fqn, m in metadata.state_dict_metadata.items() if type(m).__name__ == "TensorStorageMetadata"}
    assert set(tensors) == set(want)
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, meta in tensors.items():
        tensor = want[fqn]
        spelling = str(tensor.dtype) if framework == "torch" else TORCH_DTYPE_NAMES[str(tensor.dtype).removeprefix("torch.")]
        assert meta.properties.dtype == spelling, (fqn, meta.properties.dtype)
        assert tuple(meta.size) == tuple(tensor.shape), fqn
        for position, chunk in enumerate(meta.chunks):
            (key, info), = [(k, v) for k, v in storage.items() if k.fqn == fqn and tuple(k.offset) == tuple(chunk.offsets)]
            assert key.index == position, (fqn, key)
            if info.relative_path not in loaded:
                loaded[info.relative_path] = load_file(str(out / info.relative_path))
            stored = loaded[info.relative_path][info.tensor_key]
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            assert tensor_key(stored) == tensor_key(tensor[region].contiguous()), (fqn, chunk)
    for name in loaded:
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata() == ({"format": "ms"} if framework == "mindspore" else None), name
    report = api.verify(out)
    assert report["exit_code"] == 0, report["findings"]
    return metadata


def read_torch_dcp(out: Path, want: dict[str, torch.Tensor], value_names, tmp: Path) -> tuple[dict, dict]:
    """torch's own readers: `dcp.load` into full tensors of the expected shapes and dtypes, and
    `dcp_to_torch_save` (whose nesting follows the metadata's planner_data): both must agree."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state: dict[str, Any] = {fqn: torch.full(t.shape, 7, dtype=t.dtype) if t.numel() else torch.empty(t.shape, dtype=t.dtype)
                             for fqn, t in want.items()}
    state.update({fqn: None for fqn in value_names})
    dcp.load(state, checkpoint_id=out, no_dist=True)
    tensors = {k: tensor_key(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}

    full_file = tmp / f"{out.name}.full.pt"
    dcp_to_torch_save(out, full_file)
    full = torch.load(full_file, weights_only=True)
    paths = FileSystemReader(str(out)).read_metadata().planner_data
    for fqn in [*want, *value_names]:
        node = full
        for part in paths.get(fqn, (fqn,)):
            node = node[part]
        if isinstance(node, torch.Tensor):
            assert tensor_key(node) == tensors[fqn], f"dcp_to_torch_save: {fqn}"
        else:
            assert type(node) is type(values[fqn]) and node == values[fqn], f"dcp_to_torch_save: {fqn}"
    full_file.unlink()
    return tensors, values


def check_output(target: str, out: Path, tensors: dict[str, torch.Tensor], values: dict[str, Any],
                 report: dict, tmp: Path, framework: str = "torch") -> None:
    """`out` holds exactly `tensors` (bit-exact) and `values`, as far as `target` can hold them."""
    what = f"{target} {out.name}"
    if target == "pt":
        got, got_values = read_pt(out)
        assert_tensors(got, tensors, what)
        assert_python_values(got_values, values, what)
    elif target == "ms":
        got, got_values = read_ckpt(out)
        kept_tensors = {k: t for k, t in tensors.items() if t.numel()}
        scalars = {k: v for k, v in values.items() if ms_writable(v) and not isinstance(v, str)}
        strings = {k: v for k, v in values.items() if isinstance(v, str)}
        assert_tensors({k: v for k, v in got.items() if k not in scalars}, kept_tensors, what)
        assert got_values == strings
        # str/int/float/bool become `str` entries and 0-d tensors, as MindSpore's append_dict saves them
        for k, v in scalars.items():
            want_dtype = {bool: "bool", int: "int64", float: "float32"}[type(v)]
            assert got[k][:2] == (want_dtype, ()), (k, got[k][:2])
            assert got[k][2] == np.array(v, dtype=np.dtype(want_dtype)).tobytes(), k
        skipped = sorted([k for k, t in tensors.items() if not t.numel()] +
                         [k for k, v in values.items() if not ms_writable(v)])
        assert sorted(s["name"] for s in report["skipped"]) == skipped
        assert all(s["reason"] for s in report["skipped"])
    elif target in ("safetensors", "hf"):
        got, document = read_safetensors(out) if target == "safetensors" else read_hf(out)
        assert_tensors(got, tensors, what)
        assert document == values_document(values)
    elif target == "hp":
        got, got_values = read_hp(out)
        assert_tensors(got, tensors, what)
        assert_python_values(got_values, values, what)
        check_hp_format(out, tensors, framework)
    elif target == "torch-dcp":
        got, got_values = read_torch_dcp(out, tensors, list(values), tmp)
        assert_tensors(got, tensors, what)
        assert_python_values(got_values, values, what)
    else:
        raise AssertionError(target)


def read_tensors(target: str, out: Path, want: dict[str, torch.Tensor], tmp: Path) -> dict[str, tuple]:
    """Only the tensors of an output, by its real consumer (`want` gives torch-dcp's shapes)."""
    if target == "pt":
        return read_pt(out)[0]
    if target == "ms":
        return read_ckpt(out)[0]
    if target == "safetensors":
        return read_safetensors(out)[0]
    if target == "hf":
        return read_hf(out)[0]
    if target == "hp":
        return read_hp(out)[0]
    return read_torch_dcp(out, want, [], tmp)[0]


def torch_from_key(key: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    name, shape, raw = key
    dtype = getattr(torch, name)
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    paths = sorted(path.rglob("*")) if path.is_dir() else [path]
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths if p.is_file()}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "partial" in p.name or "hpckpt-tmp" in p.name)


# --------------------------------------------------------------------------------------------
# 1. every fixture into every target


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_to_every_target(name, target, tmp_path):
    fixture = FIXTURES / name
    before = snapshot(fixture)
    out = tmp_path / OUT_NAME[target]
    report = api.convert(fixture, out, target, max_shard_size="64B")
    want = load_file(str(fixture / "expected.safetensors"))
    values = fixture_values(fixture)
    framework = "mindspore" if "mindspore" in name else "torch"
    check_output(target, out, want, values, report, tmp_path, framework=framework)
    # One format vocabulary: the report names the format as inspect does (`--to pt` is torch-save).
    assert report["format"] == format_named(target).name and report["source_format"].startswith("hyperparallel")
    assert report["bytes_written"] == sum(t.numel() * t.element_size() for t in want.values())
    assert snapshot(fixture) == before
    assert leftovers(tmp_path) == []
    if target == "hf":
        assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == len(want)
        assert len(list(out.glob("model-*.safetensors"))) > 1  # 64 B shards: really sharded


@pytest.mark.parametrize("target", ["hp", "torch-dcp"])
def test_default_layout_is_the_sources(target, tmp_path):
    """Without layout options an hp / torch-dcp output keeps the source's layout: every regularly
    sharded tensor has the same chunk boxes as in the source (the ragged one cannot be kept)."""
    from hpckpt.core.geometry.layout import infer

    fixture = FIXTURES / "m0-torch-4rank"
    out = tmp_path / target
    api.convert(fixture, out, target)
    source = open_index(fixture)
    boxes = boxes_of_hp(out) if target == "hp" else boxes_of_torch_dcp(out)
    differ = {}
    for fqn, entry in source.tensors.items():
        found = infer(entry.shape, (c.box for c in entry.chunks), source.world_size)
        if found is None or found.kind == "irregular":
            continue
        want = sorted({(c.box.offsets, c.box.sizes) for c in entry.chunks if not c.box.is_empty})
        got = sorted({b for b in boxes[fqn] if 0 not in b[1] or not b[1]})
        if got != want:
            differ[fqn] = (want, got)
    assert not differ, (
        "the default layout is not the source's (api._source_layout uses keep_layout_spec on a 1-D mesh "
        "of world_size, which drops the number of parts and all but the last split dim): "
        + "; ".join(f"{fqn}: source {w} -> {target} {g}" for fqn, (w, g) in differ.items()))


# --------------------------------------------------------------------------------------------
# 2. dtype strings of an hp output: --framework


@pytest.mark.parametrize("framework", [None, "torch", "mindspore"])
def test_hp_framework_dtype_strings(framework, tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    out = tmp_path / "hp"
    args = ["convert", fixture, "-o", out, "--to", "hp"] + (["--framework", framework] if framework else [])
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    want = load_file(str(fixture / "expected.safetensors"))
    metadata = check_hp_format(out, want, framework or "torch")
    spellings = {m.properties.dtype for m in metadata.state_dict_metadata.values() if hasattr(m, "properties")}
    if framework == "mindspore":
        assert spellings == {"Float32", "BFloat16", "Int64"}
    else:
        assert spellings == {"torch.float32", "torch.bfloat16", "torch.int64"}
    got, got_values = read_hp(out)
    assert_tensors(got, want, "hp")
    assert_python_values(got_values, fixture_values(fixture), "hp")


def test_mindspore_fixture_to_torch_hp(tmp_path):
    fixture = FIXTURES / "m0-mindspore-1rank"
    out = tmp_path / "hp"
    result = cli("convert", fixture, "-o", out, "--to", "hp", "--framework", "torch")
    assert result.exit_code == 0, result.stderr
    want = load_file(str(fixture / "expected.safetensors"))
    metadata = check_hp_format(out, want, "torch")
    assert {m.properties.dtype for m in metadata.state_dict_metadata.values() if hasattr(m, "properties")} == \
        {"torch.float32", "torch.bfloat16", "torch.float16", "torch.int64", "torch.int32", "torch.bool"}
    got, got_values = read_hp(out)
    assert_tensors(got, want, "hp")
    assert_python_values(got_values, fixture_values(fixture), "hp")
    # and back to MindSpore's spellings: the same bytes
    back = tmp_path / "hp-ms"
    api.convert(out, back, "hp", framework="mindspore")
    check_hp_format(back, want, "mindspore")


# --------------------------------------------------------------------------------------------
# 3. a PyTorch DCP checkpoint saved by two ranks -> hp -> torch-dcp


_TORCHRUN: dict[str, Any] = {}


def _launch_torchrun(out: Path) -> None:
    """Start the one torchrun job of this file: 2 ranks save DTensors (Shard(0), Shard(1),
    Replicate, an empty shard) with real `dcp.save`."""
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    log = open(out / "torchrun.log", "w+")
    proc = subprocess.Popen(
        [*launcher, "--standalone", "--nproc-per-node", "2", str(DIST_SCRIPT), str(out / "ckpt"), str(out / "reference.pt")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    _TORCHRUN.update(proc=proc, out=out, log=log)


@pytest.fixture(scope="module", autouse=True)
def _torchrun_in_the_background(request, tmp_path_factory):
    """The torchrun job takes ~10 s (two `import torch` on two cores): when a selected test needs
    it, start it with the module's first test so that it runs while the others do."""
    if any("sharded_dcp" in getattr(item, "fixturenames", ()) for item in request.session.items):
        _launch_torchrun(tmp_path_factory.mktemp("dcp_sharded"))
    yield
    proc = _TORCHRUN.pop("proc", None)
    if proc is not None and proc.poll() is None:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)  # only the process group this module started
        proc.wait(timeout=30)
    if "log" in _TORCHRUN:
        _TORCHRUN.pop("log").close()


@pytest.fixture(scope="module")
def sharded_dcp(tmp_path_factory) -> tuple[Path, dict, dict]:
    if "proc" not in _TORCHRUN:
        _launch_torchrun(tmp_path_factory.mktemp("dcp_sharded"))
    proc, out, log = _TORCHRUN["proc"], _TORCHRUN["out"], _TORCHRUN["log"]
    try:
        returncode = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        returncode = None
    log.seek(0)
    assert returncode == 0, f"torchrun failed ({returncode}):\n{log.read()[-6000:]}"
    ref = torch.load(out / "reference.pt", weights_only=True)
    return out / "ckpt", ref["tensors"], {f"extra.{k}": v for k, v in ref["values"].items()}


def boxes_of_torch_dcp(path: Path) -> dict[str, list]:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata()
    return {fqn: sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            for fqn, m in metadata.state_dict_metadata.items() if hasattr(m, "chunks")}


def boxes_of_hp(path: Path) -> dict[str, list]:
    with hp_modules():
        metadata = pickle.loads((path / ".metadata").read_bytes())
    return {fqn: sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            for fqn, m in metadata.state_dict_metadata.items() if hasattr(m, "chunks")}


def filled(boxes: dict[str, list]) -> dict[str, list]:
    """Boxes without the empty ones (which writers may or may not store); 0-d boxes stay."""
    return {fqn: [b for b in bs if not b[1] or 0 not in b[1]] for fqn, bs in boxes.items()}


@pytest.mark.dist
def test_torch_dcp_to_hp_to_torch_dcp(sharded_dcp, tmp_path):
    src, tensors, values = sharded_dcp
    before = snapshot(src)
    hp = tmp_path / "hp"
    report = api.convert(src, hp, "hp")
    assert report["source_format"] == "torch-dcp"
    check_output("hp", hp, tensors, values, report, tmp_path)
    assert open_index(hp).world_size == 2
    back = tmp_path / "dcp"
    report = api.convert(hp, back, "torch-dcp")
    check_output("torch-dcp", back, tensors, values, report, tmp_path)
    assert sorted(p.name for p in back.iterdir()) == [".hpckpt-manifest.jsonl", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    # the round trip keeps torch's own chunking (boxes are stored once, replicas too)
    assert boxes_of_torch_dcp(back) == boxes_of_hp(hp)
    assert filled(boxes_of_torch_dcp(back)) == filled(boxes_of_torch_dcp(src))
    assert snapshot(src) == before


@pytest.mark.dist
def test_torch_dcp_output_keeps_the_hp_chunking(sharded_dcp, tmp_path):
    src, tensors, values = sharded_dcp
    hp = tmp_path / "hp3"
    result = cli("convert", src, "-o", hp, "--to", "hp", "--world-size", "3")
    assert result.exit_code == 0, result.stderr
    check_output("hp", hp, tensors, values, {}, tmp_path)
    out = tmp_path / "dcp3"
    result = cli("convert", hp, "-o", out, "--to", "torch-dcp")
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == [".hpckpt-manifest.jsonl", ".metadata", "__0_0.distcp", "__1_0.distcp",
                                                     "__2_0.distcp"]
    assert boxes_of_torch_dcp(out) == boxes_of_hp(hp)
    assert len(boxes_of_hp(hp)["rows"]) == 3  # 5 rows over 3 ranks: really re-chunked
    check_output("torch-dcp", out, tensors, values, {}, tmp_path)


@pytest.mark.dist
def test_torch_dcp_source_to_file_targets(sharded_dcp, tmp_path):
    src, tensors, values = sharded_dcp
    for target in ("pt", "ms", "safetensors", "torch-dcp"):
        out = tmp_path / OUT_NAME[target]
        report = api.convert(src, out, target)
        check_output(target, out, tensors, values, report, tmp_path)
    assert filled(boxes_of_torch_dcp(tmp_path / OUT_NAME["torch-dcp"])) == filled(boxes_of_torch_dcp(src))


def strided_views() -> dict[str, torch.Tensor]:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {
        "base": base,
        "t": base.t(),  # a permutation: the stored bytes are dense, the order is not row-major
        "cols": base[:, 1:3],
        "row": base[1],
        "t_bf16": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16).t(),
        "t3": torch.arange(24, dtype=torch.int32).reshape(2, 3, 4).permute(2, 0, 1),
    }


@pytest.mark.parametrize("source", ["torch-save", "torch-dcp"])
def test_strided_sources(source, tmp_path):
    """Tensors saved as views (torch.save shares the base's storage; PyTorch DCP writes a
    non-contiguous tensor as it is): converted, each holds the values the view shows."""
    views = strided_views()
    if source == "torch-save":
        src = tmp_path / "views.pt"
        torch.save(views, src)
    else:
        import torch.distributed.checkpoint as dcp

        src = tmp_path / "views-dcp"
        dcp.save(views, checkpoint_id=src, no_dist=True)
    want = {k: v.contiguous() for k, v in views.items()}
    wrong = []
    for target in ("pt", "safetensors", "hp"):
        out = tmp_path / OUT_NAME[target]
        api.convert(src, out, target)
        got = read_tensors(target, out, want, tmp_path)
        wrong += [f"{target}:{k}" for k, w in want.items() if got[k] != tensor_key(w)]
    assert not wrong, (f"values of strided {source} tensors come out in storage order, not in the view's "
                       f"(core/io/read.py _read_strided takes a dense span for C order): {wrong}")


# --------------------------------------------------------------------------------------------
# 4. a torch.save file as the source


def trained_state() -> tuple[dict, dict[str, torch.Tensor], dict[str, Any]]:
    """A real model + AdamW state dict after one step, plain values around it; and the names hpckpt
    must flatten it to (nested dicts joined with '.', everything else whole)."""
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(5, 3, generator=g)).square().sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "bf": torch.randn(3, 2, generator=g).to(torch.bfloat16),
        "epoch": 3,
        "lr": 0.5,
        "name": "run-7",
        "flag": True,
        "sched": {"milestones": [10, 20], "gamma": 0.1},
    }
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, per_param in optimizer.state_dict()["state"].items():
        tensors.update({f"optim.state.{i}.{k}": v for k, v in per_param.items()})
    tensors["bf"] = state["bf"]
    values = {"optim.param_groups": optimizer.state_dict()["param_groups"], "epoch": 3, "lr": 0.5,
              "name": "run-7", "flag": True, "sched.milestones": [10, 20], "sched.gamma": 0.1}
    return state, tensors, values


@pytest.fixture(scope="module")
def torch_save_source(tmp_path_factory) -> tuple[Path, dict, dict]:
    state, tensors, values = trained_state()
    path = tmp_path_factory.mktemp("torch_save") / "state.pt"
    torch.save(state, path)
    return path, tensors, values


def test_torch_save_source_names(torch_save_source):
    path, tensors, values = torch_save_source
    index = open_index(path)
    assert index.format == "torch-save"
    assert set(index.tensors) == set(tensors)
    assert "optim.state.0.exp_avg_sq" in index.tensors and "model.2.num_batches_tracked" in index.tensors
    assert set(index.values) == set(values)


@pytest.mark.parametrize("target", TARGETS)
def test_torch_save_source_to_every_target(torch_save_source, target, tmp_path):
    path, tensors, values = torch_save_source
    before = snapshot(path)
    out = tmp_path / OUT_NAME[target]
    report = api.convert(path, out, target)
    assert report["source_format"] == "torch-save"
    check_output(target, out, tensors, values, report, tmp_path)
    assert snapshot(path) == before
    assert leftovers(tmp_path) == []


def test_legacy_torch_save_is_refused_clearly(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2, 3), "step": 4}, legacy, _use_new_zipfile_serialization=False)
    proc = run_hpckpt("convert", legacy, "-o", tmp_path / "out.safetensors")
    assert proc.returncode == 5, (proc.returncode, proc.stderr)
    assert len(error_lines(proc.stderr)) == 1 and "legacy" in error_lines(proc.stderr)[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.safetensors").exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------
# 5. dtypes, bit patterns, 0-d and empty tensors; --dtype


def bits(values, dtype: torch.dtype) -> torch.Tensor:
    raw = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float32: np.uint32}[dtype]
    signed = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    return torch.from_numpy(np.array(values, dtype=raw).view(np.dtype(raw).str.replace("u", "i"))).view(signed).view(dtype)


def dtype_tensors() -> dict[str, torch.Tensor]:
    """Awkward bit patterns (NaN payloads, signalling NaNs, denormals, -0, inf) in every dtype."""
    g = torch.Generator().manual_seed(11)
    return {
        "bf16.bits": bits([0x0000, 0x8000, 0x0001, 0x807F, 0x3F80, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFA5,
                           0x7F81, 0x4049], torch.bfloat16).reshape(3, 4),
        "fp16.bits": bits([0x0001, 0x8001, 0x03FF, 0x7C00, 0x7E01, 0x7D55, 0x3C00, 0xFBFF], torch.float16),
        "fp32.bits": bits([0x00000001, 0x807FFFFF, 0x7FC00001, 0x7F800001, 0xFFC12345, 0x3F800000],
                          torch.float32).reshape(2, 3),
        "fp32.ties": bits([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x80400000],
                          torch.float32),  # round-half-even cases for the bf16 cast
        "fp64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "int8": torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8),
        "uint8": torch.tensor([0, 1, 254, 255], dtype=torch.uint8),
        "int16": torch.tensor([-32768, 5, 32767], dtype=torch.int16),
        "int32": torch.tensor([[-2**31, 7], [0, 2**31 - 1]], dtype=torch.int32),
        "int64": torch.tensor([-2**63, -1, 2**63 - 1], dtype=torch.int64),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar.fp32": torch.tensor(2.5),
        "scalar.int64": torch.tensor(-9, dtype=torch.int64),
        "scalar.bf16": bits(0x7FC3, torch.bfloat16),
        "scalar.bool": torch.tensor(True),
        "empty.fp32": torch.empty(0, 3),
        "empty.int64": torch.empty(0, dtype=torch.int64),
        "empty.bf16": torch.empty(2, 0, dtype=torch.bfloat16),
        "big.bf16": torch.randn(64, 33, generator=g).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def dtype_source(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = dtype_tensors()
    path = tmp_path_factory.mktemp("dtypes") / "dtypes.pt"
    torch.save(tensors, path)
    return path, tensors


@pytest.mark.parametrize("target", ["pt", "ms", "safetensors"])
def test_dtypes_copied_raw(dtype_source, target, tmp_path):
    path, tensors = dtype_source
    out = tmp_path / OUT_NAME[target]
    report = api.convert(path, out, target)
    check_output(target, out, tensors, {}, report, tmp_path)
    if target == "ms":
        assert [s["name"] for s in report["skipped"]] == ["empty.bf16", "empty.fp32", "empty.int64"]


@pytest.mark.parametrize("target", TARGETS)
def test_dtype_cast_to_bf16(dtype_source, target, tmp_path):
    """--dtype bf16 casts floating tensors (round to nearest even, as torch's .to(): ties, denormals,
    overflow to inf); integers and bools keep their dtype and bits; NaNs stay NaN."""
    path, tensors = dtype_source
    out = tmp_path / OUT_NAME[target]
    result = cli("convert", path, "-o", out, "--to", target, "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    want = {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in tensors.items()}
    nans = {k: torch.isnan(t.float()) if t.is_floating_point() else None for k, t in tensors.items()}
    if target == "ms":
        assert [s["name"] for s in report["skipped"]] == ["empty.bf16", "empty.fp32", "empty.int64"]
        want = {k: w for k, w in want.items() if w.numel()}
    got = {k: torch_from_key(v) for k, v in read_tensors(target, out, want, tmp_path).items()}
    assert set(got) == set(want)
    nan = torch.tensor(float("nan"), dtype=torch.bfloat16)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype)
        if nans[k] is not None:
            # the bits of a NaN after a cast are the converter's choice (torch itself gives 0x7FC0
            # or 0xFFFF depending on the code path): NaN where the source had NaN, then bit-exact
            assert torch.equal(torch.isnan(g.float()), nans[k]), k
            g, w = torch.where(nans[k], nan, g), torch.where(nans[k], nan, w)
        assert torch_bytes(g) == torch_bytes(w), k


def test_bf16_values_survive_every_target_raw(dtype_source, tmp_path):
    """NaN payloads and denormals in bf16 through hp and torch-dcp too (no cast: raw copy)."""
    path, tensors = dtype_source
    subset = {k: t for k, t in tensors.items() if k.startswith(("bf16", "fp16", "fp32", "scalar"))}
    for target in ("hp", "torch-dcp", "hf"):
        out = tmp_path / OUT_NAME[target]
        report = api.convert(path, out, target, select=api.Selection.of(["bf16*", "fp16*", "fp32*", "scalar*"]))
        check_output(target, out, subset, {}, report, tmp_path)


# --------------------------------------------------------------------------------------------
# zero-element tensors and unwritable values in a .ckpt: reported


def test_ckpt_reports_what_it_leaves_out(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2, 2), "empty": torch.empty(0, 4), "name": "x", "cfg": {"ids": [1, 2]},
                "pair": (1, 2)}, src)
    out = tmp_path / "out.ckpt"
    proc = run_hpckpt("convert", src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3, proc.stderr  # one line per reason: zero elements, a list, a tuple
    for name in ("empty", "cfg.ids", "pair"):
        assert sum(name in line for line in warnings) == 1, (name, warnings)
    assert all(line.startswith("warning: not written (") for line in warnings), warnings
    got, strings = read_ckpt(out)
    assert set(got) == {"w"} and strings == {"name": "x"}
    # the same through --json: the list in the report (and the warning on stderr)
    result = cli("convert", src, "-o", tmp_path / "again.ckpt", "--json")
    assert result.exit_code == 0, result.stderr
    assert [s["name"] for s in json.loads(result.stdout)["skipped"]] == ["cfg.ids", "empty", "pair"]


@pytest.fixture(scope="module")
def mindspore_ckpt(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    """A .ckpt written by MindSpore itself (CRC trailer; bf16, fp16, int32, bool, 0-d; an int and a
    str appended), and its content as MindSpore's own loader sees it."""
    import mindspore as ms

    arrays = {"net.w": np.arange(12, dtype=np.float32).reshape(3, 4) / 3, "net.ids": np.arange(-3, 3, dtype=np.int32),
              "net.h": np.linspace(-1, 1, 5).astype(np.float16), "net.flag": np.array([True, False, True]),
              "net.scale": np.array(0.5, dtype=np.float32)}
    params = [{"name": k, "data": ms.Tensor(v)} for k, v in arrays.items()]
    params.append({"name": "net.bf", "data": ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3) / 7, ms.bfloat16)})
    path = tmp_path_factory.mktemp("ckpt") / "net.ckpt"
    ms.save_checkpoint(params, str(path), crc_check=True, append_dict={"tag": "v1", "epoch": 5})
    tensors, strings = read_ckpt(path)
    assert set(tensors) == {*arrays, "net.bf", "epoch"} and strings == {"tag": "v1"}
    return path, {k: torch_from_key(v) for k, v in tensors.items()}, strings


@pytest.mark.parametrize("target", TARGETS)
def test_mindspore_ckpt_source_to_every_target(mindspore_ckpt, target, tmp_path):
    path, tensors, values = mindspore_ckpt
    before = snapshot(path)
    out = tmp_path / OUT_NAME[target]
    report = api.convert(path, out, target)
    assert report["source_format"] == "mindspore-ckpt"
    check_output(target, out, tensors, values, report, tmp_path, framework="mindspore")
    assert snapshot(path) == before


def test_ckpt_crc_round_trip_through_mindspore(mindspore_ckpt, tmp_path):
    """.ckpt -> pt -> .ckpt --crc: MindSpore's loader checks our CRC and sees the same content."""
    import mindspore as ms

    path, _tensors, _values = mindspore_ckpt
    original = read_ckpt(path)
    pt = tmp_path / "net.pt"
    api.convert(path, pt, "pt")
    back = tmp_path / "back.ckpt"
    result = cli("convert", pt, "-o", back, "--crc")
    assert result.exit_code == 0, result.stderr
    assert back.read_bytes()[-17:-10] == b"crc_num"  # MindSpore's trailer: the mark + 10-byte CRC
    loaded = ms.load_checkpoint(str(back), crc_check=True)
    assert {k: ms_tensor_key(v) for k, v in loaded.items() if not isinstance(v, str)} == original[0]
    assert {k: v for k, v in loaded.items() if isinstance(v, str)} == original[1]
    tampered = tmp_path / "tampered.ckpt"
    data = bytearray(back.read_bytes())
    data[40] ^= 0xFF
    tampered.write_bytes(bytes(data))
    with pytest.raises(Exception):  # MindSpore refuses it: our trailer really is a CRC of the content
        ms.load_checkpoint(str(tampered), crc_check=True)


# --------------------------------------------------------------------------------------------
# 6. bad input on the command line


def test_unknown_source_lists_what_is_recognised(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a checkpoint at all\n" * 10)
    proc = run_hpckpt("convert", junk, "-o", tmp_path / "out.pt")
    assert proc.returncode in (4, 5), (proc.returncode, proc.stderr)
    assert len(error_lines(proc.stderr)) == 1 and "Traceback" not in proc.stderr
    for fmt in ("hyperparallel", "torch-dcp", "mindspore-ckpt", "safetensors", "torch-save"):
        assert fmt in proc.stderr, (fmt, proc.stderr)
    assert not (tmp_path / "out.pt").exists()

    unknown = tmp_path / "foreign"
    unknown.mkdir()
    (unknown / ".metadata").write_bytes(pickle.dumps({"some": "other format"}, protocol=4))
    proc = run_hpckpt("convert", unknown, "-o", tmp_path / "out2.pt")
    assert proc.returncode == 5, (proc.returncode, proc.stderr)
    assert "torch-save" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("target", TARGETS)
def test_existing_destination(target, tmp_path):
    fixture = FIXTURES / "m0-mindspore-1rank"
    out = tmp_path / OUT_NAME[target]
    if target in ("hf", "hp", "torch-dcp"):
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    else:
        out.write_text("mine")
    before = snapshot(out)
    result = cli("convert", fixture, "-o", out, "--to", target)
    assert result.exit_code == 14, (result.exit_code, result.stderr)
    assert snapshot(out) == before
    with pytest.raises(DestinationExistsError):
        api.convert(fixture, out, target)
    if target != "safetensors":  # (a .safetensors name is sniffed as safetensors: --force replaces it)
        refused = cli("convert", fixture, "-o", out, "--to", target, "--force")
        assert refused.exit_code == 16 and "refusing to replace" in refused.stderr, refused.stderr
        assert snapshot(out) == before
        ours = tmp_path / f"ours-{out.name}"  # --force replaces an output of hpckpt's
        api.convert(fixture, ours, target)
        shutil.copytree(ours, out, dirs_exist_ok=True) if out.is_dir() else os.replace(ours, out)
        if out.is_dir():  # the checkpoint and a file that is not its: refused, the file kept
            refused = cli("convert", fixture, "-o", out, "--to", target, "--force")
            assert refused.exit_code == 16 and "keep.txt is not part of its checkpoint" in refused.stderr, refused.stderr
            assert (out / "keep.txt").read_text() == "mine"
            (out / "keep.txt").unlink()
    result = cli("convert", fixture, "-o", out, "--to", target, "--force")
    assert result.exit_code == 0, result.stderr
    assert not (out.is_dir() and (out / "keep.txt").exists())
    assert leftovers(tmp_path) == []


def test_existing_destination_console(tmp_path):
    out = tmp_path / "model.pt"
    out.write_text("mine")
    proc = run_hpckpt("convert", FIXTURES / "m0-mindspore-1rank", "-o", out)
    assert proc.returncode == 14 and len(error_lines(proc.stderr)) == 1, proc.stderr
    assert out.read_text() == "mine"


def test_name_collision_names_both_sources(torch_save_source, tmp_path):
    path, _tensors, _values = torch_save_source
    rules = tmp_path / "rules.toml"
    rules.write_text("preset = \"none\"\n\n[[rule]]\nmatch = 'model\\.0\\.(weight|bias)'\nrename = 'model.0.param'\n")
    out = tmp_path / "out.pt"
    proc = run_hpckpt("convert", path, "-o", out, "--names", rules)
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.0.weight" in lines[0] and "model.0.bias" in lines[0] and "model.0.param" in lines[0], lines
    assert not out.exists() and leftovers(tmp_path) == []


def test_encrypted_ckpt_is_refused(tmp_path):
    import mindspore as ms

    src = tmp_path / "secret.ckpt"
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(np.ones((2, 3), np.float32))}], str(src),
                       enc_key=b"0123456789abcdef")
    out = tmp_path / "out.pt"
    proc = run_hpckpt("convert", src, "-o", out)
    assert proc.returncode == 5, (proc.returncode, proc.stderr)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "encrypted" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("target", TARGETS)
def test_failed_conversion_leaves_no_destination(target, tmp_path):
    """The last rank file is cut short in its data (its header is whole, so the index opens and
    the failure comes in the middle of writing): no destination, no temporary files."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "m0-torch-4rank", src, copy_function=shutil.copyfile)
    data = src / "_rank3_.safetensors"
    data.write_bytes(data.read_bytes()[:-40])
    open_index(src)  # the premise: the metadata still reads
    work = tmp_path / "work"
    work.mkdir()
    out = work / OUT_NAME[target]
    with pytest.raises(CorruptDataError, match="_rank3_"):
        api.convert(src, out, target)
    assert not out.exists()
    assert sorted(p.name for p in work.iterdir()) == []
    if target == "pt":  # and on the command line: one error line, exit 9, nothing left
        proc = run_hpckpt("convert", src, "-o", out)
        assert proc.returncode == 9 and len(error_lines(proc.stderr)) == 1, proc.stderr
        assert sorted(p.name for p in work.iterdir()) == []


# --------------------------------------------------------------------------------------------
# 7. --dry-run and --json


def test_dry_run_writes_nothing(torch_save_source, tmp_path):
    path, _tensors, _values = torch_save_source
    rules = tmp_path / "rules.toml"
    rules.write_text("[[rule]]\nmatch = 'model\\.0\\.weight'\nrename = 'proj.weight'\ntranspose = [1, 0]\n")
    for target in TARGETS:
        out = tmp_path / "out" / OUT_NAME[target]
        result = cli("convert", path, "-o", out, "--to", target, "--names", rules, "--dry-run")
        assert result.exit_code == 0, result.stderr
        assert "nothing written" in result.stdout
        table = result.stdout.splitlines()
        assert table[0].split() == ["SOURCE", "DESTINATION", "TRANSFORM", "RULE"]
        row = next(line for line in table if line.startswith("model.0.weight "))
        assert "proj.weight" in row and "transpose[1, 0]" in row
        assert not (tmp_path / "out").exists()
    result = cli("convert", path, "-o", tmp_path / "plain.pt", "--dry-run")
    assert result.exit_code == 0 and "nothing written" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rules.toml"]


def test_json_output_parses(torch_save_source, tmp_path):
    path, tensors, _values = torch_save_source
    result = cli("convert", path, "-o", tmp_path / "m.safetensors", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["command"] == "convert" and report["format"] == "safetensors"
    assert report["source_format"] == "torch-save" and not report.get("dry_run")
    assert report["bytes_written"] == sum(t.numel() * t.element_size() for t in tensors.values())
    rules = tmp_path / "rules.toml"
    rules.write_text("preset = \"none\"\n[[rule]]\nmatch = 'bf'\nrename = 'bf16.weight'\n")
    result = cli("convert", path, "-o", tmp_path / "d.pt", "--names", rules, "--dry-run", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and not (tmp_path / "d.pt").exists()
    entries = {e["source"]: e for e in report["names"]["entries"]}
    assert entries["bf"]["destination"] == "bf16.weight"
    proc = run_hpckpt("convert", path, "-o", tmp_path / "c.ckpt", "--json")  # the console: JSON alone on stdout
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["format"] == "mindspore-ckpt"  # the one vocabulary: what inspect says


def test_include_exclude(torch_save_source, tmp_path):
    path, tensors, values = torch_save_source
    out = tmp_path / "sel.pt"
    result = cli("convert", path, "-o", out, "--include", "model.*", "--include", "optim.*", "--include", "epoch",
                 "--exclude", "*.bias", "--exclude", "optim.state.*.step")
    assert result.exit_code == 0, result.stderr
    want = {k: t for k, t in tensors.items()
            if k.startswith(("model.", "optim.")) and not k.endswith(".bias") and not re.fullmatch(r"optim\.state\.\d+\.step", k)}
    assert "model.0.weight" in want and "model.2.running_mean" in want
    got, got_values = read_pt(out)
    assert_tensors(got, want, "pt")
    assert_python_values(got_values, {"epoch": 3, "optim.param_groups": values["optim.param_groups"]}, "pt")


# --------------------------------------------------------------------------------------------
# 8. transposed views: rules with `transpose`


TRANSPOSE_RULES = """preset = "none"

[[rule]]
match = 'model\\.embed_tokens\\.weight'
rename = 'model.embed_tokens.weight_t'
transpose = [1, 0]

[[rule]]
match = 'model\\.layers\\.0\\.mlp\\.down_proj\\.weight'
transpose = [1, 0]
"""


@pytest.mark.parametrize("target", ["pt", "safetensors", "hp", "torch-dcp", "ms"])
def test_transposed_fixture_tensor(target, tmp_path):
    """A row-sharded (4 ranks) float32 and a bf16 matrix, transposed on the way."""
    fixture = FIXTURES / "m0-torch-4rank"
    rules = tmp_path / "rules.toml"
    rules.write_text(TRANSPOSE_RULES)
    out = tmp_path / OUT_NAME[target]
    result = cli("convert", fixture, "-o", out, "--to", target, "--names", rules, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    want = load_file(str(fixture / "expected.safetensors"))
    want["model.embed_tokens.weight_t"] = want.pop("model.embed_tokens.weight").t().contiguous()
    want["model.layers.0.mlp.down_proj.weight"] = want["model.layers.0.mlp.down_proj.weight"].t().contiguous()
    assert want["model.embed_tokens.weight_t"].shape == (4, 12)
    check_output(target, out, want, fixture_values(fixture), report, tmp_path)
    if target == "hp":  # the layout follows the view: rows were split, now columns are
        boxes = boxes_of_hp(out)["model.embed_tokens.weight_t"]
        assert boxes == [((0, 0), (4, 3)), ((0, 3), (4, 3)), ((0, 6), (4, 3)), ((0, 9), (4, 3))]


@pytest.mark.parametrize("target", ["pt", "safetensors", "hp"])
def test_transposed_torch_save_tensor(torch_save_source, target, tmp_path):
    path, tensors, values = torch_save_source
    rules = tmp_path / "rules.toml"
    rules.write_text("[[rule]]\nmatch = 'model\\.0\\.weight'\ntranspose = [1, 0]\n\n"
                     "[[rule]]\nmatch = 'bf'\nrename = 'bf_t'\ntranspose = [1, 0]\n")
    out = tmp_path / OUT_NAME[target]
    result = cli("convert", path, "-o", out, "--to", target, "--names", rules)
    assert result.exit_code == 0, result.stderr
    want = dict(tensors)
    want["model.0.weight"] = tensors["model.0.weight"].t().contiguous()
    want["bf_t"] = want.pop("bf").t().contiguous()
    assert want["model.0.weight"].shape == (3, 4)
    check_output(target, out, want, values, {}, tmp_path)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_transpose_every_matrix_of_every_fixture(name, tmp_path):
    """Every 2-D tensor of every fixture transposed (row, column, 2-D-mesh, ragged and legacy
    torch.save chunks), into a torch.save file."""
    from hpckpt.converters.naming import parse_rules

    fixture = FIXTURES / name
    want = load_file(str(fixture / "expected.safetensors"))
    matrices = [k for k, t in want.items() if t.ndim == 2]
    rules = parse_rules('preset = "none"\n' + "".join(
        f"[[rule]]\nmatch = '{re.escape(k)}'\ntranspose = [1, 0]\n" for k in matrices))
    out = tmp_path / "model.pt"
    report = api.convert(fixture, out, "pt", rules=rules)
    want.update({k: want[k].t().contiguous() for k in matrices})
    check_output("pt", out, want, fixture_values(fixture), report, tmp_path)


def test_name_reports_count_only_the_selected_entries_and_name_every_ambiguity(tmp_path):
    """With --include, the name report counts the entries asked for (not "N unmapped" of the ones
    left out); an ambiguous name is a warning in a real run, not only in --dry-run; `diff --names`
    with a glob in A's names compares B's entries that A's selected ones are renamed to."""
    from safetensors.numpy import save_file

    src = tmp_path / "model.safetensors"
    rng = np.random.default_rng(3)
    save_file({"ln_f.weight": rng.standard_normal(4).astype(np.float32),
               "ln_f.bias": rng.standard_normal(4).astype(np.float32),
               "tok_embeddings.weight": rng.standard_normal((10, 4)).astype(np.float32),
               "lm_head.weight": rng.standard_normal((10, 4)).astype(np.float32),
               "layers.0.attn.bias": rng.standard_normal(4).astype(np.float32)}, str(src))
    cli = CliRunner()
    out = cli.invoke(app, ["convert", str(src), "-o", str(tmp_path / "a.ckpt"), "--names", "torch-to-ms",
                           "--include", "ln_f.*", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert sorted(e["source"] for e in doc["names"]["entries"]) == ["ln_f.bias", "ln_f.weight"]
    assert doc["names"]["unmapped"] == [] and doc["names"]["ambiguous"] == {}
    assert doc["names"]["table"][-1].startswith("2 source names: 2 renamed, 0 not written, 0 unmapped (kept), "
                                                "0 ambiguous"), doc["names"]
    out = cli.invoke(app, ["convert", str(src), "-o", str(tmp_path / "all.ckpt"), "--names", "torch-to-ms"])
    assert out.exit_code == 0, out.output
    assert "warning: ambiguous name lm_head.weight:" in out.stderr, out.stderr
    # diff: '*.weight' is in A's (torch) names; B holds ln_f.gamma, which A's ln_f.weight becomes
    out = cli.invoke(app, ["diff", str(src), str(tmp_path / "all.ckpt"), "--names", "torch-to-ms",
                           "--include", "*.weight", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["only_a"] == [] and doc["only_b"] == [] and doc["equal"] is True, doc
    assert sorted(t["name"] for t in doc["tensors"]) == ["lm_head.weight", "ln_f.gamma", "tok_embeddings.embedding_table"]


@pytest.mark.parametrize("manifest", [True, False], ids=["hashed", "no-manifest"])
def test_pt_crcs_are_taken_as_the_bytes_are_written(manifest, tmp_path):
    """Each zip member's CRC-32 comes from the copy itself (no read-back): a mapped source range
    (5 MiB), the piece buffer (small), gathered tiles (cast to bf16), an empty member; with and
    without the manifest's hashing. `testzip`, torch (mmap) and hpckpt reading the output back as
    a source (it checks every storage's CRC) agree with the source."""
    from safetensors.numpy import save_file

    from hpckpt.core.io.write import WriteSettings

    rng = np.random.default_rng(5)
    arrays = {"big": rng.standard_normal((1280, 1024)).astype(np.float32),
              "small": np.arange(1000, dtype=np.int32), "empty": np.zeros((0, 3), np.float32)}
    src = tmp_path / "src.safetensors"
    save_file(arrays, str(src))
    settings = WriteSettings(manifest=manifest)
    api.convert(src, tmp_path / "same.pt", settings=settings)
    api.convert(src, tmp_path / "cast.pt", dtype="bf16", settings=settings)
    api.convert(tmp_path / "cast.pt", tmp_path / "again.pt", settings=settings)
    for name in ("same.pt", "cast.pt", "again.pt"):
        with zipfile.ZipFile(tmp_path / name) as zf:
            assert zf.testzip() is None, name
    for name, cast in (("same.pt", None), ("cast.pt", torch.bfloat16), ("again.pt", torch.bfloat16)):
        got = torch.load(tmp_path / name, weights_only=True, mmap=True)
        for key, array in arrays.items():
            want = torch.from_numpy(array)
            want = want.to(cast) if cast is not None and want.is_floating_point() else want
            assert torch.equal(got[key], want), (name, key)
