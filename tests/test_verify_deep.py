"""`hpckpt verify --deep [--nan]` and `hpckpt checksum`: every byte proved against a manifest.

Sources are written by the libraries themselves (HyperParallel's fixture, `torch.distributed
.checkpoint.save`, `torch.save`, `safetensors`, a Hugging Face sharded directory written with
`safetensors` and its index JSON, `mindspore.save_checkpoint`); `checksum` gives each a manifest,
`verify --deep` must pass it, and one flipped byte inside a box must fail it, naming the file,
the tensor and the box. Outputs of hpckpt's own writers (whose manifest is computed while
writing) are damaged in a header, truncated, and given another checkpoint's manifest. NaN and
infinity counts are exact for every float format torch can store (bfloat16 and float8 as bits).
A few runs go through the real console entry point: one error line, no traceback, the README's
exit codes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hp_reference import copy_fixture
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.core.commit import manifest
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import LayoutSpec
from hpckpt.core.errors import CorruptDataError, DestinationExistsError, HpckptError

FORMATS = ["hyperparallel", "torch-dcp", "torch-save", "safetensors", "hf-sharded", "mindspore-ckpt"]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(16, 8, generator=g), "layer.0.w": torch.randn(8, 8, generator=g).bfloat16(),
            "layer.0.b": torch.randn(8, generator=g), "step": torch.tensor(7, dtype=torch.int64)}


def write_source(fmt: str, root: Path) -> Path:
    """A checkpoint of `fmt` as its own library writes it."""
    root.mkdir(parents=True)
    tensors = state()
    if fmt == "hyperparallel":
        return copy_fixture("m0-torch-4rank", root / "ckpt")
    if fmt == "torch-dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(tensors, checkpoint_id=str(root / "ckpt"), no_dist=True)
        return root / "ckpt"
    if fmt == "torch-save":
        torch.save(tensors, root / "model.pt")
        return root / "model.pt"
    from safetensors.torch import save_file

    if fmt == "safetensors":
        save_file(tensors, str(root / "model.safetensors"))
        return root / "model.safetensors"
    if fmt == "hf-sharded":
        out = root / "hf"
        out.mkdir()
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
        for shard, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, str(out / shard))
        weight_map = {k: shard for shard, keys in shards.items() for k in keys}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return out
    import mindspore as ms

    params = [{"name": k, "data": ms.Parameter(_ms_tensor(v), name=k)} for k, v in tensors.items()]
    path = root / "net.ckpt"
    ms.save_checkpoint(params, str(path))
    os.chmod(path, 0o644)  # MindSpore saves 0400
    return path


def _ms_tensor(t: torch.Tensor):
    import mindspore as ms

    if t.dtype == torch.bfloat16:
        return ms.Tensor(t.float().numpy(), ms.bfloat16)
    return ms.Tensor(t.numpy())


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sources")
    return {fmt: write_source(fmt, base / fmt) for fmt in FORMATS}


def copy_of(src: Path, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    if src.is_dir():
        shutil.copytree(src, dest, copy_function=shutil.copyfile)
    else:
        shutil.copyfile(src, dest)
        for extra in src.parent.glob(src.name + ".*"):
            shutil.copyfile(extra, dest_dir / extra.name)
    return dest


def flip(path: Path, at: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ mask]))


def first_box(ckpt: Path) -> tuple[str, manifest.BoxDigest]:
    found = manifest.read(manifest.path_of(ckpt))
    for line in found.file_digests():
        for box in line.boxes:
            if box.extents and box.extents[0][1]:
                return line.name, box
    raise AssertionError("no box")


def root_of(ckpt: Path) -> Path:
    return ckpt if ckpt.is_dir() else ckpt.parent


def errors(report) -> list[dict]:
    return [f for f in report["findings"] if f["severity"] == "error"]


# -- checksum, then verify --deep, for every format ------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_checksum_then_deep_passes_and_a_flipped_byte_names_file_tensor_and_box(fmt, sources, tmp_path):
    ckpt = copy_of(sources[fmt], tmp_path)
    before = api.verify(ckpt, deep=True)
    assert before.exit_code == 0 and not before["deep"]["manifest_used"] and before["deep"]["chunks_read"] > 0
    written = api.checksum(ckpt)
    assert Path(written["manifest"]) == manifest.path_of(ckpt) and written["boxes"] > 0
    found = manifest.read(manifest.path_of(ckpt))
    assert found.header["format"] == fmt and found.header["source"] is None
    assert ("index" in found.header) == (fmt in ("hyperparallel", "torch-dcp"))
    report = api.verify(ckpt, deep=True)
    assert report.exit_code == 0, report["findings"]
    assert report["deep"]["manifest_used"] and report["deep"]["boxes_checked"] == written["boxes"]
    name, box = first_box(ckpt)
    flip(root_of(ckpt) / name, box.extents[0][0] + box.extents[0][1] // 2)
    report = api.verify(ckpt, deep=True)
    bad = errors(report)
    assert report.exit_code == CorruptDataError.exit_code
    assert {(f["kind"], f["file"], f["fqn"]) for f in bad} == {("corrupt-data", name, box.fqn)}, bad
    # (torch.save records carry a CRC-32: the structural checks see that one too, without the box)
    assert [f["boxes"] for f in bad if f["boxes"]] == [[str(Box(box.offsets, box.sizes))]]


def test_strided_and_shared_storage_are_covered_by_the_file_digest(tmp_path):
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    path = tmp_path / "views.pt"
    torch.save({"t": base.t(), "rows": base[2:6], "other": torch.ones(3)}, path)  # one storage, two views
    written = api.checksum(path)
    assert [(d["name"], d["reason"]) for d in written["digest_only"]] == [("t", "strided")]
    assert written["boxes"] == 2 and api.verify(path, deep=True).exit_code == 0
    storage = min(b.extents[0][0] for line in manifest.read(manifest.path_of(path)).file_digests()
                  for b in line.boxes if b.fqn == "rows") - 2 * 8 * 4  # `base`'s first byte, only `t` holds it
    flip(path, storage)
    report = api.verify(path, deep=True)
    assert [(f["file"], f["fqn"]) for f in errors(report) if "outside tensor data" in f["message"]] == [(path.name, None)]


def test_checksum_refuses_an_existing_manifest_unless_forced(sources, tmp_path):
    ckpt = copy_of(sources["safetensors"], tmp_path)
    api.checksum(ckpt)
    first = manifest.path_of(ckpt).read_bytes()
    with pytest.raises(DestinationExistsError):
        api.checksum(ckpt)
    assert manifest.path_of(ckpt).read_bytes() == first
    api.checksum(ckpt, force=True)
    assert api.verify(ckpt, deep=True).exit_code == 0
    assert not list(tmp_path.glob(".*tmp-*"))  # the temporary file was renamed, not left


def test_checksum_refuses_a_damaged_checkpoint(sources, tmp_path):
    ckpt = copy_of(sources["hyperparallel"], tmp_path)
    with open(ckpt / "_rank1_.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(ckpt / "_rank1_.safetensors") - 10)
    with pytest.raises(HpckptError) as caught:
        api.checksum(ckpt)
    assert caught.value.exit_code == CorruptDataError.exit_code
    assert not manifest.path_of(ckpt).exists()


# -- outputs of hpckpt's writers: damage that only the digests see ---------------------------


@pytest.fixture(scope="module")
def resharded(tmp_path_factory, sources) -> Path:
    out = tmp_path_factory.mktemp("written") / "r2"
    api.reshard(sources["hyperparallel"], out, LayoutSpec.for_world_size(2))
    return out


def test_a_header_byte_names_the_file(resharded, tmp_path):
    ckpt = copy_of(resharded, tmp_path)
    path = ckpt / "_rank1_.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert data[8 + n - 1:8 + n] == b" "  # the header's padding: a tab there keeps it valid JSON
    flip(path, 8 + n - 1, 0x20 ^ 0x09)
    assert api.verify(ckpt).exit_code == 0  # the structural checks cannot see it
    report = api.verify(ckpt, deep=True)
    assert [(f["kind"], f["file"], f["fqn"]) for f in errors(report)] == [("corrupt-data", path.name, None)]
    assert "outside tensor data" in errors(report)[0]["message"]


def test_truncation_is_a_size_finding(resharded, tmp_path):
    ckpt = copy_of(resharded, tmp_path)
    path = ckpt / "_rank0_.bytes"
    path.write_bytes(path.read_bytes()[:-1])
    report = api.verify(ckpt, deep=True)
    sized = [f for f in errors(report) if f["file"] == path.name and "the manifest records" in f["message"]]
    assert sized and report.exit_code <= CorruptDataError.exit_code


def test_a_manifest_of_another_checkpoint_is_refused(resharded, sources, tmp_path):
    ckpt = copy_of(resharded, tmp_path)
    other = copy_of(sources["hyperparallel"], tmp_path / "other")
    api.checksum(other)
    shutil.copyfile(manifest.path_of(other), manifest.path_of(ckpt))
    report = api.verify(ckpt, deep=True)
    assert not report["deep"]["manifest_used"] and report["deep"]["chunks_read"] > 0
    assert {f["kind"] for f in errors(report)} == {"corrupt-metadata"}
    assert report.exit_code == 6


def test_same_metadata_other_boxes_is_refused(resharded, tmp_path):
    """A manifest whose header matches but whose box lines describe other bytes."""
    ckpt = copy_of(resharded, tmp_path)
    path = manifest.path_of(ckpt)
    lines = path.read_bytes().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines[1:], start=1) if json.loads(line)["boxes"])
    doc = json.loads(lines[at])
    doc["boxes"][0][3][0][0] += 4  # the first box's first extent moved
    lines[at] = json.dumps(doc).encode() + b"\n"
    path.write_bytes(b"".join(lines))
    report = api.verify(ckpt, deep=True)
    assert not report["deep"]["manifest_used"]
    assert any(f["kind"] == "corrupt-metadata" and doc["boxes"][0][0] in f["message"] for f in errors(report))


def test_without_a_manifest_a_truncated_chunk_is_found(sources, tmp_path):
    ckpt = copy_of(sources["hyperparallel"], tmp_path)
    path = ckpt / "_rank3_.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    report = api.verify(ckpt, deep=True)
    assert report["deep"]["manifest"] is None and report.exit_code == CorruptDataError.exit_code
    assert errors(report) and all(f["file"] == path.name for f in errors(report))


# -- NaN and infinities ------------------------------------------------------------------------


def specials(dtype: torch.dtype, nan: int, pos: int, neg: int, size: int = 64) -> torch.Tensor:
    t = torch.linspace(-2, 2, size).to(dtype)
    values = [float("nan")] * nan + [float("inf")] * pos + [float("-inf")] * neg
    t[:len(values)] = torch.tensor(values).to(dtype)
    return t


def test_nan_and_inf_counts_are_exact(tmp_path):
    from safetensors.torch import save_file

    cases = {"bf16": (torch.bfloat16, 3, 2, 1), "f16": (torch.float16, 1, 0, 4), "f32": (torch.float32, 5, 1, 1),
             "f64": (torch.float64, 0, 2, 0), "e5m2": (torch.float8_e5m2, 2, 1, 3),
             "e4m3": (torch.float8_e4m3fn, 4, 0, 0), "clean": (torch.float32, 0, 0, 0)}
    tensors = {name: specials(*spec) for name, spec in cases.items()}
    # a NaN with its sign bit set and other payloads: still NaN
    tensors["bf16"][10] = torch.tensor([0xFFC1], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)[0]
    tensors["ints"] = torch.arange(8)
    path = tmp_path / "specials.safetensors"
    save_file(tensors, str(path))
    report = api.verify(path, nan=True)
    counts = {row["name"]: (row["nan"], row["posinf"], row["neginf"]) for row in report["nonfinite"]}
    want = {name: spec[1:] for name, spec in cases.items()}
    want["bf16"] = (4, 2, 1)
    want["e4m3"] = (4, 0, 0)  # e4m3fn has no infinities
    assert counts == want
    flagged = {f["fqn"] for f in report["findings"] if f["kind"] == "non-finite"}
    assert flagged == {n for n, c in want.items() if any(c)}
    assert report.exit_code == 0 and api.verify(path, nan=True, strict=True).exit_code == CorruptDataError.exit_code


# -- the command line ----------------------------------------------------------------------------


def hpckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpckpt", *args], capture_output=True, text=True)


def test_cli_corrupt_box_one_error_line_escaped_name(tmp_path):
    from safetensors.numpy import save_file

    path = tmp_path / "evil.safetensors"
    save_file({"evil\x1b[2Jname": np.arange(64, dtype=np.float32), "ok": np.ones(4, dtype=np.float32)}, str(path))
    assert hpckpt("checksum", str(path)).returncode == 0
    _, box = first_box(path)
    flip(path, box.extents[0][0] + 5)
    run = hpckpt("verify", "--deep", str(path))
    assert run.returncode == 9
    assert "\x1b" not in run.stdout and "evil\\x1b[2Jname" in run.stdout
    assert "Traceback" not in run.stderr and [l for l in run.stderr.splitlines() if l.startswith("error")] == [
        run.stderr.strip()]
    again = hpckpt("checksum", str(path))
    assert again.returncode == DestinationExistsError.exit_code and "Traceback" not in again.stderr
    assert len(again.stderr.strip().splitlines()) <= 2  # the error, and its hint


def test_cli_json_nan_and_progress(tmp_path):
    path = tmp_path / "nan.safetensors"
    from safetensors.torch import save_file

    save_file({"w": specials(torch.bfloat16, 2, 1, 0)}, str(path))
    run = CliRunner().invoke(app, ["--json", "verify", "--nan", "--strict", str(path)])
    doc = json.loads(run.stdout)
    assert run.exit_code == 9 and doc["nonfinite"] == [
        {"name": "w", "dtype": "bfloat16", "elements": 64, "nan": 2, "posinf": 1, "neginf": 0}]
    seen = []

    class Progress:
        def start(self, total):
            seen.append(total)

        def advance(self, n):
            seen.append(n)

    api.verify(path, deep=True, progress=Progress())
    assert seen[0] == sum(seen[1:]) == 128
