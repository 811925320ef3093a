"""Nothing lost, nothing silently wrong: the checks every write passes through (`core.io.accounting`),
exact coverage of the boxes a copy fills (`core.geometry.overlap`), and sources that change under a run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hp_reference import copy_fixture, write_hp

from hpckpt import api
from hpckpt.api import pipeline
from hpckpt.api.layouts import source_layout
from hpckpt.converters import format_named, open_index
from hpckpt.converters.hyperparallel.writer import HyperParallelWriter
from hpckpt.core.safety import validate
from hpckpt.core.errors import AccountingError
from hpckpt.core.io.box_filler import copy_range
from hpckpt.core.errors import CorruptDataError
from hpckpt.core.io.output import OutputLayout
from hpckpt.core.io.write import WriteSettings

W = np.arange(16, dtype=np.float32).reshape(4, 4)


def run_hpckpt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("command", [
    ["consolidate", "{src}", "-o", "{out}.safetensors"],
    ["convert", "{src}", "-o", "{out}.pt"],
    ["reshard", "{src}", "-o", "{out}", "--world-size", "2"],
])
def test_an_overlap_cannot_hide_a_hole(tmp_path, command):
    src = write_hp(tmp_path / "src", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:3]),  # rows 0-2
        ("_rank1_.safetensors", "w", (2, 0), W[2:3]),  # row 2 again, 4 elements: 16 in all; row 3 missing
    ])})
    out = tmp_path / "out"
    argv = [a.format(src=src, out=out) for a in command]
    proc = run_hpckpt(*argv)
    assert proc.returncode == 11, proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "[3:4, 0:4]" in line and "Traceback" not in proc.stderr, proc.stderr
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir()), list(tmp_path.iterdir())


def test_overlapping_chunks_that_cover_everything_are_copied(tmp_path):
    src = write_hp(tmp_path / "src", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:3]),
        ("_rank1_.safetensors", "w", (1, 0), W[1:]),  # rows 1-2 twice, every row stored
    ])})
    out = tmp_path / "out.safetensors"
    api.consolidate(src, out, "safetensors")
    from safetensors.numpy import load_file

    assert np.array_equal(load_file(out)["w"], W)


def test_verify_finds_an_overlap_on_a_grid_too_large_to_draw(tmp_path, monkeypatch):
    """Past MAX_GRID_CELLS verify counts elements; an overlap is still reported, never passed."""
    src = write_hp(tmp_path / "src", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:3]),
        ("_rank1_.safetensors", "w", (2, 0), W[2:3]),
    ])})
    monkeypatch.setattr(validate, "MAX_GRID_CELLS", 1)
    findings = validate.validate(open_index(src))
    assert [f.kind for f in findings] == ["geometry"], findings
    assert "overlap" in findings[0].message


class DroppingWriter(HyperParallelWriter):
    """The real HyperParallel writer with one box of `w` left out of its layout: a writer bug."""

    def layout(self, plan, values):
        layout = super().layout(plan, values)
        first = next(f for f in layout.files if f.boxes)
        files = tuple(replace(f, boxes=f.boxes[1:]) if f is first else f for f in layout.files)
        return OutputLayout(files, layout.skipped, layout.converted)


class ForgetfulWriter(HyperParallelWriter):
    """The real HyperParallel writer whose metadata forgets every value: a writer bug."""

    def layout(self, plan, values):
        return super().layout(replace(plan, values=()), {})


@pytest.mark.parametrize("writer", [DroppingWriter, ForgetfulWriter])
def test_a_writer_that_loses_an_entry_fails_before_the_destination_exists(tmp_path, writer):
    src = copy_fixture("m0-torch-4rank", tmp_path / "src")
    index = open_index(src)
    fmt = replace(format_named("hyperparallel"), writer=writer)
    target = pipeline.Target(fmt, source_layout(index))
    with pytest.raises(AccountingError) as caught:
        pipeline.write("reshard", src, tmp_path / "out", index, target, WriteSettings(sync=False))
    assert caught.value.exit_code == 1
    assert ("did not place" if writer is DroppingWriter else "value") in caught.value.message, caught.value.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_source_truncated_during_a_copy_is_corrupt_data(tmp_path):
    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(b"x" * 1000)
    with open(src, "rb") as s, open(dst, "wb") as d:
        copy_range(s.fileno(), d.fileno(), 1000, 0, 0, src)
        with pytest.raises(CorruptDataError) as caught:
            copy_range(s.fileno(), d.fileno(), 600, 500, 0, src)
    assert "truncated" in caught.value.message and str(src) in caught.value.message


def test_a_source_truncated_after_its_metadata_was_read(tmp_path):
    src = copy_fixture("m0-torch-4rank", tmp_path / "src")
    index = open_index(src)
    for data in src.glob("_rank*_.safetensors"):
        os.truncate(data, data.stat().st_size - 8)
    with pytest.raises(CorruptDataError):
        api.convert(src, tmp_path / "out.pt", index=index)
    assert not (tmp_path / "out.pt").exists()


def test_skipped_entries_are_reported_with_their_reasons_in_json_and_on_stderr(tmp_path):
    import torch

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2), "empty": torch.empty(0, 3), "pair": (1, 2)}, src)
    proc = run_hpckpt("convert", src, "-o", tmp_path / "out.ckpt", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    reasons = {s["name"]: s["reason"] for s in report["skipped"]}
    assert set(reasons) == {"empty", "pair"} and all(reasons.values())
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: not written")]
    assert len(warnings) == 2 and any("empty" in w for w in warnings) and any("pair" in w for w in warnings)


# --------------------------------------------------------------------------------------------
# The invariant over every source format x every target format


from test_conformance import SAMPLE_IDS, WRITERS, destination, samples  # noqa: E402,F401  (samples: fixture)


@pytest.mark.parametrize("fmt", WRITERS, ids=[f.name for f in WRITERS])
@pytest.mark.parametrize("sample_id", SAMPLE_IDS)
def test_every_source_entry_is_written_or_reported(samples, tmp_path, sample_id, fmt):  # noqa: F811
    """Each tensor and value of a producer's checkpoint is in hpckpt's output in its kind (read back
    by hpckpt), or named with a reason in `skipped` (or `converted`, for a value stored as a tensor)."""
    sample = samples(sample_id)
    source = open_index(sample.path)
    dst = destination(fmt, tmp_path)
    layout = None
    if fmt.name == "mindformers":  # equal slices only: the producers' layouts split rows unevenly
        from hpckpt.api.layouts import layout_spec

        layout = layout_spec(None, 1, "balanced", None, None, None, None)
    report = api.convert(sample.path, dst, fmt.name, settings=WriteSettings(sync=False), layout=layout)
    skipped = {s["name"]: s["reason"] for s in report["skipped"]}
    converted = {s["name"]: s["reason"] for s in report["converted"]}
    assert all(skipped.values()) and all(converted.values()), report.to_json()
    out = open_index(dst)
    for fqn, entry in source.tensors.items():
        if fqn in skipped:
            continue
        assert fqn in out.tensors, (fqn, sorted(out.tensors))
        assert (out.tensors[fqn].dtype, tuple(out.tensors[fqn].shape)) == (entry.dtype, tuple(entry.shape)), fqn
    for fqn in source.values:
        if fqn in skipped:
            continue
        where = out.tensors if fqn in converted else out.values
        leaves = [n for n in out.values if n.startswith(fqn + ".")]  # a dict value nested, read back as leaves
        assert fqn in where or leaves, (fqn, "converted" if fqn in converted else "value", sorted(out.values))
    known = set(source.tensors) | set(source.values)
    assert all(n in known or any(n.startswith(k + ".") for k in source.values) for n in [*out.tensors, *out.values])


# --------------------------------------------------------------------------------------------
# A checksum the source's format records is checked by every copy, and by verify


def flip_a_storage_byte(path, member_suffix: str = "/data/0") -> None:
    """Flip one byte inside the storage member of a torch.save zip at the start of `path`."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(member_suffix))
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    data[info.header_offset + 30 + name_len + extra_len + 3] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["out.safetensors", "out.ckpt", "out.pt", "hp"])
def test_a_torch_save_storage_that_fails_its_zip_crc_is_never_converted(tmp_path, target):
    import torch

    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, src)
    flip_a_storage_byte(src)
    out = tmp_path / target
    proc = run_hpckpt("convert", src, "-o", out, *(["--to", "hp"] if target == "hp" else []))
    assert proc.returncode == 9, proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "CRC-32" in line and "src.pt" in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]
    verified = run_hpckpt("verify", src)
    assert verified.returncode == 9 and "CRC-32" in verified.stdout + verified.stderr


def test_a_torch_dcp_record_that_fails_its_zip_crc_is_never_resharded(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}, checkpoint_id=str(src), no_dist=True)
    (data,) = src.glob("*.distcp")
    flip_a_storage_byte(data, "/data/0")
    proc = run_hpckpt("reshard", src, "-o", tmp_path / "out", "--world-size", "2")
    assert proc.returncode == 9 and "CRC-32" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_convert_ms_torch_knows_a_container_for_every_readable_format():
    from hpckpt.api.convert import _KEEP_KIND
    from hpckpt.converters import FORMATS

    assert set(_KEEP_KIND) == {f.name for f in FORMATS}  # every name a source's index can report
    assert all(format_named(kind).writer is not None for kind in _KEEP_KIND.values())


def test_a_tensor_in_two_hf_shards_is_read_from_the_one_the_index_names(tmp_path):
    import torch
    from safetensors.torch import save_file

    hf = tmp_path / "hf"  # (an output inside the source directory is refused)
    hf.mkdir()
    save_file({"w": torch.ones(2, 2), "a": torch.arange(3.0)}, hf / "model-00001-of-00002.safetensors")
    save_file({"w": torch.zeros(2, 2), "b": torch.arange(2.0)}, hf / "model-00002-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "w": "model-00002-of-00002.safetensors"}}))
    api.convert(hf, tmp_path / "out.pt")
    assert torch.load(tmp_path / "out.pt", weights_only=True)["w"].sum() == 0  # shard 2's, as the index says


def test_the_values_sidecar_is_strict_json_and_round_trips_what_it_can(tmp_path):
    import math

    import torch

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(1), "nan": float("nan"), "inf": float("-inf"), "pair": (1, 2), "raw": b"\x00\xff",
                "deep": [1.0, float("inf")]}, src)
    report = api.convert(src, tmp_path / "out.safetensors")
    text = (tmp_path / "out.values.json").read_text()

    def refuse(token):
        raise AssertionError(f"non-JSON token {token}")

    json.loads(text, parse_constant=refuse)
    assert [c["name"] for c in report["converted"]] == ["deep"]  # a nested inf: kept as its repr, and said so
    back = open_index(tmp_path / "out.safetensors")
    assert math.isnan(back.decode_value("nan")) and back.decode_value("inf") == float("-inf")
    assert back.decode_value("pair") == (1, 2) and back.decode_value("raw") == b"\x00\xff"


# --------------------------------------------------------------------------------------------
# Second red-team round: damaged HyperParallel metadata and values, unfinished saves, counters


def test_a_chunk_outside_its_tensor_is_refused_by_every_writing_command(tmp_path):
    src = write_hp(tmp_path / "src", {"w": ("torch.float32", (3, 4), [  # the metadata says 3 rows
        ("_rank0_.safetensors", "w", (0, 0), W[:2]), ("_rank1_.safetensors", "w", (2, 0), W[2:])])})  # 4 stored
    for argv in (["consolidate", src, "-o", tmp_path / "out.safetensors"], ["convert", src, "-o", tmp_path / "o.pt"],
                 ["reshard", src, "-o", tmp_path / "rs", "--world-size", "2"]):
        proc = run_hpckpt(*argv)
        assert proc.returncode == 11 and "outside the tensor" in proc.stderr, (argv, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_files_of_an_unfinished_save_stop_every_writing_command(tmp_path):
    src = copy_fixture("m0-torch-4rank", tmp_path / "src")
    (src / "STORAGE_DATA_1.pkl").write_bytes(b"\x80\x04N.")
    proc = run_hpckpt("convert", src, "-o", tmp_path / "out.pt")
    assert proc.returncode == 13 and "STORAGE_DATA_1.pkl" in proc.stderr, proc.stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_value_that_is_no_pickle_is_read_as_bytes_and_said_so(tmp_path):
    src = write_hp(tmp_path / "src", {"w": ("torch.float32", (4, 4), [("_rank0_.safetensors", "w", (0, 0), W)])},
                   {"step": ("_rank0_.bytes", b"\xee\x04Kd.")})  # a damaged pickle, or a raw bytes value
    proc = run_hpckpt("convert", src, "-o", tmp_path / "out.pt", "--json")
    assert proc.returncode == 0
    assert any("no pickle" in w for w in json.loads(proc.stdout)["warnings"])
    assert any(line.startswith("warning: source: step:") for line in proc.stderr.splitlines())
    verified = run_hpckpt("verify", src, "--json")
    assert any(f["severity"] == "warning" and "no pickle" in f["message"] for f in json.loads(verified.stdout)["findings"])


def test_a_counter_the_destination_dtype_rounds_is_warned_of(tmp_path):
    import mindspore as ms
    from mindspore import Parameter, Tensor

    src = tmp_path / "train.ckpt"
    params = {"w": np.ones((2,), np.float32), "moment1.w": np.zeros(2, np.float32), "moment2.w": np.zeros(2, np.float32),
              "global_step": np.array(2**24 + 1, np.int32)}
    ms.save_checkpoint([{"name": k, "data": Parameter(Tensor(v), name=k)} for k, v in params.items()], str(src))
    proc = run_hpckpt("convert-ms-torch", src, "-o", tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr
    assert any("16777217" in line and "held as 16777216" in line for line in proc.stderr.splitlines()), proc.stderr


def test_a_chunk_with_other_dims_than_its_tensor_is_corrupt_metadata_not_a_crash(tmp_path):
    src = write_hp(tmp_path / "src", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W, (16,))])})  # the metadata claims a 1-D box of a 2-D tensor
    for argv in (["inspect", src], ["convert", src, "-o", tmp_path / "o.pt"], ["reshard", src, "-o", tmp_path / "r", "-w", "2"]):
        proc = run_hpckpt(*argv)
        assert proc.returncode in (6, 11) and "Traceback" not in proc.stderr and "internal" not in proc.stderr, (argv, proc.stderr)


def test_a_metadata_object_missing_a_field_is_a_schema_error():
    from hpckpt.core.codecs import hyperparallel_metadata as metadata
    from hpckpt.core.errors import CorruptMetadataError

    for cls in (metadata.Metadata, metadata.TensorStorageMetadata, metadata.TensorProperties):
        broken = object.__new__(cls)  # what unpickling an object whose state lacks every field gives
        import dataclasses

        field_name = next(f.name for f in dataclasses.fields(cls)
                          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        with pytest.raises(CorruptMetadataError, match=field_name):
            getattr(broken, field_name)
        with pytest.raises(AttributeError):
            broken.not_a_field  # noqa: B018


@pytest.mark.parametrize("argv", [["consolidate", "{src}", "-o", "{out}", "--force"],
                                  ["convert", "{src}", "-o", "{out}", "--to", "pt", "--force"],
                                  ["convert", "{src}", "-o", "{out}", "--to", "ms", "--force"]])
def test_force_never_replaces_a_directory_with_a_file(tmp_path, argv):
    src = copy_fixture("m0-torch-4rank", tmp_path / "src")
    out = tmp_path / "outdir"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_hpckpt(*[a.format(src=src, out=out) for a in argv])
    assert proc.returncode == 14 and "is a directory" in proc.stderr, proc.stderr
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outdir", "src"]  # no sidecar left beside it
