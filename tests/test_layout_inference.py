"""Layouts read back from saved chunks: `inspect` prints them and `reshard --keep-layout` keeps them."""

from __future__ import annotations

from _util import FIXTURES, MANIFEST, assert_bit_equal, expected_tensors, normalized_manifest

from hpckpt import api
from hpckpt.converters import open_index
from hpckpt.core.geometry.layout import Mesh
from hpckpt.core.io.read import read_box

# What the fixture README says each tensor was saved with (4 ranks; 2x2 mesh for the 2-D ones).
SAVED = {
    "model.embed_tokens.weight": "S0/4 even",
    "model.layers.0.self_attn.q_proj.weight": "S0/2 even",
    "model.layers.0.self_attn.o_proj.weight": "S1/2 even",
    "model.layers.0.mlp.up_proj.weight": "S0/2 even, S1/2 even",
    "model.layers.0.mlp.down_proj.weight": "S1/4 even",
    "model.layers.0.mlp.gate_proj.weight": "S0/4 balanced",
    "model.lm_head.weight": "S0/4 ceil",
    "model.layers.0.mlp.experts.w1": "irregular (ragged)",
    "model.norm.weight": "replicated",
    "optimizer.state.0.step": "replicated",
}


def test_inspect_prints_the_layout_each_tensor_was_saved_with():
    doc = api.inspect(FIXTURES / "m0-torch-4rank")
    layouts = {t["fqn"]: t["layout"] for t in doc["tensors"]}
    for fqn, layout in SAVED.items():
        assert layouts[fqn] == layout, fqn


def test_keep_layout_changes_only_the_mesh_size(tmp_path):
    fixture = FIXTURES / "m0-torch-4rank"
    out = tmp_path / "out"
    api.reshard(fixture, out, api.keep_layout_spec(fixture, Mesh((2, 4))))
    layouts = {t["fqn"]: t["layout"] for t in api.inspect(out)["tensors"]}
    assert layouts["model.layers.0.mlp.gate_proj.weight"] == "S0/4 balanced"
    assert layouts["model.lm_head.weight"] == "S0/4 ceil"
    assert layouts["model.layers.0.mlp.down_proj.weight"] == "S1/4 even"  # column shards stay column shards
    assert layouts["model.layers.0.mlp.up_proj.weight"] == "S0/2 even, S1/4 even"
    assert layouts["model.norm.weight"] == "replicated"
    index = open_index(out)
    expected = expected_tensors(fixture)
    for fqn, entry in index.tensors.items():
        assert_bit_equal(read_box(index, entry), expected[fqn], fqn)


def test_no_fsync_writes_the_same_checkpoint(tmp_path):
    """`--no-fsync` changes durability only: the files are byte-identical to a default run."""
    import subprocess
    import sys

    fixture = FIXTURES / "m0-torch-4rank"
    for name, extra in (("synced", []), ("unsynced", ["--no-fsync"])):
        out = subprocess.run([sys.executable, "-m", "hpckpt", "reshard", str(fixture), "-o", str(tmp_path / name),
                              "-w", "3", *extra], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    synced = sorted(p.name for p in (tmp_path / "synced").iterdir())
    assert synced == sorted(p.name for p in (tmp_path / "unsynced").iterdir())
    for name in synced:  # byte-identical; the manifest but for the command line it records
        a, b = ((tmp_path / run / name).read_bytes() for run in ("synced", "unsynced"))
        if name == MANIFEST:
            a, b = normalized_manifest(a), normalized_manifest(b)
        assert a == b, name
