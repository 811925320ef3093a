"""`hpckpt inspect`: summary, tables, filters, --shards and the JSON document."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from _util import FIXTURES, REPO

from hpckpt import api


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hpckpt", *args], capture_output=True, text=True)


def test_json_document_of_a_real_hyperparallel_checkpoint():
    out = _cli("inspect", str(FIXTURES / "m0-torch-4rank"), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["schema"] == 3
    assert (doc["format"], doc["format_version"], doc["framework"], doc["world_size"]) == ("hyperparallel", "1.0", "torch", 4)
    assert doc["counts"] == {"tensors": 15, "values": 9, "chunks": 42, "tensor_bytes": 1656}
    assert [f["path"] for f in doc["files"]][0] == ".metadata"
    assert doc["total_bytes"] == sum(f["bytes"] for f in doc["files"])
    lm_head = next(t for t in doc["tensors"] if t["fqn"] == "model.lm_head.weight")
    assert lm_head == {"fqn": "model.lm_head.weight", "dtype": "float32", "dtype_as_written": "torch.float32",
                       "shape": [5, 4], "layout": "S0/4 ceil", "chunks": 4, "bytes": 80}
    betas = next(v for v in doc["values"] if v["fqn"] == "optimizer.param_groups.0.betas")
    assert (betas["type"], betas["value"]) == ("tuple", [0.9, 0.95])
    assert "shards" not in doc


def test_shards_list_chunk_boxes_per_rank_file_and_key():
    doc = api.inspect(FIXTURES / "m0-torch-4rank", shards=["*experts*"])
    (shard,) = doc["shards"]
    assert shard["fqn"] == "model.layers.0.mlp.experts.w1"
    assert [(c["offsets"], c["sizes"], c["rank"], c["key"]) for c in shard["chunks"]] == [
        ([0, 0], [1, 5], 0, "model.layers.0.mlp.experts.w1.__dcp_chunk_0"),
        ([1, 0], [1, 2], 0, "model.layers.0.mlp.experts.w1.__dcp_chunk_1"),
        ([1, 2], [1, 3], 1, "model.layers.0.mlp.experts.w1.__dcp_chunk_0"),
        ([2, 0], [1, 5], 1, "model.layers.0.mlp.experts.w1.__dcp_chunk_1"),
        ([3, 0], [3, 5], 3, "model.layers.0.mlp.experts.w1"),
    ]


def test_include_and_exclude_filter_tensors_and_values():
    doc = api.inspect(FIXTURES / "m0-torch-4rank", api.Selection.of(["optimizer.*"], ["*.step"]))
    assert [t["fqn"] for t in doc["tensors"]] == ["optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg_sq"]
    assert {v["fqn"] for v in doc["values"]} == {
        "optimizer.param_groups.0.lr", "optimizer.param_groups.0.betas", "optimizer.param_groups.0.params"}
    assert doc["counts"]["tensors"] == 15  # counts describe the whole checkpoint


def test_human_output_has_summary_tables_and_values():
    out = _cli("inspect", str(REPO / "examples" / "tiny-hp"), "--shards", "model.embed_tokens.weight")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("hyperparallel 1.0 (written by hpckpt 0.1.0, torch dtypes)", "World size", "model.layers.0.mlp.down_proj.weight",
                   "bfloat16", "[4, 6]", "'tiny-example'", "Chunks of model.embed_tokens.weight", "_rank1_.safetensors"):
        assert needle in text, needle
    assert out.stderr == ""


def test_inspect_accepts_the_metadata_file_itself():
    doc = api.inspect(FIXTURES / "m0-mindspore-1rank-noDist" / "0.metadata")
    assert (doc["format"], doc["framework"]) == ("hyperparallel", "mindspore")
    assert {t["dtype_as_written"] for t in doc["tensors"]} >= {"Float32", "BFloat16", "Float16", "Int64", "Bool"}


def test_example_checkpoint_is_what_the_script_makes(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "make_example.py"), str(tmp_path / "ex")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    shipped = REPO / "examples" / "tiny-hp"
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ex").iterdir())
    for name in names:
        assert (shipped / name).read_bytes() == (tmp_path / "ex" / name).read_bytes(), name


def test_summary_first_counts_by_dtype_and_layout_and_ranks_grouped(tmp_path):
    """`--summary`: the header, then by dtype, by layout and one line per group of ranks that store
    alike; no line per tensor or value. The JSON document always carries the summary; and who
    wrote a checkpoint is hpckpt only where hpckpt's manifest says so."""
    doc = json.loads(_cli("inspect", str(FIXTURES / "m0-torch-4rank"), "--json").stdout)
    summary = doc["summary"]
    for key in ("dtypes", "layouts"):
        assert sum(r["tensors"] for r in summary[key]) == 15 and sum(r["bytes"] for r in summary[key]) == 1656
    assert {r["dtype"]: r["tensors"] for r in summary["dtypes"]} == {"float32": 13, "int64": 1, "bfloat16": 1}
    groups = summary["rank_groups"]
    data = [f for f in doc["files"] if f["kind"] == "data"]
    assert sum(g["files"] * g["count"] for g in groups) == len(data) == 7
    assert sum(g["bytes"] * g["count"] for g in groups) == sum(f["bytes"] for f in data)
    assert doc["written_by"] is None and doc["framework"] == "torch"  # HyperParallel's own save
    # ranks that store alike are one line: 4 ranks with a row each of w, rank 0 also the value
    from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
    from hpckpt.core import dtypes
    from hpckpt.core.geometry.box import Box

    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    out = tmp_path / "even"
    write_checkpoint(out, {"w": (dtypes.dtype("float32"), (8, 4), [
        ChunkData(r, Box((2 * r, 0), (2, 4)), w[2 * r:2 * r + 2].tobytes()) for r in range(4)])}, {"step": (0, 7)})
    doc = json.loads(_cli("inspect", str(out), "--json", "--summary").stdout)
    assert doc["written_by"].startswith("hpckpt ") and doc["tensors"] == [] and doc["values"] == []
    sizes = {f["path"]: f["bytes"] for f in doc["files"]}
    assert [(g["ranks"], g["count"], g["files"], g["bytes"]) for g in doc["summary"]["rank_groups"]] == [
        ("0", 1, 2, sizes["_rank0_.safetensors"] + sizes["_rank0_.bytes"]),
        ("1-3", 3, 1, sizes["_rank1_.safetensors"])], doc["summary"]
    text = _cli("inspect", str(FIXTURES / "m0-torch-4rank"), "--summary").stdout
    for needle in ("By dtype", "By layout", "Ranks (grouped by what each stores)", "bfloat16", "S0/4 even"):
        assert needle in text, needle
    assert "model.layers.0.mlp.down_proj.weight" not in text and "optimizer.param_groups" not in text
    assert len(text.splitlines()) < 40
