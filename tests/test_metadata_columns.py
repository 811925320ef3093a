"""A `.metadata` written from columns (`core/codecs/hyperparallel_metadata_columns.py`, what the
HyperParallel writer uses for plans of `COLUMNS_FROM` chunks or more) loads into exactly what the
stock pickler's `.metadata` of the same plan loads into: through hpckpt's safe unpickler and
through the stock unpickler with HyperParallel's classes (as HyperParallel's own `load` reads
it). Plans: uneven, replicated, 0-d, 3-D and 5-D tensors, values with key paths, a rank holding
several chunks of one tensor (renamed keys), every holder storing (dedup "none"); and a whole
`reshard` written both ways, read back by the reader and `verify`."""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
from _util import FIXTURES
from hp_reference import hp_modules
from typer.testing import CliRunner

import hpckpt.converters.hyperparallel.writer as hp_writer
from hpckpt.cli.app import app
from hpckpt.converters.base import WriterOptions
from hpckpt.core.geometry.global_plan import LocalPlan, LocalValue, build_global_plan
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.layout import Mesh, TensorLayout, parse_placements
from hpckpt.core.safety.unpickle import METADATA, loads

ROWS = [("emb", "bfloat16", (13, 6), (4,), "S0"), ("hsdp", "float32", (10, 3), (2, 2), "R,S0"),
        ("grid", "float16", (7, 5), (2, 2), "S0,S1"), ("step", "float32", (), (4,), "R"),
        ("cube", "int64", (4, 3, 2), (2, 2), "S2,S0"), ("five", "float32", (2, 1, 2, 1, 3), (4,), "S4:ceil"),
        ("empty", "float32", (0, 4), (4,), "S0")]


def _plan(dedup: str, ragged: bool = False):
    per_rank: dict[int, list] = {r: [] for r in range(4)}
    for name, dt, shape, mesh, text in ROWS:
        boxes = TensorLayout(Mesh(mesh), parse_placements(text)).all_boxes(shape)
        for r in range(4):
            per_rank[r].append((name, dt, shape, list(boxes.get(r, []))))
    if ragged:  # rank 1 holds two chunks of one tensor: its file keys them fqn.__dcp_chunk_i
        for r in range(4):
            per_rank[r].append(("rag", "float32", (8,), [Box((0,), (3,)), Box((3,), (5,))] if r == 1 else []))
    values = [LocalValue("opt.lr", 12, "d"), LocalValue("opt.betas", 20, "e")]
    nesting = {"opt.lr": ("opt", "lr"), "a.b": ("a.b",)}
    plans = [LocalPlan.build(r, per_rank[r], values if r < 2 else values[:1], nesting) for r in range(4)]
    return build_global_plan(plans, dedup=dedup)


def _both(gp, framework="torch"):
    """(stock, columns) `.metadata` bytes of a global plan."""
    out = []
    for columns in (False, True):
        writer = hp_writer.HyperParallelWriter(WriterOptions(framework=framework), gp.value_lengths)
        writer.layout(replace(gp.plan(), producing=()), {})  # (as a live save's coordinator lays it out)
        out.append(writer._columns_metadata() if columns else writer.finish({}).metadata[0][1])
    return out


def _fields(md):
    """Every field, storage entries with their index (which MetadataIndex equality ignores)."""
    storage = sorted((k.fqn, tuple(k.offset), k.index, v.relative_path, v.offset, v.length, v.tensor_key)
                     for k, v in md.storage_data.items())
    state = {fqn: (type(e).__name__, getattr(e, "properties", None) and vars(e.properties), getattr(e, "size", None),
                   [(c.offsets, c.sizes) for c in getattr(e, "chunks", [])])
             for fqn, e in md.state_dict_metadata.items()}
    return state, storage, md.planner_data, md.version


@pytest.mark.parametrize("dedup,ragged,framework", [("balanced", True, "torch"), ("none", False, "mindspore"),
                                                      ("lowest-rank", True, "mindspore")])
def test_columns_load_as_the_stock_pickle_loads(dedup, ragged, framework):
    stock, columns = _both(_plan(dedup, ragged), framework)
    assert columns != stock  # (another encoding)
    ours = [loads(data, what="x", kind=METADATA) for data in (stock, columns)]
    assert _fields(ours[0]) == _fields(ours[1])
    assert type(ours[1]).__name__ == "Metadata" and ours[1].version == ours[0].version
    with hp_modules():  # HyperParallel's own load: the stock unpickler and its classes
        theirs = [pickle.loads(data) for data in (stock, columns)]
    assert _fields(theirs[0]) == _fields(theirs[1]) == _fields(ours[0])
    assert type(theirs[1]).__module__ == "hyper_parallel.core.distributed_checkpoint.metadata"
    if ragged:
        assert any((key or "").startswith("rag.__dcp_chunk_") for *_, key in _fields(ours[1])[1])


def test_an_integer_past_the_four_byte_form_takes_the_stock_pickler():
    from hpckpt.core.codecs.hyperparallel_metadata_columns import TensorColumns, fits

    big = TensorColumns("w", "torch.int8", (2**31 + 4,), np.array([[0], [2**31]]), np.array([[2**31], [4]]),
                        np.array([0, 1]), np.array([0, 1]))
    assert not fits([big]) and fits([TensorColumns("w", "torch.int8", (8,), np.array([[0]]), np.array([[8]]),
                                                   np.array([0]), np.array([0]))])


def test_a_reshard_written_from_columns_reads_and_verifies(tmp_path, monkeypatch):
    """The whole command with the threshold at 0: the reader and `verify --strict` take it, and
    it lists what the stock pickle of the same reshard lists."""
    src = FIXTURES / "m0-torch-4rank"
    runner = CliRunner()
    stock = tmp_path / "stock"
    assert runner.invoke(app, ["reshard", str(src), "-o", str(stock), "--world-size", "3"]).exit_code == 0
    monkeypatch.setattr(hp_writer, "COLUMNS_FROM", 0)
    fast = tmp_path / "fast"
    assert runner.invoke(app, ["reshard", str(src), "-o", str(fast), "--world-size", "3"]).exit_code == 0
    assert (fast / ".metadata").read_bytes() != (stock / ".metadata").read_bytes()
    for name in sorted(p.name for p in stock.iterdir() if p.name.startswith("_rank")):
        assert (fast / name).read_bytes() == (stock / name).read_bytes(), name
    got = [_fields(loads((d / ".metadata").read_bytes(), what="x", kind=METADATA)) for d in (stock, fast)]
    assert got[0] == got[1]
    verified = runner.invoke(app, ["verify", "--strict", str(fast)])
    assert verified.exit_code == 0, verified.output
    same = runner.invoke(app, ["diff", str(stock), str(fast)])
    assert same.exit_code == 0, same.output


def _plan_of_chunks(chunks_per_tensor: int, dedup: str = "balanced"):
    """A live save's plan from layouts, of more than `COLUMNS_FROM` chunks: FSDP rows over every
    rank, HSDP replicas, a 0-d tensor every rank holds, values with key paths."""
    from hpckpt.core.dtypes import dtype
    from hpckpt.core.geometry.layout_plan import build_layout_plan
    from hpckpt.core.geometry.plan import PlannedValue

    world = chunks_per_tensor
    fsdp, hsdp = Mesh((world,)), Mesh((2, world // 2))
    rows = [(f"layers.{i}.w", dtype("bfloat16"), (world + 3, 4), TensorLayout(fsdp, parse_placements("S0")))
            for i in range(24)]
    rows += [("norm", dtype("float32"), (world,), TensorLayout(hsdp, parse_placements("R,S0"))),
             ("step", dtype("float32"), (), TensorLayout(fsdp, parse_placements("R")))]
    values = (PlannedValue("opt.lr", 0), PlannedValue("opt.betas", 0), PlannedValue("cfg", 1))
    return build_layout_plan(rows, world, dedup=dedup, values=values, value_lengths={"opt.lr": 12, "opt.betas": 30,
                             "cfg": 7}, nesting={"opt.lr": ("opt", "lr"), "cfg": ("cfg",)})


@pytest.mark.parametrize("framework,dedup", [("torch", "balanced"), ("mindspore", "none")])
def test_the_commit_from_the_plan_arrays_writes_the_same_bytes(framework, dedup):
    """`from_global_plan` (a live save's coordinator at thousands of ranks: no object per chunk)
    gives the files and the `.metadata` bytes of the Plan path, byte for byte."""
    gp = _plan_of_chunks(2048, dedup)
    assert len(gp.tid) >= hp_writer.COLUMNS_FROM
    writer = hp_writer.HyperParallelWriter(WriterOptions(framework=framework), gp.value_lengths)
    expected, finished = writer.from_global_plan(gp)
    full = gp.plan()
    by_objects = hp_writer.HyperParallelWriter(WriterOptions(framework=framework), gp.value_lengths)
    by_objects.layout(replace(full, producing=()), {})
    assert expected == by_objects.expected_files(full)
    assert finished.metadata == by_objects.finish({}).metadata
    md = loads(finished.metadata[0][1], what="x", kind=METADATA)
    assert md.planner_data["opt.lr"] == ("opt", "lr") and md.storage_data and len(md.state_dict_metadata) == 29


def test_the_commit_takes_the_plan_path_where_the_arrays_cannot_say_it():
    small = _plan(dedup="balanced")  # below COLUMNS_FROM: HyperParallel's own pickler's bytes
    assert hp_writer.HyperParallelWriter(WriterOptions(framework="torch")).from_global_plan(small) is None
    ragged = _plan("balanced", ragged=True)  # rank 1 holds two chunks of one tensor: renamed keys
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hp_writer, "COLUMNS_FROM", 0)
        assert hp_writer.HyperParallelWriter(WriterOptions(framework="torch")).from_global_plan(ragged) is None
        assert hp_writer.HyperParallelWriter(WriterOptions(framework="torch"),
                                             small.value_lengths).from_global_plan(small) is not None
