"""`hpckpt reshard`: every fixture onto new world sizes and layouts, read back and cross-checked.

Each output is checked three ways: through hpckpt's reader core against the fixture's ground
truth (`expected.safetensors` / `expected.json`, written by the fixture author without hpckpt),
file by file with the real `safetensors` library (keys, shapes and bytes of every stored box),
and structurally (`hpckpt verify`, HyperParallel's key naming, rank-major chunk lists with
`MetadataIndex.index` = position, the requested layout). Fan-out, round trips, other source
formats (real torch DCP, safetensors, Hugging Face shards), `--plan`, refusing to overwrite and a
SIGKILLed run complete the picture. Most runs call `hpckpt.api` or typer's CliRunner; a few
representative ones use the console script in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import (FIXTURE_NAMES, FIXTURES, MANIFEST, RUN_FIELDS, as_json_value, assert_bit_equal, expected_tensors, expected_values,
                   manifest_content, torch_bytes, tree_without_manifest)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.converters import open_index
from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
from hpckpt.core import dtypes
from hpckpt.core.errors import CorruptMetadataError, DestinationExistsError, MissingFileError
from hpckpt.core.geometry.layout import LayoutSpec, Mesh, TensorLayout, parse_placements
from hpckpt.core.codecs.hyperparallel_metadata import TensorStorageMetadata
from hpckpt.core.io.read import OpenFiles, read_box
from hpckpt.core.safety.unpickle import loads

runner = CliRunner()
HPCKPT = Path(sys.executable).with_name("hpckpt")
ROUND_TRIP = ["m0-torch-4rank", "legacy-torch-4rank-rankLocal"]  # ragged/empty/nested; no de-dup
FAN_OUT = ["legacy-torch-4rank", "m0-torch-4rank-rankLocal", "m0-mindspore-1rank-noDist"]

RULES_TOML = r"""
mesh = "2x2"
default = "R,S0"

[[rule]]
match = "*.embed*.weight"
placements = "S0,R"

[[rule]]
regex = 'model\.layers\.\d+\.(self_attn|mlp)\..*'
placements = "R,S1"

[[rule]]
match = "*lm_head.weight"
placements = "S1:ceil,S0"

[[rule]]
match = "*norm.weight"
placements = "R,R"

[[rule]]
match = "optimizer.*"
split = "ceil"
placements = "S1,S0"
"""

TARGETS = ("w1", "w3", "w8", "hsdp", "cols", "ceil8", "toml")


def make_spec(kind: str, tmp_path: Path) -> LayoutSpec:
    if kind.startswith("w"):
        return LayoutSpec.for_world_size(int(kind[1:]))
    if kind == "hsdp":
        return LayoutSpec(Mesh((2, 2)), parse_placements("R,S0"))
    if kind == "cols":
        return LayoutSpec(Mesh((4,)), parse_placements("S1"))
    if kind == "ceil8":
        return LayoutSpec.for_world_size(8, "ceil")
    if kind == "toml":
        rules = tmp_path / "rules.toml"
        rules.write_text(RULES_TOML)
        return LayoutSpec.from_toml(rules)
    raise AssertionError(kind)


# --------------------------------------------------------------------------------------------
# helpers


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` (hidden ones included), by relative name."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(path).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}



def rank_of(name: str) -> int:
    match = re.fullmatch(r"_rank(\d+)_\.(safetensors|bytes)", name)
    assert match, name
    return int(match.group(1))


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def read_metadata(path: Path):
    return loads((path / ".metadata").read_bytes(), what=str(path / ".metadata"))


def check_values(index, expected: dict) -> None:
    assert set(index.values) == set(expected)
    for fqn, item in expected.items():
        got = index.decode_value(fqn)
        assert type(got).__name__ == item["type"], f"{fqn}: {type(got).__name__} != {item['type']}"
        assert as_json_value(got) == item["value"], fqn


def check_resharded(out: Path, source: Path, spec: LayoutSpec) -> None:
    """Everything a reshard of fixture `source` onto `spec` must satisfy (see the module docstring)."""
    want = expected_tensors(source)
    want_torch = load_file(str(source / "expected.safetensors"))
    values = expected_values(source)
    source_index = open_index(source)

    # 1. the reader core rebuilds the ground truth, values keep their Python types
    index = open_index(out)
    assert index.format == "hyperparallel"
    assert set(index.tensors) == set(want)
    with OpenFiles() as files:
        for fqn, entry in index.tensors.items():
            assert entry.shape == want[fqn].shape, fqn
            assert_bit_equal(read_box(index, entry, files=files), want[fqn], fqn)
    check_values(index, values)

    # 2. `hpckpt verify` is clean
    result = cli("verify", out)
    assert result.exit_code == 0, result.stdout + result.stderr

    # 3. metadata: the requested layout, rank-major chunk lists, index = position, dtype spelling
    metadata = read_metadata(out)
    storage = metadata.storage_data
    framework = source_index.framework
    by_file: dict[str, list[tuple[str, tuple, tuple, str]]] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        shape = tuple(item.size)
        boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks]
        layout: TensorLayout = spec.resolve(fqn, shape)
        assert sorted(boxes) == sorted((b.offsets, b.sizes) for b in layout.unique_boxes(shape)), fqn
        assert item.properties.dtype == source_index.tensors[fqn].dtype_spelling, fqn
        entries = {key.offset: (key, info) for key, info in storage.items() if key.fqn == fqn}
        assert len(entries) == len(boxes), f"{fqn}: {len(boxes)} chunks, {len(entries)} storage entries"
        ranks = []
        for position, (offsets, sizes) in enumerate(boxes):
            key, info = entries[offsets]
            assert key.index == position, (fqn, key)
            ranks.append(rank_of(info.relative_path))
            by_file.setdefault(info.relative_path, []).append((fqn, offsets, sizes, info.tensor_key))
        assert ranks == sorted(ranks), f"{fqn}: chunks not rank-major: {ranks}"

    # 4. the data files, read by the real safetensors library
    data_files = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors"))
    assert data_files == sorted(by_file)
    for name, items in by_file.items():
        loaded = load_file(str(out / name))
        assert set(loaded) == {key for *_, key in items}, name
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata() == ({"format": "ms"} if framework == "mindspore" else None)
        count: dict[str, int] = {}
        for fqn, *_ in items:
            count[fqn] = count.get(fqn, 0) + 1
        for fqn, offsets, sizes, key in items:
            if count[fqn] == 1:
                assert key == fqn, (name, key)
            else:
                assert re.fullmatch(re.escape(fqn) + r"\.__dcp_chunk_(\d+)", key), (name, key)
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            reference = want_torch[fqn][region]
            assert loaded[key].dtype == reference.dtype and tuple(loaded[key].shape) == sizes, (name, key)
            assert torch_bytes(loaded[key]) == torch_bytes(reference), (name, key)
        for fqn, n in count.items():
            if n > 1:
                keys = sorted(k for f, *_, k in items if f == fqn)
                assert keys == sorted(f"{fqn}.__dcp_chunk_{i}" for i in range(n)), keys

    # 5. nothing else: metadata, hpckpt's record, rank files, the values file; no leftovers next to it
    others = sorted(p.name for p in out.iterdir() if not p.name.endswith(".safetensors"))
    assert others == [".hpckpt-manifest.jsonl", ".metadata"] + (["_rank0_.bytes"] if values else [])
    assert not [p for p in out.parent.iterdir() if ".hpckpt-tmp-" in p.name]


# --------------------------------------------------------------------------------------------
# every fixture onto every target


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_reshard_fixture(name, target, tmp_path):
    fixture = FIXTURES / name
    before = snapshot(fixture)
    spec = make_spec(target, tmp_path)
    out = tmp_path / "out"
    report = api.reshard(fixture, out, spec)
    assert report["finalized"] is True and report["dry_run"] is False
    check_resharded(out, fixture, spec)
    assert snapshot(fixture) == before


def test_toml_rules_really_mix_placements(tmp_path):
    """The rules file gives different tensors different layouts (the premise of the toml case)."""
    spec = make_spec("toml", tmp_path)
    index = open_index(FIXTURES / "m0-torch-4rank")
    seen = {str(spec.resolve(fqn, e.shape).placements) for fqn, e in index.tensors.items()}
    assert len(seen) >= 4, seen
    out = tmp_path / "out"
    api.reshard(FIXTURES / "m0-torch-4rank", out, spec)
    chunks = {fqn: [c.box for c in e.chunks] for fqn, e in open_index(out).tensors.items()}
    assert {b.sizes for b in chunks["model.embed_tokens.weight"]} == {(6, 4)}  # S0 on the 2-dim
    assert {b.sizes for b in chunks["model.layers.0.self_attn.q_proj.weight"]} == {(8, 3)}  # R,S1
    assert [b.sizes for b in chunks["model.norm.weight"]] == [(6,)]  # replicated: stored once
    assert sorted(b.offsets for b in chunks["model.lm_head.weight"]) == [(0, 0), (0, 2), (3, 0), (3, 2)]


# --------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("via", ["w3", "w8", "hsdp"])
@pytest.mark.parametrize("name", ROUND_TRIP)
def test_round_trip_is_byte_identical(name, via, tmp_path):
    fixture = FIXTURES / name
    api.reshard(fixture, tmp_path / "direct", LayoutSpec.for_world_size(4))
    api.reshard(fixture, tmp_path / "middle", make_spec(via, tmp_path))
    api.reshard(tmp_path / "middle", tmp_path / "back", LayoutSpec.for_world_size(4))
    direct, back = tree(tmp_path / "direct"), tree(tmp_path / "back")
    assert sorted(direct) == sorted(back)
    assert ".metadata" in back
    assert [n for n in direct if direct[n] != back[n] and n != MANIFEST] == []
    drop = (*RUN_FIELDS, "source")  # made from other sources; the same files, digests and listing
    assert manifest_content(tmp_path / "direct" / MANIFEST, drop) == manifest_content(tmp_path / "back" / MANIFEST, drop)


# --------------------------------------------------------------------------------------------
# fan-out


SHARES = ([0, 1], [2, 5, 6], [3, 4, 7])


@pytest.mark.parametrize("name", FAN_OUT)
def test_fan_out_then_finalize_equals_one_shot(name, tmp_path):
    fixture = FIXTURES / name
    spec = LayoutSpec.for_world_size(8)
    api.reshard(fixture, tmp_path / "one", spec)
    fan = tmp_path / "fan"
    for share in SHARES:
        report = api.reshard(fixture, fan, spec, ranks=share)
        assert report["finalized"] is False
        assert not (fan / ".metadata").exists()
    report = api.finalize(fan)
    assert report["finalized"] is True
    one, fanned = tree(tmp_path / "one"), tree(fan)
    assert sorted(one) == sorted(fanned)
    assert [n for n in one if one[n] != fanned[n] and n != MANIFEST] == []
    # the same digests of the same files; a fan-out's manifest has no listing (no job reads them all)
    drop = (*RUN_FIELDS, "index")
    assert manifest_content(fan / MANIFEST, drop) == manifest_content(tmp_path / "one" / MANIFEST, drop)
    assert "index" not in manifest_content(fan / MANIFEST)[0]
    with pytest.raises(DestinationExistsError):  # a finished checkpoint takes no more shares
        api.reshard(fixture, fan, spec, ranks=[0])
    assert tree(fan) == fanned


def test_finalize_too_early_names_a_missing_file(tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    spec = LayoutSpec.for_world_size(8)
    fan = tmp_path / "fan"
    for share in SHARES[:2]:
        api.reshard(fixture, fan, spec, ranks=share)
    with pytest.raises(MissingFileError) as info:
        api.finalize(fan)
    missing = {f"_rank{r}_.safetensors" for r in SHARES[2]}
    assert any(name in info.value.message for name in missing), info.value.message
    assert not (fan / ".metadata").exists()
    result = cli("reshard", "--finalize", fan)
    assert result.exit_code == 8, (result.exit_code, result.stderr)
    assert any(name in result.stderr for name in missing), result.stderr
    for command in ("inspect", "verify"):  # an unfinished fan-out is named as one, with what finishes it
        result = cli(command, fan)
        assert result.exit_code == 4 and "a fanned-out reshard whose metadata is not written yet" in result.stderr
        assert f"hpckpt reshard --finalize {fan}" in result.stderr, result.stderr
    api.reshard(fixture, fan, spec, ranks=SHARES[2])  # the last share, then it finalizes
    api.finalize(fan)
    check_resharded(fan, fixture, spec)


def test_share_from_another_plan_is_refused(tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    fan = tmp_path / "fan"
    api.reshard(fixture, fan, LayoutSpec.for_world_size(8), ranks=[0, 1])
    api.reshard(fixture, fan, LayoutSpec.for_world_size(4), ranks=[2, 3])
    with pytest.raises(CorruptMetadataError):
        api.finalize(fan)
    assert not (fan / ".metadata").exists()
    result = cli("reshard", "--finalize", fan)
    assert result.exit_code == 6, (result.exit_code, result.stderr)


def test_fan_out_with_the_console_script(tmp_path):
    fixture = FIXTURES / "m0-torch-4rank-rankLocal"
    out = tmp_path / "out"
    runs = [["reshard", str(fixture), "-o", str(out), "-w", "4", "--rank", "0-1"],
            ["reshard", str(fixture), "-o", str(out), "-w", "4", "--rank", "2", "--rank", "3"],
            ["reshard", "--finalize", str(out)]]
    for args in runs:
        proc = subprocess.run([str(HPCKPT), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (args, proc.stderr)
    assert "Finalized" in proc.stdout
    api.reshard(fixture, tmp_path / "one", LayoutSpec.for_world_size(4))
    assert tree_without_manifest(tree(out)) == tree_without_manifest(tree(tmp_path / "one"))
    drop = (*RUN_FIELDS, "index")
    assert manifest_content(out / MANIFEST, drop) == manifest_content(tmp_path / "one" / MANIFEST, drop)


# --------------------------------------------------------------------------------------------
# sources of other formats


def test_torch_dcp_source(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(5)
    model = {
        "w": torch.randn(5, 3, generator=g),
        "bf": torch.randn(7, 2, generator=g).to(torch.bfloat16),
        "half": torch.randn(4, generator=g).half(),
        "scale": torch.tensor(0.75),
        "empty": torch.empty(0, 3),
        "ids": torch.arange(-3, 8, dtype=torch.int64).reshape(1, 11),
        "mask": torch.arange(6).reshape(2, 3) % 2 == 0,
    }
    values = {"step": 42, "lr": 3e-4, "name": "run-a", "milestones": [10, 20], "betas": (0.9, 0.95)}
    state = {"model": model, **values, "cfg": {"hidden": 8, "dropout": 0.1}}
    src = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=src, no_dist=True)
    tensors = {f"model.{k}": v for k, v in model.items()}
    values = {**values, "cfg.hidden": 8, "cfg.dropout": 0.1}
    assert open_index(src).format == "torch-dcp"
    before = snapshot(src)

    out = tmp_path / "r3"
    spec = LayoutSpec.for_world_size(3)
    api.reshard(src, out, spec)
    assert snapshot(src) == before
    assert cli("verify", out).exit_code == 0
    index = open_index(out)
    assert {fqn: len(e.chunks) for fqn, e in index.tensors.items()} == {
        "model.w": 3, "model.bf": 3, "model.half": 3, "model.scale": 1, "model.empty": 1,
        "model.ids": 2, "model.mask": 3}  # 1 row over 3 ranks: the row and an empty box (stored once)
    with OpenFiles() as files:
        for fqn, tensor in tensors.items():
            got = read_box(index, index.tensors[fqn], files=files)
            assert got.shape == tuple(tensor.shape) and got.tobytes() == torch_bytes(tensor), fqn
    for fqn, want in values.items():
        got = index.decode_value(fqn)
        assert type(got) is type(want) and got == want, fqn

    pt = tmp_path / "back.pt"
    api.consolidate(out, pt, "pt")
    loaded = torch.load(pt, weights_only=True)
    assert set(loaded) == set(tensors) | set(values)
    for fqn, tensor in tensors.items():
        assert loaded[fqn].dtype == tensor.dtype and loaded[fqn].shape == tensor.shape, fqn
        assert torch_bytes(loaded[fqn]) == torch_bytes(tensor), fqn
    for fqn, want in values.items():
        assert type(loaded[fqn]) is type(want) and loaded[fqn] == want, fqn


def other_format_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return {
        "a.weight": torch.randn(6, 4, generator=g),
        "a.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(3, 5, generator=g).half(),
        "b.ids": torch.arange(10, dtype=torch.int64).reshape(2, 5),
        "b.flag": torch.tensor(True),
        "c.empty": torch.zeros(0, 2),
        "c.scale": torch.tensor(2.5, dtype=torch.float64),
    }


def check_against(out: Path, tensors: dict[str, torch.Tensor], spec: LayoutSpec) -> None:
    assert cli("verify", out).exit_code == 0
    index = open_index(out)
    assert set(index.tensors) == set(tensors) and not index.values
    with OpenFiles() as files:
        for fqn, tensor in tensors.items():
            entry = index.tensors[fqn]
            assert {c.box for c in entry.chunks} == set(spec.resolve(fqn, entry.shape).unique_boxes(entry.shape))
            got = read_box(index, entry, files=files)
            assert got.shape == tuple(tensor.shape) and got.tobytes() == torch_bytes(tensor), fqn
    for name in (p for p in out.iterdir() if p.suffix == ".safetensors"):
        for key, t in load_file(str(name)).items():
            fqn = key.split(".__dcp_chunk_")[0]
            assert fqn in tensors and t.dtype == tensors[fqn].dtype, key


def test_safetensors_file_source(tmp_path):
    tensors = other_format_tensors()
    src = tmp_path / "model.safetensors"
    save_file(tensors, str(src))
    before = src.read_bytes(), src.stat().st_mtime_ns
    spec = LayoutSpec.for_world_size(3)
    api.reshard(src, tmp_path / "out", spec)
    assert (src.read_bytes(), src.stat().st_mtime_ns) == before
    check_against(tmp_path / "out", tensors, spec)


def test_hf_sharded_source(tmp_path):
    tensors = other_format_tensors()
    src = tmp_path / "hf"
    src.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(src / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    assert open_index(src).format == "hf-sharded"
    before = snapshot(src)
    spec = make_spec("hsdp", tmp_path)
    api.reshard(src, tmp_path / "out", spec)
    assert snapshot(src) == before
    check_against(tmp_path / "out", tensors, spec)


# --------------------------------------------------------------------------------------------
# --plan


def rank_file_bytes(out: Path) -> dict[int, int]:
    """Tensor bytes in each rank's data file, as the safetensors library loads them."""
    return {rank_of(p.name): sum(t.numel() * t.element_size() for t in load_file(str(p)).values())
            for p in out.glob("_rank*_.safetensors")}


@pytest.mark.parametrize("target", ["w3", "hsdp", "toml", "ceil8"])
@pytest.mark.parametrize("name", ["legacy-torch-4rank", "m0-torch-4rank"])
def test_plan_writes_nothing_and_predicts_the_bytes(name, target, tmp_path):
    fixture = FIXTURES / name
    spec = make_spec(target, tmp_path)
    out = tmp_path / "out"
    plan = api.reshard(fixture, out, spec, dry_run=True)
    assert plan["dry_run"] is True and plan["bytes_written"] == 0
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["rules.toml"] if target == "toml" else [])
    api.reshard(fixture, out, spec)
    actual = rank_file_bytes(out)
    predicted = {r["rank"]: r["bytes_written"] for r in plan["plan"]["ranks"]}
    assert predicted == actual
    assert {r["rank"]: r["bytes_read"] for r in plan["plan"]["ranks"]} == actual  # each element read once
    assert plan["plan"]["bytes"] == sum(actual.values()) == sum(e.nbytes for e in open_index(fixture).tensors.values())
    assert plan["plan"]["files"] == len([p for p in out.iterdir() if p.name.startswith("_rank")])


def test_plan_on_the_command_line(tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    out = tmp_path / "out"
    result = cli("reshard", fixture, "-o", out, "--mesh", "4", "--placements", "S1", "--plan", "--json")
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["dry_run"] is True and not out.exists() and list(tmp_path.iterdir()) == []
    result = cli("reshard", fixture, "-o", out, "--mesh", "4", "--placements", "S1", "--json")
    assert result.exit_code == 0, result.stderr
    assert {r["rank"]: r["bytes_written"] for r in plan["plan"]["ranks"]} == rank_file_bytes(out)
    check_resharded(out, fixture, make_spec("cols", tmp_path))


# --------------------------------------------------------------------------------------------
# refusing to overwrite; the source is never touched


def test_existing_destination_and_force(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "m0-torch-4rank", src)  # a writable source: it must still not change
    before = snapshot(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    result = cli("reshard", src, "-o", out, "-w", "3")
    assert result.exit_code == 14, (result.exit_code, result.stderr)
    assert "exists" in result.stderr and "--force" in result.stderr
    assert tree(out) == {"old.txt": b"keep me"}
    assert snapshot(src) == before
    with pytest.raises(DestinationExistsError):
        api.reshard(src, out, LayoutSpec.for_world_size(3))
    assert snapshot(src) == before
    result = cli("reshard", src, "-o", out, "-w", "3", "--force")  # no checkpoint: not replaced
    assert result.exit_code == 16 and "1 entry and no checkpoint" in result.stderr, (result.exit_code, result.stderr)
    assert tree(out) == {"old.txt": b"keep me"}
    shutil.copytree(FIXTURES / "m0-torch-4rank", out, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("expected*"))  # the checkpoint, not the test's reference files
    result = cli("reshard", src, "-o", out, "-w", "3", "--force")  # a checkpoint and a file that is not its
    assert result.exit_code == 16 and "old.txt is not part of its checkpoint" in result.stderr, result.stderr
    assert (out / "old.txt").read_text() == "keep me"
    (out / "old.txt").unlink()  # a checkpoint alone: --force replaces it
    result = cli("reshard", src, "-o", out, "-w", "3", "--force", "--json")
    assert result.exit_code == 0, result.stderr
    assert not (out / "old.txt").exists()
    check_resharded(out, src, LayoutSpec.for_world_size(3))
    assert snapshot(src) == before
    # the fan-out path and the dry run leave the source alone as well
    api.reshard(src, tmp_path / "fan", LayoutSpec.for_world_size(2), ranks=[0])
    api.reshard(src, tmp_path / "fan", LayoutSpec.for_world_size(2), ranks=[1])
    api.finalize(tmp_path / "fan")
    api.reshard(src, tmp_path / "dry", LayoutSpec.for_world_size(2), dry_run=True)
    assert snapshot(src) == before


def test_console_script_refuses_existing_destination(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    proc = subprocess.run([str(HPCKPT), "reshard", str(FIXTURES / "legacy-torch-4rank"), "-o", str(out), "-w", "2"],
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (14, "")
    assert proc.stderr.startswith("error: ") and "exists" in proc.stderr
    assert tree(out) == {"old.txt": b"keep me"}


# --------------------------------------------------------------------------------------------
# crash safety


def big_checkpoint(root: Path) -> np.ndarray:
    """~16 MB, one float32 tensor stored as 4 column shards of 250: resharding it to rows with a
    1 KiB budget gathers every quarter row from 2 pieces, which takes about a second per rank."""
    rows, cols = 4_000, 1_000
    array = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)  # exact below 2**24
    layout = TensorLayout(Mesh((4,)), parse_placements("S1"))
    chunks = [ChunkData(rank, box, np.ascontiguousarray(array[box.slices()]).tobytes())
              for rank, boxes in layout.all_boxes(array.shape).items() for box in boxes]
    root.mkdir()
    write_checkpoint(root, {"w": (dtypes.dtype("float32"), array.shape, chunks)}, {"step": (0, 7)})
    return array


def header_written(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except FileNotFoundError:
        return False
    return len(head) == 9 and head[:8] != bytes(8) and head[8:9] == b"{"


def test_killed_reshard_leaves_no_checkpoint_and_is_cleaned_up(tmp_path):
    src = tmp_path / "src"
    array = big_checkpoint(src)
    before = snapshot(src)
    dst = tmp_path / "dst"
    proc = subprocess.Popen([str(HPCKPT), "reshard", str(src), "-o", str(dst), "-w", "3",
                             "--max-memory", "1KiB", "--jobs", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staging = None
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            found = list(tmp_path.glob(".dst.hpckpt-tmp-*"))
            # kill in the middle of the copy: once the first rank file has its header and is
            # being filled (not in the instant between its creation and its header)
            if found and header_written(found[0] / "_rank0_.safetensors"):
                staging = found[0]
                break
            assert proc.poll() is None, "the reshard finished before it could be killed: make the input bigger"
            time.sleep(0.001)
        assert staging is not None, "no staging directory appeared"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the reshard finished before it was killed: make the input bigger"
    assert not dst.exists()
    assert staging.is_dir() and not (staging / ".metadata").exists()
    verify = subprocess.run([str(HPCKPT), "verify", str(staging)], capture_output=True, text=True, timeout=120)

    again = subprocess.run([str(HPCKPT), "reshard", str(src), "-o", str(dst), "-w", "3"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert not staging.exists() and not list(tmp_path.glob(".dst.hpckpt-tmp-*"))
    assert api.verify(dst)["exit_code"] == 0
    index = open_index(dst)
    assert_bit_equal(read_box(index, index.tensors["w"]), array, "w")
    assert index.decode_value("step") == 7
    assert snapshot(src) == before
    # checked last so that a failure here does not hide the rest: the staging directory left by
    # the killed run is no checkpoint (exit 4, no metadata), whatever it holds
    assert verify.returncode == 4, (verify.returncode, verify.stdout, verify.stderr)


@pytest.mark.parametrize("ranks", [[0, 1, 2], [0]])
def test_rank_files_without_metadata_are_not_a_checkpoint(ranks, tmp_path):
    """What a killed reshard (or any interrupted HyperParallel save) leaves: rank files, no
    `.metadata`. Whatever the number of rank files, it is no checkpoint (exit 4)."""
    done = tmp_path / "done"
    api.reshard(FIXTURES / "m0-torch-4rank", done, LayoutSpec.for_world_size(3))
    partial = tmp_path / ".out.hpckpt-tmp-12345"
    partial.mkdir()
    for r in ranks:
        shutil.copy(done / f"_rank{r}_.safetensors", partial)
    shutil.copy(done / "_rank0_.bytes", partial)
    result = cli("verify", partial)
    assert result.exit_code == 4, (result.exit_code, result.stdout)


@pytest.mark.parametrize("name", ["m0-torch-4rank", "m0-torch-4rank-rankLocal", "m0-torch-4rank-async"])
def test_plan_reads_only_the_metadata(name, tmp_path):
    """`--plan` works from the metadata alone: with every data file gone it prints the same plan
    (what each target rank writes, reads and from how many files) as with them."""
    whole = api.reshard(FIXTURES / name, tmp_path / "a", LayoutSpec.for_world_size(3), dry_run=True)
    bare = tmp_path / "metadata-only"
    bare.mkdir()
    for p in (FIXTURES / name).iterdir():
        if p.name.endswith("metadata"):
            shutil.copy(p, bare)
    plan = api.reshard(bare, tmp_path / "b", LayoutSpec.for_world_size(3), dry_run=True)
    assert plan["plan"] == whole["plan"] and plan["plan"]["bytes_read"] > 0
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("name", ["m0-torch-4rank-rankLocal", "m0-torch-4rank-async", "legacy-torch-4rank"])
def test_a_run_reports_the_plan_it_predicted(name, tmp_path):
    """`--plan` computes its figures from the metadata, a run from the pieces it copied: they agree,
    rank by rank (bytes written, read, source files), replicas and casts included."""
    spec = LayoutSpec(Mesh((2, 3)), parse_placements("R,S0"))
    for dtype in (None, "bf16"):
        predicted = api.reshard(FIXTURES / name, tmp_path / "p", spec, dtype=dtype, dry_run=True)
        done = api.reshard(FIXTURES / name, tmp_path / f"out-{dtype}", spec, dtype=dtype)
        assert done["plan"] == predicted["plan"] and done["bytes_read"] == predicted["plan"]["bytes_read"]
