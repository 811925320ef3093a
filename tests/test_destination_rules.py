"""Where hpckpt may write, and what `--force` may replace (the real CLI on real files):

1. a fan-out job (`reshard --rank`) writes only into a new or empty directory, or one that jobs of
   its reshard began (`.hpckpt-fanout/`): never over another directory's files, a finished
   checkpoint or a file (exit 14);
2. `--force` replaces a checkpoint directory only when everything in it is the checkpoint's (its
   data and metadata files) or hpckpt's own (`.hpckpt.json`, sidecars, locks, staging names);
   a user's file beside the checkpoint, or metadata that cannot be read, refuses it (exit 16);
3. a source named by a metadata file of a directory checkpoint (`model.safetensors.index.json`,
   `pytorch_model.bin.index.json`, `.metadata`) protects the whole directory (exit 16);
4. a destination that is, or lies in, an hpckpt staging name is refused up front (exit 16).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpckpt.cli.app import app

SRC = Path(__file__).resolve().parents[1] / "examples" / "tiny-hp"
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root` (a directory's value None), hidden ones included."""
    if root.is_file():
        return {".": root.read_bytes()}
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------------------------
# 1. fan-out destinations


def test_fan_out_refuses_a_directory_with_other_files(tmp_path):
    dest = tmp_path / "D"
    dest.mkdir()
    (dest / "_rank0_.safetensors").write_text("precious\n")
    result = cli("reshard", SRC, "-o", dest, "--rank", "0", "-w", "2")
    assert result.exit_code == 14, (result.exit_code, result.output)
    assert "not a fan-out in progress" in result.stderr
    assert (dest / "_rank0_.safetensors").read_text() == "precious\n"
    assert names(dest) == ["_rank0_.safetensors"]
    assert [n for n in names(tmp_path) if n != "D"] == []  # no lock file, no staging left beside it


def test_fan_out_refuses_a_finished_checkpoint_of_another_format(tmp_path):
    hf = tmp_path / "hf"
    assert cli("convert", SRC, "-o", hf, "--to", "hf").exit_code == 0
    before = tree(hf)
    result = cli("reshard", SRC, "-o", hf, "--rank", "0", "-w", "2")
    assert result.exit_code == 14, (result.exit_code, result.output)
    assert "already a finished checkpoint" in result.stderr
    assert tree(hf) == before


def test_fan_out_refuses_an_existing_file(tmp_path):
    dest = tmp_path / "F"
    dest.write_text("precious\n")
    result = cli("reshard", SRC, "-o", dest, "--rank", "0", "-w", "2")
    assert result.exit_code == 14, (result.exit_code, result.output)
    assert "not a directory" in result.stderr
    assert dest.read_text() == "precious\n"
    assert names(tmp_path) == ["F"]


def test_fan_out_into_an_empty_directory_and_its_own_progress(tmp_path):
    dest = tmp_path / "E"
    dest.mkdir()
    assert cli("reshard", SRC, "-o", dest, "--rank", "0", "-w", "2").exit_code == 0  # an empty directory
    assert ".hpckpt-fanout" in names(dest)
    again = cli("reshard", SRC, "-o", dest, "--rank", "0", "-w", "2")  # a rank rerun: the same fan-out
    assert again.exit_code == 0, again.output
    assert cli("reshard", SRC, "-o", dest, "--rank", "1", "-w", "2").exit_code == 0
    finalized = cli("reshard", dest, "--finalize")
    assert finalized.exit_code == 0, finalized.output
    assert cli("verify", dest).exit_code == 0
    before = tree(dest)
    late = cli("reshard", SRC, "-o", dest, "--rank", "1", "-w", "2")  # finished: no job writes into it
    assert late.exit_code == 14, (late.exit_code, late.output)
    assert "already a finished checkpoint" in late.stderr
    assert tree(dest) == before


# --------------------------------------------------------------------------------------------
# 2. what --force replaces


def test_force_refuses_a_checkpoint_with_user_files_beside_it(tmp_path):
    dest = tmp_path / "D"
    dest.mkdir()
    assert cli("convert", SRC, "-o", dest / "model.safetensors", "--to", "safetensors").exit_code == 0
    (dest / "notes.txt").write_text("mine\n")
    (dest / "photos").mkdir()
    (dest / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 cat")
    before = tree(dest)
    result = cli("reshard", SRC, "-o", dest, "-w", "2", "--force")
    assert result.exit_code == 16, (result.exit_code, result.output)
    assert "notes.txt, photos are not part of its checkpoint" in result.stderr
    assert "model.safetensors" not in result.stderr.split("refusing to replace")[1].split(":")[1]
    assert tree(dest) == before
    # more than three: three named, the rest counted
    for name in ("a.txt", "b.txt", "c.txt"):
        (dest / name).write_text(name)
    result = cli("convert", SRC, "-o", dest, "--to", "hf", "--force")
    assert result.exit_code == 16, (result.exit_code, result.output)
    assert "a.txt, b.txt, c.txt and 2 more are not part of its checkpoint" in result.stderr
    assert (dest / "notes.txt").read_text() == "mine\n" and (dest / "photos" / "cat.jpg").exists()


def test_force_refuses_a_checkpoint_whose_metadata_cannot_be_read(tmp_path):
    dest = tmp_path / "hp"
    assert cli("reshard", SRC, "-o", dest, "-w", "2").exit_code == 0
    (dest / ".metadata").write_bytes(b"")  # truncated to nothing: what else is in there is unknown
    before = tree(dest)
    result = cli("reshard", SRC, "-o", dest, "-w", "2", "--force")
    assert result.exit_code == 16, (result.exit_code, result.output)
    assert "metadata cannot be read" in result.stderr and "remove it yourself" in result.stderr
    assert tree(dest) == before


@pytest.mark.parametrize("target", ["hp", "hf", "torch-dcp"])
def test_force_replaces_hpckpts_own_complete_outputs(target, tmp_path):
    dest = tmp_path / "out"
    first = cli("convert", SRC, "-o", dest, "--to", target)
    assert first.exit_code == 0, first.output
    (tmp_path / ".out.hpckpt-lock").write_text("")  # a lock left beside it: hpckpt's own
    (dest / ".inner.hpckpt-lock").write_text("")  # and one inside
    result = cli("convert", SRC, "-o", dest, "--to", target, "--force")
    assert result.exit_code == 0, result.output
    assert cli("verify", dest).exit_code == 0
    assert ".inner.hpckpt-lock" not in names(dest)


def test_force_replaces_a_directory_of_one_file_and_its_sidecar(tmp_path):
    dest = tmp_path / "D"
    dest.mkdir()
    assert cli("convert", SRC, "-o", dest / "model.safetensors", "--to", "safetensors").exit_code == 0
    result = cli("reshard", SRC, "-o", dest, "-w", "2", "--force")
    assert result.exit_code == 0, result.output
    assert "model.safetensors" not in names(dest) and ".metadata" in names(dest)


# --------------------------------------------------------------------------------------------
# 3. a source named by one of its metadata files


def test_hf_index_file_as_source_protects_its_directory(tmp_path):
    hf = tmp_path / "hf"
    assert cli("convert", SRC, "-o", hf, "--to", "hf", "--max-shard-size", "100B").exit_code == 0
    shards = sorted(n for n in names(hf) if n.startswith("model-"))
    assert len(shards) > 1
    before = tree(hf)
    index = hf / "model.safetensors.index.json"
    for out in (hf / shards[0], hf / "new.safetensors"):
        result = cli("convert", index, "-o", out, "--to", "safetensors", "--force")
        assert result.exit_code == 16, (out, result.exit_code, result.output)
        assert "lies inside the source" in result.stderr
        assert tree(hf) == before
    result = cli("reshard", hf / "model.safetensors.index.json", "-o", hf / "sub", "-w", "2")
    assert result.exit_code == 16 and tree(hf) == before
    ok = cli("convert", index, "-o", tmp_path / "whole.safetensors", "--to", "safetensors")
    assert ok.exit_code == 0, ok.output


def test_metadata_file_as_source_protects_its_directory(tmp_path):
    hp = tmp_path / "hp"
    shutil.copytree(SRC, hp)
    before = tree(hp)
    result = cli("convert", hp / ".metadata", "-o", hp / "out.safetensors", "--to", "safetensors")
    assert result.exit_code == 16, (result.exit_code, result.output)
    assert tree(hp) == before


def test_torch_bin_index_file_as_source_protects_its_directory(tmp_path):
    torch = pytest.importorskip("torch")
    root = tmp_path / "bin"
    root.mkdir()
    shards = {"pytorch_model-00001-of-00002.bin": {"a": torch.arange(4, dtype=torch.float32)},
              "pytorch_model-00002-of-00002.bin": {"b": torch.ones(2, 3, dtype=torch.float32)}}
    weight_map = {}
    for name, tensors in shards.items():
        torch.save(tensors, root / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {"total_size": 40},
                                                                   "weight_map": weight_map}))
    before = tree(root)
    index = root / "pytorch_model.bin.index.json"
    result = cli("convert", index, "-o", root / "pytorch_model-00001-of-00002.bin", "--to", "pt", "--force")
    assert result.exit_code == 16, (result.exit_code, result.output)
    assert "lies inside the source" in result.stderr
    assert tree(root) == before
    ok = cli("convert", index, "-o", tmp_path / "whole.pt", "--to", "pt")
    assert ok.exit_code == 0, ok.output


# --------------------------------------------------------------------------------------------
# 4. staging names


@pytest.mark.parametrize("args", [
    ("convert", SRC, "-o", ".foo.hpckpt-tmp-77777", "--to", "hf"),
    ("convert", SRC, "-o", ".foo.safetensors.hpckpt-tmp-5", "--to", "safetensors"),
    ("reshard", SRC, "-o", ".bar.hpckpt-tmp-1/out", "-w", "2", "--parents"),
    ("reshard", SRC, "-o", ".bar.hpckpt-tmp-1/out", "-w", "2", "--rank", "0", "--parents"),
    ("reshard", SRC, "-o", ".baz.hpckpt-tmp-old-3", "-w", "2", "--rank", "1"),
], ids=["staging", "file", "inside", "fan-out-inside", "fan-out"])
def test_staging_names_are_refused(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli(*args)
    assert result.exit_code == 16, (result.exit_code, result.output)
    assert "is an hpckpt staging name" in result.stderr
    assert names(tmp_path) == []  # nothing written, no parent made
