"""MindFormers Checkpoint 2.0, read from real files MindFormers 2.1.0 wrote (`fixtures/mindformers/`,
provenance in its README): detected (told apart from a HyperParallel step tree), every value as
MindFormers saved it, with and without `metadata.json`, a 2-rank tensor-parallel layout, a
checkpoint root through its tracker or one iteration directory; `common.json` carried as values;
malformed metadata one line and an exit code, never evaluated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from hpckpt.cli.app import app

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mindformers"
runner = CliRunner()


def hpckpt(*args: str, code: int = 0) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, (args, result.exit_code, result.output)
    return result.output


@pytest.mark.parametrize("name", ["meta", "nometa", "rr"])
def test_single_rank_saves_read_as_mindformers_saved_them(name, tmp_path):
    root = FIXTURES / name
    doc = json.loads(hpckpt("inspect", str(root), "--json"))
    assert (doc["format"], doc["format_version"], doc["framework"]) == ("mindformers", "2.0", "mindspore")
    values = {v["fqn"]: v["value"] for v in doc["values"]}
    assert values["common.global_step"] == 2 and values["common.consumed_samples"] == 6
    iteration = next(root.glob("iteration_*"))  # the same checkpoint, named directly
    assert json.loads(hpckpt("inspect", str(iteration), "--json"))["counts"] == doc["counts"]
    assert json.loads(hpckpt("verify", str(root), "--json"))["ok"] is True
    hpckpt("consolidate", str(root), "-o", str(tmp_path / "all.safetensors"))
    got = load_file(str(tmp_path / "all.safetensors"))
    with np.load(FIXTURES / f"{name}-ref.npz") as ref:
        assert sorted(got) == sorted(ref.files)
        for key in ref.files:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)


def test_a_tensor_parallel_save_is_assembled(tmp_path):
    """`global_offset` is a slice number in the grid of `axis_fragmentations`, not an offset."""
    rs = np.random.RandomState(7)
    full = {"fc1.weight": rs.randn(8, 4), "fc1.bias": rs.randn(8), "fc2.weight": rs.randn(2, 8), "fc2.bias": rs.randn(2)}
    doc = json.loads(hpckpt("inspect", str(FIXTURES / "sim2"), "--json"))
    assert {t["fqn"]: t["layout"] for t in doc["tensors"]} == {
        "fc1.weight": "S0/2 even", "fc1.bias": "S0/2 even", "fc2.weight": "S1/2 even", "fc2.bias": "replicated"}
    assert doc["world_size"] == 2
    hpckpt("reshard", str(FIXTURES / "sim2"), "-o", str(tmp_path / "hp"), "--world-size", "3")
    hpckpt("consolidate", str(tmp_path / "hp"), "-o", str(tmp_path / "all.safetensors"))
    got = load_file(str(tmp_path / "all.safetensors"))
    for key, array in full.items():
        np.testing.assert_array_equal(got[key], array.astype(np.float32), err_msg=key)
    assert json.loads((tmp_path / "all.values.json").read_text())["common.global_step"]["value"] == 5
    # the live library loads it into any layout (one process here)
    import torch

    import hpckpt.dist as hdist

    state = {key: torch.zeros(array.shape, dtype=torch.float32) for key, array in full.items()}
    hdist.load(state, checkpoint_id=str(FIXTURES / "sim2"), no_dist=True, strict=False)
    for key, array in full.items():
        np.testing.assert_array_equal(state[key].numpy(), array.astype(np.float32), err_msg=key)


def test_with_and_without_metadata_are_the_same_checkpoint():
    """The single card's save without metadata.json (read from the headers) and with it (read
    through storage_data) hold the same tensors and values."""
    out = hpckpt("diff", str(FIXTURES / "meta"), str(FIXTURES / "nometa"))
    assert out.startswith("equal: 14 identical; 7 values, 0 differ"), out


def test_bad_mindformers_metadata(tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "sim2", root)
    iteration = root / "iteration_00000005"
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    assert "iteration_00000007" in hpckpt("inspect", str(root), code=8)
    (root / "latest_checkpointed_iteration.txt").write_text("five")
    assert "not an iteration number" in hpckpt("inspect", str(root), code=6)
    metadata = iteration / "metadata.json"
    doc = json.loads(metadata.read_text())
    key = next(k for k in doc["storage_data"] if "fc1.weight" in k)
    for bad in ("__import__('os').system('true')", "('fc1.weight', (0,)) + ()", "[" * 5000):
        broken = dict(doc, storage_data={**doc["storage_data"], bad: doc["storage_data"][key]})
        metadata.write_text(json.dumps(broken))
        out = hpckpt("inspect", str(iteration), code=6)
        assert "not a (name, offset) tuple" in out and "Traceback" not in out, out
    # a replica's file that storage_data names is checked too, though the first holder is read
    replicas = json.loads(json.dumps(doc))
    bias = next(k for k in replicas["storage_data"] if "fc2.bias" in k)
    replicas["storage_data"][bias].append({"file_name": "model-0000002-0000003.safetensors", "storage_rank": 2})
    metadata.write_text(json.dumps(replicas))
    assert "model-0000002-0000003.safetensors" in hpckpt("verify", str(iteration), code=8)
    slices = dict(doc)
    slices["state_dict_metadata"] = json.loads(json.dumps(doc["state_dict_metadata"]))
    slices["state_dict_metadata"]["fc1.weight"]["chunk"][1]["global_offset"] = [2]  # only 2 slices
    slices["storage_data"] = {**doc["storage_data"], "('fc1.weight', (2,))": doc["storage_data"][key]}
    metadata.write_text(json.dumps(slices))
    assert "slice 2 of 2" in hpckpt("inspect", str(iteration), code=6)


@pytest.mark.parametrize(("source", "how", "expected"), [
    ("sim2", ("convert", "--world-size", "2"), "hpckpt-2rank"),
    ("meta", ("convert", "--world-size", "1"), "hpckpt-1rank"),
    ("sim2", ("reshard", "--mesh", "2x2", "--placements", "S0,R"), "hpckpt-2x2-s0r"),
    ("sim2", ("reshard", "--mesh", "2x2", "--placements", "R,S0", "--keep-replicas"), "hpckpt-2x2-rs0-replicas"),
])
def test_written_as_mindformers_loader_accepted(source, how, expected, tmp_path):
    """`convert`/`reshard --to mindformers` write, byte for byte, what MindFormers 2.1.0's own
    `load_checkpoint` read back correctly (fixtures README): model files, common.json, metadata.json
    (the whole mesh as each tensor's layout, every holder of a slice in its `rank_group`, slice
    numbers on the grid); with a replicating mesh axis, each slice once or on every holder."""
    out = tmp_path / "out"
    command, *options = how
    hpckpt(command, str(FIXTURES / source), "--to", "mindformers", "-o", str(out), *options)
    want = FIXTURES / expected
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(p.name for p in want.iterdir())
    for f in want.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert hpckpt("diff", str(out), str(FIXTURES / source)).startswith("equal:")


def doc_values(checkpoint) -> int:
    return json.loads(hpckpt("inspect", str(checkpoint), "--json"))["counts"]["values"]


def test_other_sources_and_layouts_mindformers_cannot_hold(tmp_path):
    """A HyperParallel checkpoint becomes a MindFormers one (its values that are not common.json
    fields reported skipped, by name); a layout MindFormers cannot describe (unequal slices) is
    refused before anything is written."""
    example = Path(__file__).resolve().parent.parent / "examples" / "tiny-hp"
    out = hpckpt("convert", str(example), "--to", "mindformers", "-o", str(tmp_path / "mf"), "--world-size", "1",
                 "--json")
    assert out.startswith("warning: not written (MindFormers Checkpoint 2.0 holds tensors"), out
    doc = json.loads(out[out.index("{\n"):])  # (the warning is stderr's)
    skipped = {s["name"] for s in doc["skipped"]}
    assert "extra_state.run_name" in skipped and "optimizer.param_groups.0.lr" in skipped, doc["skipped"]
    for dry in (("reshard", str(example), "--to", "mf", "-o", str(tmp_path / "p1"), "--world-size", "1", "--plan"),
                ("convert", str(example), "--to", "mf", "-o", str(tmp_path / "p2"), "--world-size", "1", "--dry-run")):
        said = hpckpt(*dry, "--json")  # a dry run names the same values, from their names alone
        assert said.startswith("warning: not written (MindFormers Checkpoint 2.0 holds tensors"), said
        planned = json.loads(said[said.index("{\n"):])
        assert planned["skipped"] == doc["skipped"] and not (tmp_path / dry[5]).exists(), planned["skipped"]
        if dry[0] == "convert":
            assert planned["would_write"]["values"] == doc_values(example) - len(skipped)
    back = json.loads(hpckpt("inspect", str(tmp_path / "mf"), "--json"))
    assert back["format"] == "mindformers" and back["counts"]["tensors"] == 6
    for source, world in ((example, "2"), (FIXTURES / "sim2", "4")):  # 9 rows on 2 ranks; 2 rows on 4
        out = hpckpt("convert", str(source), "--to", "mindformers", "-o", str(tmp_path / "no"), "--world-size", world,
                     code=2)
        assert "equal slices on a grid" in out, out
        assert not (tmp_path / "no").exists()


def test_megatrons_metadata_json_is_not_taken_for_mindformers(tmp_path):
    """Megatron's distributed checkpoints also have a `metadata.json` (other keys): not ours."""
    from hpckpt.converters.mindformers import MindFormersReader

    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (tmp_path / "common.pt").write_bytes(b"")
    assert MindFormersReader().sniff(tmp_path) is False
    assert MindFormersReader().sniff(FIXTURES / "sim2" / "iteration_00000005") is True


def test_reshard_into_mindformers_with_every_replica_and_its_tracker(tmp_path):
    """`reshard --to mindformers` writes any even layout, each chunk once or (`--keep-replicas`)
    once per rank holding it as MindFormers does without remove-redundancy; an output named
    `iteration_N` gets its root's tracker (never moved back to an older iteration); a fan-out's
    finalize writes it too; other targets are refused as usage errors."""
    source = FIXTURES / "sim2"
    layout = ("--mesh", "2x2", "--placements", "R,S0")
    root = tmp_path / "root"
    root.mkdir()
    hpckpt("reshard", str(source), "-o", str(root / "iteration_00000005"), "--to", "mf", *layout, "--keep-replicas")
    iteration = root / "iteration_00000005"
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "5"
    doc = json.loads((iteration / "metadata.json").read_text())
    holders = {key: sorted(e["storage_rank"] for e in entries) for key, entries in doc["storage_data"].items()}
    assert holders["('fc1.weight', (0,))"] == [0, 2] and holders["('fc1.weight', (1,))"] == [1, 3], holders
    assert holders["('fc2.bias', (0,))"] == [0, 2], holders
    for rank in range(4):  # every rank's file holds its whole local slice of every tensor
        got = load_file(str(iteration / f"model-{rank:07d}-0000004.safetensors"))
        assert sorted(got) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        assert got["fc1.weight"].shape == (4, 4) and got["fc2.weight"].shape == (1, 8)
    np.testing.assert_array_equal(load_file(str(iteration / "model-0000001-0000004.safetensors"))["fc1.weight"],
                                  load_file(str(iteration / "model-0000003-0000004.safetensors"))["fc1.weight"])
    # read back through the root (its tracker) and through the iteration: the source's values
    for path in (root, iteration):
        assert hpckpt("diff", str(path), str(source)).startswith("equal:")
    assert json.loads(hpckpt("verify", str(root), "--json"))["ok"] is True
    # each chunk once: the same values in half the bytes
    hpckpt("reshard", str(source), "-o", str(root / "iteration_00000007"), "--to", "mf", *layout)
    once = json.loads((root / "iteration_00000007" / "metadata.json").read_text())["storage_data"]
    assert all(len(entries) == 1 for entries in once.values())
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert hpckpt("diff", str(root), str(source)).startswith("equal:")
    # an older iteration written later leaves the tracker on the newest, and says so
    out = hpckpt("reshard", str(source), "-o", str(root / "iteration_00000006"), "--to", "mf", *layout, "--json")
    assert "names iteration 7, newer than iteration_00000006: left as it is" in out, out
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "7"
    # a tracker that cannot be written does not undo the complete output: said, exit 0
    blocked = tmp_path / "blocked"
    (blocked / "latest_checkpointed_iteration.txt").mkdir(parents=True)
    out = hpckpt("reshard", str(source), "-o", str(blocked / "iteration_00000002"), "--to", "mf", *layout)
    assert "the tracker was not updated" in out and "iteration_00000002 is complete" in out, out
    assert hpckpt("diff", str(blocked / "iteration_00000002"), str(source)).startswith("equal:")
    # fanned out over two jobs: finalize writes the metadata, then the tracker
    fan = tmp_path / "fan"
    fan.mkdir()
    for ranks in ("0-1", "2-3"):
        hpckpt("reshard", str(source), "-o", str(fan / "iteration_00000009"), "--to", "mf", *layout,
               "--keep-replicas", "--rank", ranks)
    assert not (fan / "latest_checkpointed_iteration.txt").exists()
    hpckpt("reshard", "--finalize", str(fan / "iteration_00000009"))
    assert (fan / "latest_checkpointed_iteration.txt").read_text() == "9"
    for name in ("metadata.json", "common.json", *(f"model-{r:07d}-0000004.safetensors" for r in range(4))):
        assert (fan / "iteration_00000009" / name).read_bytes() == (iteration / name).read_bytes(), name
    # the other layout format too
    hpckpt("reshard", str(root), "-o", str(tmp_path / "dcp"), "--to", "torch-dcp", "--world-size", "2")
    assert hpckpt("diff", str(tmp_path / "dcp"), str(source)).startswith("equal:")
    # refused before anything is written: a whole-tensor target, replicas of a format that stores one
    out = hpckpt("reshard", str(source), "-o", str(tmp_path / "x"), "--to", "safetensors", "--world-size", "2", code=2)
    assert "Invalid value" in out or "safetensors" in out, out
    out = hpckpt("reshard", str(source), "-o", str(tmp_path / "x"), "--world-size", "2", "--keep-replicas", code=2)
    assert "--keep-replicas is for mindformers" in out, out
    assert not (tmp_path / "x").exists()
