"""`inspect` reports the true world size: hpckpt's writers record it in the manifest's header.

(Checkpoints written before the manifest have `.hpckpt.json` instead, still read: `LEGACY`.)

A 64-rank reshard of `examples/tiny-hp` leaves most ranks without a file; the record says 64 in
`inspect` (text and JSON), for HyperParallel and PyTorch DCP outputs and for a fan-out run. A
checkpoint hpckpt did not write (a HyperParallel fixture, one torch DCP saved itself) says "at
least N". A record that does not describe its checkpoint (a smaller world size than a file name,
not JSON, too big, not a file, left over from another save) is a warning and the world size falls
back to the file names, never a crash. The loaders of both formats ignore the record: PyTorch's
own `torch.distributed.checkpoint.load`, and a HyperParallel-compatible loader (stand-ins of
HyperParallel's classes through the stock unpickler, chunks through `safetensors`, as
HyperParallel's `load` reads `.metadata` and the files its `storage_data` names).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import FIXTURES, REPO, RUN_FIELDS, manifest_content
from hp_reference import hp_modules
from safetensors import safe_open
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.converters import hpckpt_json, open_index
from hpckpt.core.commit import manifest

TINY = REPO / "examples" / "tiny-hp"
RECORD = manifest.NAME
LEGACY = hpckpt_json.NAME


def run(*args: str) -> str:
    result = CliRunner().invoke(app, [*args])
    assert result.exit_code == 0, result.output
    return result.output


def inspect_json(path: Path) -> dict:
    return json.loads(run("inspect", str(path), "--json", "--no-values"))


def world_line(path: Path) -> str:
    return next(line for line in run("inspect", str(path), "--no-values").splitlines() if line.startswith("World size"))


@pytest.fixture(scope="module")
def hp64(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hp64") / "out"
    run("reshard", str(TINY), "-o", str(out), "--world-size", "64", "--no-fsync")
    return out


@pytest.fixture(scope="module")
def dcp64(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dcp64") / "out"
    run("convert", str(TINY), "--to", "torch-dcp", "--world-size", "64", "-o", str(out), "--no-fsync")
    return out


def copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


# --- the record says the world size --------------------------------------------------------


def test_a_64_rank_reshard_says_64_though_most_ranks_hold_no_file(hp64):
    assert not (hp64 / "_rank63_.safetensors").exists()  # the file names alone would say 11
    doc = inspect_json(hp64)
    assert (doc["world_size"], doc["world_size_exact"]) == (64, True)
    assert world_line(hp64).split()[2] == "64" and "at least" not in world_line(hp64)
    assert RECORD in [f["path"] for f in doc["files"]]
    assert not any(RECORD in note for note in doc["notes"])


def _header(path: Path) -> dict:
    return json.loads((path / RECORD).read_text().splitlines()[0])


def test_the_record_holds_the_world_size_mesh_placements_and_metadata_it_was_written_with(hp64):
    import xxhash

    record = _header(hp64)
    assert record["hpckpt_manifest"] == 1 and record["written_by"].startswith("hpckpt ")
    assert (record["format"], record["world_size"], record["mesh"], record["placements"]) == ("hyperparallel", 64, [64], "S0")
    data = (hp64 / ".metadata").read_bytes()
    assert record["metadata"] == {".metadata": {"bytes": len(data), "digest": xxhash.xxh3_128_hexdigest(data)}}
    assert isinstance(record["command"], str) and record["source"]["path"] == str(TINY)


def test_torch_dcp_output_says_64(dcp64):
    assert not (dcp64 / "__63_0.distcp").exists()
    doc = inspect_json(dcp64)
    assert (doc["format"], doc["world_size"], doc["world_size_exact"]) == ("torch-dcp", 64, True)
    assert _header(dcp64)["format"] == "torch-dcp"


def test_a_fan_out_run_gets_the_same_record_as_a_one_shot_run(hp64, tmp_path):
    out = tmp_path / "fan"
    for share in ("0-9", "10-63"):
        run("reshard", str(TINY), "-o", str(out), "--world-size", "64", "--rank", share, "--no-fsync")
    assert not (out / RECORD).exists()  # written by finalize, with the metadata
    run("reshard", "--finalize", str(out))
    drop = (*RUN_FIELDS, "index")  # the finalize reads no data file: the manifest has no listing
    assert manifest_content(out / RECORD, drop) == manifest_content(hp64 / RECORD, drop)
    assert inspect_json(out)["world_size"] == 64


def test_a_mesh_with_rules_records_no_placements(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('mesh = "2x2"\ndefault = "R,S0"\n[[rule]]\nmatch = "*embed*"\nplacements = "S0,S1"\n')
    out = tmp_path / "out"
    run("reshard", str(TINY), "-o", str(out), "--layout-rules", str(rules), "--no-fsync")
    record = _header(out)
    assert (record["world_size"], record["mesh"], "placements" in record) == (4, [2, 2], False)


def test_verify_accepts_the_record(hp64, dcp64):
    for out in (hp64, dcp64):
        report = api.verify(out, strict=True)
        assert report["exit_code"] == 0 and not report["findings"], report["findings"]


# --- checkpoints hpckpt did not write: at least N ------------------------------------------


def test_a_hyperparallel_fixture_says_at_least_its_ranks_in_file_names():
    doc = inspect_json(FIXTURES / "m0-torch-4rank")
    assert (doc["world_size"], doc["world_size_exact"]) == (4, False)
    assert world_line(FIXTURES / "m0-torch-4rank").split()[2:4] == ["at", "least"]


def test_a_checkpoint_saved_by_torch_dcp_says_at_least(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(12.0).reshape(3, 4)}, checkpoint_id=str(tmp_path / "t"), no_dist=True)
    doc = inspect_json(tmp_path / "t")
    assert (doc["format"], doc["world_size"], doc["world_size_exact"]) == ("torch-dcp", 1, False)


# --- a record that does not describe its checkpoint: a warning, never a crash ----------------


def _edit(path: Path, name: str = RECORD, **changes) -> None:
    """Change fields of the record (a manifest's header line; the other lines stay)."""
    first, *rest = (path / name).read_text().splitlines(keepends=True)
    record = json.loads(first)
    record.update(changes)
    (path / name).write_text(json.dumps(record) + "\n" + "".join(rest))


def tampered(kind: str, out: Path) -> None:
    target = out / RECORD
    if kind == "smaller-than-a-file-name":
        _edit(out, world_size=5)  # _rank10_ exists
    elif kind == "not-json":
        target.write_bytes(b'{"hpckpt_manifest": 1, "world_size": 64,')
    elif kind == "not-a-record":
        target.write_text('[64]')
    elif kind == "world-size-not-a-number":
        _edit(out, world_size="64")
    elif kind == "world-size-implausible":  # layout inference would split tensors into that many parts
        _edit(out, world_size=10**12)
    elif kind == "huge":  # a header over the metadata limit (here 1 MiB)
        target.write_bytes(b'{"hpckpt_manifest": 1, "world_size": 64, "pad": "' + b"x" * (1 << 20) + b'"}\n')
    elif kind == "a-directory":
        target.unlink()
        target.mkdir()
    elif kind == "a-fifo":
        target.unlink()
        os.mkfifo(target)
    elif kind == "other-format":
        _edit(out, format="torch-dcp")
    elif kind == "left-from-another-save":  # the directory saved into again: another .metadata
        _edit(out, metadata={".metadata": {"bytes": 12, "digest": "0" * 32}})
    else:
        raise AssertionError(kind)


TAMPERED = ["smaller-than-a-file-name", "not-json", "not-a-record", "world-size-not-a-number", "world-size-implausible", "huge",
            "a-directory", "a-fifo", "other-format", "left-from-another-save"]


@pytest.mark.parametrize("kind", TAMPERED)
def test_a_bad_record_is_a_warning_and_the_world_size_is_inferred(hp64, tmp_path, kind, monkeypatch):
    monkeypatch.setenv("HPCKPT_MAX_METADATA_BYTES", str(1 << 20))
    out = copy(hp64, tmp_path / "out")
    tampered(kind, out)
    doc = inspect_json(out)
    assert (doc["world_size"], doc["world_size_exact"]) == (11, False)
    assert any(RECORD in note and "ignored" in note for note in doc["notes"]), doc["notes"]
    assert "at least 11" in world_line(out)
    report = api.verify(out)
    assert report["exit_code"] == 0, report["findings"]  # the loaders never read it: a warning
    assert [f["severity"] for f in report["findings"] if f["file"] == RECORD] == ["warning"]
    assert api.verify(out, strict=True)["exit_code"] != 0


def test_a_stale_record_copied_from_another_output_is_ignored(hp64, tmp_path):
    """A record of a 64-rank write next to a 3-rank checkpoint: its metadata sizes give it away."""
    out = tmp_path / "w3"
    run("reshard", str(TINY), "-o", str(out), "--world-size", "3", "--no-fsync")
    shutil.copyfile(hp64 / RECORD, out / RECORD)
    doc = inspect_json(out)
    assert (doc["world_size"], doc["world_size_exact"]) == (3, False)


def test_verify_finds_a_metadata_file_of_the_same_size_but_other_bytes(hp64, tmp_path):
    out = copy(hp64, tmp_path / "out")
    record = _header(out)
    record["metadata"][".metadata"]["digest"] = "0" * 32
    _edit(out, metadata=record["metadata"])
    findings = api.verify(out)["findings"]
    assert [(f["severity"], "digest" in f["message"]) for f in findings] == [("warning", True)]


def test_a_writing_command_from_a_source_with_a_bad_record_still_works(hp64, tmp_path):
    src = copy(hp64, tmp_path / "src")
    tampered("not-json", src)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["reshard", str(src), "-o", str(out), "--world-size", "2", "--no-fsync"])
    assert result.exit_code == 0, result.output
    assert inspect_json(out)["world_size"] == 2


# --- both formats' own loaders ignore the record ---------------------------------------------


def test_pytorch_dcp_load_reads_hpckpt_output_with_the_record(dcp64):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    assert (dcp64 / RECORD).is_file()
    index = open_index(dcp64)
    state = {fqn: torch.full(e.shape, 7, dtype=getattr(torch, e.dtype.name)) for fqn, e in index.tensors.items()}
    dcp.load(state, storage_reader=FileSystemReader(str(dcp64)), no_dist=True)
    want = torch.load(_consolidated(dcp64), weights_only=False)
    for fqn, tensor in state.items():
        assert torch.equal(tensor, want[fqn]), fqn


def _consolidated(path: Path) -> Path:
    """torch's own `dcp_to_torch_save` of the checkpoint (another of torch's readers)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / "consolidated.pt"
    if not out.exists():
        dcp_to_torch_save(str(path), str(out))
    return out


def hyperparallel_load(path: Path) -> dict[str, torch.Tensor]:
    """What HyperParallel's `load` reads: `.metadata` (its classes, here stand-ins) and the chunks
    its `storage_data` names, each a safetensors entry; nothing else in the directory."""
    with hp_modules():
        metadata = pickle.loads((path / ".metadata").read_bytes())
    tensors = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if type(item).__name__ != "TensorStorageMetadata":
            continue
        whole = torch.zeros(tuple(item.size), dtype=getattr(torch, item.properties.dtype.removeprefix("torch.")))
        for chunk in item.chunks:
            (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn and tuple(k.offset) == tuple(chunk.offsets)]
            with safe_open(str(path / info.relative_path), framework="pt") as f:
                part = f.get_tensor(info.tensor_key)
            whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = part
        tensors[fqn] = whole
    return tensors


def test_hyperparallel_loader_reads_hpckpt_output_with_the_record(hp64, dcp64):
    assert (hp64 / RECORD).is_file()
    named = {info.relative_path for info in _storage(hp64)}
    assert RECORD not in named and not RECORD.endswith("metadata")  # not one of HyperParallel's metadata names
    loaded = hyperparallel_load(hp64)
    want = torch.load(_consolidated(dcp64), weights_only=False)  # the same source, read by torch
    assert set(loaded) == {fqn for fqn, v in want.items() if isinstance(v, torch.Tensor)}
    for fqn, tensor in loaded.items():
        assert torch.equal(tensor, want[fqn]), fqn


def _storage(path: Path) -> list:
    with hp_modules():
        return list(pickle.loads((path / ".metadata").read_bytes()).storage_data.values())


def test_the_record_does_not_change_what_hpckpt_reads(hp64, tmp_path):
    """Without the record the same tensors and values come out; only the world size is a bound."""
    bare = copy(hp64, tmp_path / "bare")
    (bare / RECORD).unlink()
    with_record, without = open_index(hp64), open_index(bare)
    assert list(with_record.tensors) == list(without.tensors) and list(with_record.values) == list(without.values)
    assert (with_record.world_size, without.world_size) == (64, 11)
    assert np.array_equal(with_record.tensors["model.norm.weight"].chunk_arrays()[0],
                          without.tensors["model.norm.weight"].chunk_arrays()[0])


def test_the_index_cache_keeps_the_record_s_world_size_and_rereads_a_changed_record(tmp_path):
    """Large HyperParallel indexes are cached (converters.index_cache): the record (here a legacy
    `.hpckpt.json`: a manifest would give the listing itself) is part of the cache's identity, so a
    cached index has its world size and a changed record is read again."""
    from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
    from hpckpt.converters.index_cache import MIN_METADATA_BYTES, cache_dir
    from hpckpt.core import dtypes
    from hpckpt.core.geometry.box import Box

    n = 36_000  # chunks of one element: a .metadata over the cache's threshold
    out = tmp_path / "big"
    write_checkpoint(out, {"w": (dtypes.dtype("float32"), (n,), [ChunkData(i % 2, Box((i,), (1,)), bytes(4))
                                                                  for i in range(n)])})
    assert (out / ".metadata").stat().st_size >= MIN_METADATA_BYTES
    (out / RECORD).unlink()
    name, data = hpckpt_json.record("hyperparallel", 8, [(".metadata", (out / ".metadata").read_bytes())])
    (out / name).write_bytes(data)
    for _ in range(2):  # parsed and cached, then from the cache
        report = api.inspect(out, decode_values=False)
        assert (report["world_size"], report["world_size_exact"], report["notes"]) == (8, True, [])
    cached = set(cache_dir().glob("*.idx"))
    assert cached
    (out / LEGACY).write_text('{"hpckpt": 1, "world_size": 8,')
    for _ in range(2):
        report = api.inspect(out, decode_values=False)
        assert (report["world_size"], report["world_size_exact"]) == (2, False)
        assert [note for note in report["notes"] if LEGACY in note], report["notes"]
    assert set(cache_dir().glob("*.idx")) > cached  # another identity, another snapshot


def test_a_forged_world_size_far_above_the_ranks_with_files_is_not_followed(tmp_path):
    """A record saying 10^6 ranks for a 2-rank checkpoint would make `convert` keep a layout of a
    million ranks (gigabytes of plan): it is ignored, with a note, and the output has 2 ranks."""
    src = tmp_path / "src"
    shutil.copytree(TINY, src)
    _edit(src, world_size=10**6)
    index = open_index(src)
    assert (index.world_size, index.world_size_exact) == (2, False)
    assert any("not trusted" in w for w in index.warnings)
    run("convert", str(src), "-o", str(tmp_path / "out"), "--to", "hp")
    assert api.inspect(tmp_path / "out")["world_size"] == 2
