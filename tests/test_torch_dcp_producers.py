"""What real PyTorch DCP producers write, read by hpckpt as torch reads it.

1. `dcp.save(..., use_collectives=False)`: one `__{rank}.metadata` per rank and no `.metadata`,
   saved by a real 2-rank torchrun job (gloo, DTensors): read as one checkpoint, compared with
   what torch's own `dcp.load` gave every rank and with `dcp_to_torch_save`.
2. `io.BytesIO` entries: the default planner torch.saves the BytesIO object (a record naming
   `_io.BytesIO`); a planner that hands the BytesIO to the writer as is stores its raw bytes.
   Both read as `bytes`.
3. `DefaultSavePlanner(flatten_state_dict=False)`: a nested dict is one record holding tensors;
   its tensors are read as tensors named as DCP's flattening names them, its leaves as values.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _util import read_location, torch_bytes
from typer.testing import CliRunner

from hpckpt.cli.app import app
from hpckpt.converters import open_index
from hpckpt.converters.torch_dcp import TorchDcpReader
from hpckpt.core.errors import CorruptDataError, CorruptMetadataError, MissingFileError
from hpckpt.core.index import CheckpointIndex, TensorEntry

DIST_SCRIPT = Path(__file__).parent / "dist_scripts" / "torch_dcp_rank_local.py"
runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def cli_json(*args) -> dict:
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assemble(index: CheckpointIndex, entry: TensorEntry) -> np.ndarray:
    """A whole tensor from its chunks (replicas overwrite alike), every element covered."""
    out = np.zeros(entry.shape, dtype=entry.dtype.np)
    covered = np.zeros(entry.shape, dtype=bool)
    for chunk in entry.chunks:
        out[chunk.box.slices()] = read_location(index.locate(chunk, entry)).reshape(chunk.box.sizes)
        covered[chunk.box.slices()] = True
    assert covered.all(), entry.fqn
    return out


def same_bits(array: np.ndarray, tensor: torch.Tensor) -> bool:
    return tuple(array.shape) == tuple(tensor.shape) and np.ascontiguousarray(array).tobytes() == torch_bytes(tensor)


def load_dcp(path: Path) -> dict:
    """torch's own reading of a whole DCP checkpoint (nested as its planner_data says)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".torch.pt")
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


# --- 1. rank-local metadata ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_local(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dcp_rank_local")
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, "--standalone", "--nproc-per-node", "2", str(DIST_SCRIPT), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


def test_rank_local_save_writes_one_metadata_per_rank(rank_local):
    """What torch 2.13 writes: `__{r}.metadata` per rank, each listing only that rank's items."""
    good = rank_local / "good"
    assert sorted(p.name for p in good.iterdir()) == ["__0.metadata", "__0_0.distcp", "__1.metadata", "__1_0.distcp"]
    index = TorchDcpReader().read_index(good)
    assert index.metadata_files == ["__0.metadata", "__1.metadata"]
    assert index.world_size == 2 and index.data_files == ["__0_0.distcp", "__1_0.distcp"]
    assert list(index.tensors) == ["rows", "cols", "rep", "bf", "plain", "own0", "own1"]
    assert list(index.values) == ["step", "note", "blob"]
    boxes = {fqn: sorted((c.box.offsets, c.box.sizes, c.file) for c in e.chunks) for fqn, e in index.tensors.items()}
    assert boxes["rows"] == [((0, 0), (3, 3), "__0_0.distcp"), ((3, 0), (2, 3), "__1_0.distcp")]
    assert boxes["cols"] == [((0, 0), (4, 3), "__0_0.distcp"), ((0, 3), (4, 2), "__1_0.distcp")]
    assert [f for *_, f in boxes["rep"]] == ["__0_0.distcp", "__1_0.distcp"]  # each rank's own replica
    assert boxes["own1"] == [((0,), (3,), "__1_0.distcp")]


def test_rank_local_matches_what_dcp_load_gave_every_rank(rank_local):
    index = open_index(rank_local / "good")
    reference = torch.load(rank_local / "reference.pt", weights_only=False)
    whole = {fqn: assemble(index, e) for fqn, e in index.tensors.items()}
    for fqn, t in reference["tensors"].items():
        assert same_bits(whole[fqn], t), fqn
    for rank in (0, 1):
        loaded = torch.load(rank_local / f"loaded{rank}.pt", weights_only=False)
        for fqn, got in loaded.items():
            if isinstance(got, tuple):  # (offsets, local tensor) as torch's dcp.load filled it
                offsets, local = got
                box = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
                assert same_bits(whole[fqn][box], local), (rank, fqn)
            elif fqn == "note":
                assert got == f"rank {rank}"  # each rank's own copy ...
                assert index.decode_value("note") == "rank 0"  # ... hpckpt reads rank 0's, as dcp_to_torch_save
            else:
                assert index.decode_value(fqn) == got, (rank, fqn)
    assert type(index.decode_value("blob")) is bytes


def test_rank_local_agrees_with_dcp_to_torch_save(rank_local, tmp_path):
    """torch's own tool reads only `__0.metadata` (its rank-0 fallback): every entry it returns
    whole is what hpckpt reads, and on rank 0's box so are the sharded ones; hpckpt also sees
    rank 1's entries, which torch's tool leaves out (own1) or leaves uninitialised."""
    good = tmp_path / "good"
    shutil.copytree(rank_local / "good", good)
    theirs = load_dcp(good)
    index = open_index(good)
    assert "own1" not in theirs and "own1" in index.tensors
    for fqn in ("rep", "plain", "own0"):
        assert same_bits(assemble(index, index.tensors[fqn]), theirs[fqn]), fqn
    for fqn, box in (("rows", np.s_[:3]), ("cols", np.s_[:, :3]), ("bf", np.s_[:4])):
        assert same_bits(assemble(index, index.tensors[fqn])[box], theirs[fqn][box]), fqn
    assert theirs["blob"].getvalue() == index.decode_value("blob")
    assert (theirs["step"], theirs["note"]) == (index.decode_value("step"), index.decode_value("note"))


def test_rank_local_through_every_command(rank_local, tmp_path):
    good = rank_local / "good"
    reference = torch.load(rank_local / "reference.pt", weights_only=False)
    report = cli_json("inspect", good)
    assert report["format"] == "torch-dcp" and report["world_size"] == 2
    assert {t["fqn"]: t["chunks"] for t in report["tensors"]}["rows"] == 2
    assert {v["fqn"]: v["type"] for v in report["values"]} == {"step": "int", "note": "str", "blob": "bytes"}
    assert cli("verify", good).exit_code == 0
    cli_json("reshard", good, "-o", tmp_path / "hp", "--world-size", "3")
    cli_json("convert", good, "--to", "torch-dcp", "-o", tmp_path / "tdcp")
    cli_json("consolidate", good, "--format", "pt", "-o", tmp_path / "whole.pt")
    pt = torch.load(tmp_path / "whole.pt", weights_only=False)
    theirs = load_dcp(tmp_path / "tdcp")
    hp = open_index(tmp_path / "hp")
    assert hp.world_size == 3
    for fqn, t in {**reference["tensors"], "own0": torch.full((3,), 10.0), "own1": torch.full((3,), 11.0)}.items():
        assert same_bits(assemble(hp, hp.tensors[fqn]), t), fqn
        assert torch.equal(pt[fqn], t) and torch.equal(theirs[fqn], t), fqn
    for out in (pt, theirs):
        assert (out["step"], out["note"], out["blob"]) == (17, "rank 0", b"\x00raw\xffbytes")
    assert hp.decode_value("blob") == b"\x00raw\xffbytes"


def test_rank_local_conflicts_are_refused(rank_local):
    with pytest.raises(CorruptMetadataError, match=r"'clash': float32 \[2\] in __0.metadata, float32 \[3\] in __1"):
        TorchDcpReader().read_index(rank_local / "clash_shape")
    with pytest.raises(CorruptMetadataError, match="'kind': a tensor in __0.metadata, a value in __1.metadata"):
        TorchDcpReader().read_index(rank_local / "clash_kind")
    result = cli("inspect", rank_local / "clash_kind")
    assert result.exit_code == CorruptMetadataError.exit_code
    assert result.output.startswith("error: ") and "Traceback" not in result.output


@pytest.mark.parametrize("lost", [0, 1])
def test_missing_rank_metadata_is_a_clear_error(rank_local, tmp_path, lost):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(rank_local / "good", ckpt)
    (ckpt / f"__{lost}.metadata").unlink()
    with pytest.raises(MissingFileError, match=rf"lacks __{lost}.metadata \(rank {lost} wrote data files\)"):
        TorchDcpReader().read_index(ckpt)
    result = cli("inspect", ckpt)
    assert result.exit_code == MissingFileError.exit_code, result.output
    assert f"__{lost}.metadata" in result.output.splitlines()[0]
    (ckpt / f"__{lost}_0.distcp").unlink()  # a rank missing entirely, between others: still refused
    if lost == 0:
        with pytest.raises(MissingFileError, match="lacks __0.metadata; found metadata of rank"):
            TorchDcpReader().read_index(ckpt)


def test_global_metadata_beside_rank_local_must_agree(rank_local, tmp_path):
    """As in torch's reader `.metadata` is read, but never silently: rank-local files beside it
    that list what it does not are another save (exit 6); a consistent subset is a warning."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(rank_local / "good", ckpt)
    shutil.copy(ckpt / "__0.metadata", ckpt / ".metadata")
    with pytest.raises(CorruptMetadataError, match="disagree on"):
        TorchDcpReader().read_index(ckpt)
    (ckpt / "__1.metadata").unlink()
    index = TorchDcpReader().read_index(ckpt)
    assert index.metadata_files == [".metadata"] and "own1" not in index.tensors
    assert any("consistent subset" in w for w in index.warnings)


def test_unreadable_rank_local_metadata(rank_local, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(rank_local / "good", ckpt)
    (ckpt / "__0.metadata").write_bytes(b"")
    result = cli("inspect", ckpt)
    assert result.exit_code == CorruptMetadataError.exit_code and "__0.metadata: empty" in result.output


# --- 2. io.BytesIO entries -------------------------------------------------------------------------


class _RawBytesPlanner:
    """A planner that hands a state dict's io.BytesIO to the storage writer as is (the default
    planner torch.saves it): FileSystemWriter then writes its raw bytes."""

    @staticmethod
    def make():
        from torch.distributed.checkpoint import DefaultSavePlanner

        class RawBytes(DefaultSavePlanner):
            def transform_object(self, write_item, object):
                return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)

        return RawBytes()


@pytest.mark.parametrize("planner", ["default", "raw"])
def test_bytesio_entries_are_bytes(tmp_path, planner):
    import torch.distributed.checkpoint as dcp

    payload = b"PK\x01\x02 not a zip \x00\xff" * 3
    state = {"w": torch.arange(4.0), "blob": io.BytesIO(payload), "empty": io.BytesIO(b""), "plain": b"abc"}
    ckpt = tmp_path / "ckpt"
    dcp.save(state, checkpoint_id=ckpt, no_dist=True, planner=_RawBytesPlanner.make() if planner == "raw" else None)
    index = open_index(ckpt)
    entry = index.values["blob"]
    stored = (ckpt / entry.file).read_bytes()[entry.offset:entry.offset + entry.length]
    assert (stored == payload) == (planner == "raw")  # raw: the bytes themselves; default: a record
    assert index.decode_value("blob") == payload and index.decode_value("empty") == b""
    assert index.decode_value("plain") == b"abc"
    report = cli_json("inspect", ckpt)
    assert {v["fqn"]: v["type"] for v in report["values"]} == {"blob": "bytes", "empty": "bytes", "plain": "bytes"}
    cli_json("convert", ckpt, "-o", tmp_path / "out.pt")
    cli_json("convert", ckpt, "--to", "hp", "-o", tmp_path / "hp")
    pt = torch.load(tmp_path / "out.pt", weights_only=False)
    hp = open_index(tmp_path / "hp")
    for got in (pt["blob"], hp.decode_value("blob")):
        assert type(got) is bytes and got == payload
    ms = cli_json("convert", ckpt, "-o", tmp_path / "out.ckpt")
    accounted = {e["name"] for e in ms["skipped"] + ms["converted"]}
    assert {"blob", "empty", "plain"} <= accounted, ms  # a .ckpt holds no bytes: reported, with reasons
    assert all(e["reason"] for e in ms["skipped"] + ms["converted"])
    if planner == "default":  # torch reads the record back as the BytesIO it saved
        assert load_dcp(ckpt)["blob"].getvalue() == payload
        with open(ckpt / entry.file, "r+b") as f:  # a damaged record is reported, not taken for raw bytes
            f.seek(entry.offset)
            f.write(b"\0\0\0\0")
        with pytest.raises(CorruptDataError, match="'blob'"):
            open_index(ckpt).decode_value("blob")


# --- 3. nested objects stored whole ----------------------------------------------------------------


def nested_state() -> dict:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(3, 4, generator=g)
    return {
        "opt": {
            "m": torch.randn(2, 3, generator=g),
            "lr": 0.1,
            "hist": [torch.randn(4, generator=g), torch.arange(3)],
            "state": {0: {"exp_avg": torch.randn(2, generator=g).to(torch.bfloat16), "step": torch.tensor(7.0)}},
            "view_t": base.t(),  # strided, sharing one storage with view_row
            "view_row": base[1],
            "buf": io.BytesIO(b"opt-bytes"),
        },
        "w": torch.ones(2, 2),
        "pair": (torch.full((2,), 3.0), 5),  # DCP keeps tuples whole, with either planner
        "meta": {"epoch": 3, "tags": ["a", "b"]},  # no tensor: stays one value when not flattened
    }


NESTED_TENSORS = ["opt.m", "opt.hist.0", "opt.hist.1", "opt.state.0.exp_avg", "opt.state.0.step",
                  "opt.view_t", "opt.view_row", "w", "pair.0"]


def expected_tensors(state: dict) -> dict[str, torch.Tensor]:
    o = state["opt"]
    return {"opt.m": o["m"], "opt.hist.0": o["hist"][0], "opt.hist.1": o["hist"][1],
            "opt.state.0.exp_avg": o["state"][0]["exp_avg"], "opt.state.0.step": o["state"][0]["step"],
            "opt.view_t": o["view_t"], "opt.view_row": o["view_row"], "w": state["w"], "pair.0": state["pair"][0]}


EXPECTED_VALUES = {"opt.lr": 0.1, "opt.buf": b"opt-bytes", "pair.1": 5}


@pytest.fixture(scope="module")
def nested(tmp_path_factory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    root = tmp_path_factory.mktemp("dcp_nested")
    dcp.save(nested_state(), checkpoint_id=root / "whole", no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    dcp.save(nested_state(), checkpoint_id=root / "flat", no_dist=True)
    return {"whole": root / "whole", "flat": root / "flat"}


def test_nested_record_is_read_as_its_tensors(nested):
    index = open_index(nested["whole"])
    assert list(index.tensors) == NESTED_TENSORS
    assert list(index.values) == ["opt.lr", "opt.buf", "pair.1", "meta"]
    for fqn, want in EXPECTED_VALUES.items():
        got = index.decode_value(fqn)
        assert type(got) is type(want) and got == want, fqn
    assert index.decode_value("meta") == {"epoch": 3, "tags": ["a", "b"]}
    # torch 2.13's save turns the int key 0 into "0" inside the record and in its planner_data too
    assert index.planner_data["opt.state.0.exp_avg"] == ("opt", "state", "0", "exp_avg")
    record = next(iter(index.values.values()))  # opt's record: every tensor of opt lies inside it
    for fqn, t in expected_tensors(nested_state()).items():
        entry = index.tensors[fqn]
        loc = index.locate(entry.chunks[0], entry)
        if fqn.startswith("opt."):
            assert record.offset <= loc.offset and loc.offset + loc.nbytes <= record.offset + record.length
        assert same_bits(read_location(loc), t), fqn
    assert index.locate(index.tensors["opt.view_t"].chunks[0], index.tensors["opt.view_t"]).strides == (1, 4)
    report = cli_json("inspect", nested["whole"])
    assert [t["fqn"] for t in report["tensors"]] == NESTED_TENSORS
    assert "TensorRecord" not in json.dumps(report)
    assert cli("verify", nested["whole"]).exit_code == 0


def test_nested_names_agree_with_the_flattening_planner(nested):
    whole, flat = open_index(nested["whole"]), open_index(nested["flat"])
    assert list(whole.tensors) == list(flat.tensors) == NESTED_TENSORS
    for fqn in NESTED_TENSORS:
        a, b = whole.tensors[fqn], flat.tensors[fqn]
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert assemble(whole, a).tobytes() == assemble(flat, b).tobytes(), fqn
    for fqn in EXPECTED_VALUES:
        assert whole.decode_value(fqn) == flat.decode_value(fqn), fqn
    # a record without tensors stays one value; DCP's flattening splits it into its leaves
    assert "meta" in whole.values and {"meta.epoch", "meta.tags"} <= set(flat.values)
    for fqn, path in flat.planner_data.items():
        if fqn in whole.planner_data:
            assert whole.planner_data[fqn] == path, fqn


def _safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        out.update(load_file(str(f)))
    return out


def _mindspore(path: Path) -> dict[str, np.ndarray]:
    import mindspore as ms

    out = {}
    for name, p in ms.load_checkpoint(str(path)).items():
        if p.dtype == ms.bfloat16:
            out[name] = (p.astype(ms.float32).asnumpy().view(np.uint32) >> 16).astype(np.uint16)
        else:
            out[name] = p.asnumpy()
    return out


def test_nested_record_through_every_target(nested, tmp_path):
    src = nested["whole"]
    want = expected_tensors(nested_state())
    reports = {
        "reshard": cli_json("reshard", src, "-o", tmp_path / "hp_w2", "--world-size", "2"),
        "hp": cli_json("convert", src, "--to", "hp", "-o", tmp_path / "hp"),
        "pt": cli_json("convert", src, "--to", "torch-save", "-o", tmp_path / "out.pt"),
        "st": cli_json("consolidate", src, "--format", "safetensors", "-o", tmp_path / "out.safetensors"),
        "hf": cli_json("convert", src, "--to", "hf", "-o", tmp_path / "hf"),
        "ms": cli_json("convert", src, "-o", tmp_path / "out.ckpt"),
        "tdcp": cli_json("convert", src, "--to", "torch-dcp", "-o", tmp_path / "tdcp"),
    }
    pt = torch.load(tmp_path / "out.pt", weights_only=False)
    st, hf = _safetensors_dir(tmp_path / "out.safetensors"), _safetensors_dir(tmp_path / "hf")
    ms = _mindspore(tmp_path / "out.ckpt")
    theirs = load_dcp(tmp_path / "tdcp")
    for fqn, t in want.items():
        for name, out in (("pt", pt), ("st", st), ("hf", hf)):
            assert same_bits(out[fqn].numpy() if out[fqn].dtype != torch.bfloat16 else out[fqn].view(torch.int16).numpy(),
                             t), (name, fqn)
        assert same_bits(ms[fqn], t), ("ms", fqn)
        for hp_dir in ("hp", "hp_w2"):
            hp = open_index(tmp_path / hp_dir)
            assert same_bits(assemble(hp, hp.tensors[fqn]), t), (hp_dir, fqn)
    # torch reads hpckpt's DCP output back nested as it was saved (tuples come back as lists)
    assert torch.equal(theirs["opt"]["state"]["0"]["exp_avg"], want["opt.state.0.exp_avg"])
    assert torch.equal(theirs["pair"][0], want["pair.0"]) and theirs["pair"][1] == 5
    assert theirs["opt"]["lr"] == 0.1 and theirs["opt"]["buf"] == b"opt-bytes"
    for fqn, value in {**EXPECTED_VALUES, "meta": {"epoch": 3, "tags": ["a", "b"]}}.items():
        assert pt[fqn] == value and type(pt[fqn]) is type(value), fqn
        assert open_index(tmp_path / "hp").decode_value(fqn) == value, fqn
    for sidecar in (tmp_path / "out.values.json", tmp_path / "hf" / "values.json"):  # values beside safetensors
        doc = json.loads(sidecar.read_text())
        assert doc["opt.buf"] == {"type": "bytes", "value": {"base64": "b3B0LWJ5dGVz"}}  # b"opt-bytes"
        assert doc["opt.lr"]["value"] == 0.1 and doc["pair.1"]["value"] == 5
    for name, report in reports.items():
        assert not report["skipped"] or name == "ms", (name, report["skipped"])
    ms_skipped = {e["name"]: e["reason"] for e in reports["ms"]["skipped"]}
    assert set(ms_skipped) == {"opt.buf", "meta"} and all(ms_skipped.values())  # a .ckpt holds no bytes, no dict
    assert ms["pair.1"] == 5 and abs(float(ms["opt.lr"]) - 0.1) < 1e-7  # as 0-d tensors, reported as converted


def test_zip_directory_scan_tells_records_with_tensors(tmp_path):
    """The cheap scan that decides which value records are opened: real torch.save records,
    small (read whole) and large (read in parts), raw bytes, and a directory it cannot parse."""
    from hpckpt.core.codecs.zip_directory import records_with_storages

    parts = []
    for obj in ({"lr": 0.1, "names": ["a"]}, {"t": torch.arange(3)}, {"big": torch.zeros(40_000)}, [1, 2]):
        buf = io.BytesIO()
        torch.save(obj, buf)
        parts.append(buf.getvalue())
    parts.append(b"raw bytes, no zip" * 10)
    odd = bytearray(parts[0])
    odd[-2:] = b"\x01\x00"  # an end record announcing a comment: not parsed here, so "maybe"
    parts.append(bytes(odd))
    path, ranges, at = tmp_path / "items.distcp", [], 0
    path.write_bytes(b"".join(parts))
    for part in parts:
        ranges.append((at, len(part)))
        at += len(part)
    assert len(parts[2]) > 64 * 1024
    assert records_with_storages(path, ranges + [(at - 4, 8)]) == [False, True, True, False, False, True, False]


def test_leaf_named_like_another_entry_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    state = {"opt": {"m": torch.ones(2)}, "opt.m": torch.zeros(2)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True, planner=DefaultSavePlanner(flatten_state_dict=False))
    with pytest.raises(CorruptMetadataError, match="two entries are named 'opt.m': a top-level entry and a leaf of 'opt'"):
        open_index(tmp_path / "ckpt")
