"""MindSpore `.ckpt` integrity, against real MindSpore 2.10 (no mocks):

* a CRC trailer is checked on every read of the file's data, once per run, before anything of it
  reaches a destination: a mismatch fails every writing command with exit 9 and no output;
* a file with no entry (what `save_checkpoint({})` / `([])` write) is no checkpoint: exit 4;
* Python scalars the writer stores as 0-d tensors are reported as converted;
* the writer writes no tensor_type MindSpore's loader refuses.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest
from _util import assert_bit_equal
from typer.testing import CliRunner

from hpckpt.cli.app import app
from hpckpt.converters import format_named, open_index
from hpckpt.converters.base import WriterOptions
from hpckpt.core.io import checksums
from hpckpt.core.codecs import mindspore_ckpt as mc
from hpckpt.core.dtypes import all_dtypes, dtype
from hpckpt.core.errors import CorruptDataError, NotACheckpointError, UnsupportedDTypeError
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.geometry.plan import whole_tensor_plan
from hpckpt.core.io.read import read_box
from hpckpt.core.io.write import WriteSettings, write_plan

crc_module = importlib.import_module("hpckpt.core.codecs.mindspore_ckpt.crc")
ms = pytest.importorskip("mindspore")
torch = pytest.importorskip("torch")

runner = CliRunner()

W = np.arange(12, dtype=np.float32).reshape(3, 4)
B = np.linspace(-1, 1, 5).astype(np.float32)


def ms_save(path: Path, entries, **kwargs) -> Path:
    """`mindspore.save_checkpoint` of numpy arrays (as Parameters: plain Tensors are dropped)."""
    if isinstance(entries, dict):
        entries = [{"name": k, "data": ms.Parameter(ms.Tensor(v), name=k)} for k, v in entries.items()]
    ms.save_checkpoint(entries, str(path), **kwargs)
    path.chmod(0o600)  # MindSpore saves files read-only
    return path


def flip(path: Path, offset: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def one_error(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr and lines[0].startswith("error: "), result.stderr
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), result.stderr
    for needle in needles:
        assert needle in lines[0], result.stderr


def writes(src: Path, out: Path) -> list[tuple[str, list[str], Path]]:
    """Every writing command on `src`, each with its own destination under `out`."""
    return [
        ("convert-st", ["convert", str(src), "-o", str(out / "a.safetensors")], out / "a.safetensors"),
        ("convert-pt", ["convert", str(src), "-o", str(out / "b.pt")], out / "b.pt"),
        ("convert-ms", ["convert", str(src), "-o", str(out / "c.ckpt"), "--crc"], out / "c.ckpt"),
        ("convert-hp", ["convert", str(src), "-o", str(out / "d"), "--to", "hp"], out / "d"),
        ("consolidate", ["consolidate", str(src), "-o", str(out / "e.safetensors")], out / "e.safetensors"),
        ("reshard", ["reshard", str(src), "-o", str(out / "f"), "--world-size", "2"], out / "f"),
        ("convert-ms-torch", ["convert-ms-torch", str(src), "-o", str(out / "g")], out / "g"),
    ]


@pytest.fixture(scope="module")
def crc_files(tmp_path_factory) -> dict[str, Path]:
    """One file saved by MindSpore with crc_check=True, and copies damaged in several places."""
    root = tmp_path_factory.mktemp("crc")
    good = ms_save(root / "good.ckpt", {"w": W, "b": B}, crc_check=True, append_dict={"note": "hi"})
    raw = good.read_bytes()
    files = {"good": good}
    for name, offset in {
        "content": raw.index(W.tobytes()) + 5,  # a byte of tensor data
        "tag": raw.index(b"\x0a\x01b") + 2,  # the name "b" -> "c": the walk is still sound
        "string": raw.index("hi".encode("utf-32-le")),  # the str value's content
        "trailer": len(raw) - 1,  # the stored CRC itself
    }.items():
        (root / f"{name}.ckpt").write_bytes(raw)
        files[name] = flip(root / f"{name}.ckpt", offset)
    return files


# --------------------------------------------------------------------------------------------
# 1. The CRC trailer, checked on every read


@pytest.mark.parametrize("damage", ["content", "tag", "string", "trailer"])
def test_damage_mindspore_refuses_fails_every_write_and_creates_nothing(crc_files, damage, tmp_path):
    bad = crc_files[damage]
    with pytest.raises(ValueError) as refused:  # the range hpckpt checks is MindSpore's
        ms.load_checkpoint(str(bad), crc_check=True)
    causes = [refused.value]
    while causes[-1].__cause__ is not None:  # MindSpore wraps its own CRC error in a vaguer one
        causes.append(causes[-1].__cause__)
    assert any("crc check is failed" in str(e) for e in causes), causes
    for name, args, dest in writes(bad, tmp_path):
        # the str value left out: the first chunk located checks the whole file, even the bytes
        # of that value (damage "string") or of no entry at all (damage "trailer")
        result = runner.invoke(app, args + ["--exclude", "note"])
        one_error(result, 9, str(bad), "CRC-32 mismatch")
        assert not dest.exists(), name
    assert list(tmp_path.iterdir()) == []  # no staging left behind either


def test_sound_file_passes_the_same_check_mindspore_does(crc_files, tmp_path):
    good = crc_files["good"]
    loaded = ms.load_checkpoint(str(good), crc_check=True)
    for name, args, dest in writes(good, tmp_path):
        result = runner.invoke(app, args + ([] if name == "convert-ms" else ["--exclude", "note"]))
        assert result.exit_code == 0, (name, result.stderr)
        assert dest.exists(), name
    index = open_index(tmp_path / "a.safetensors")
    assert_bit_equal(read_box(index, index.tensors["w"]), loaded["w"].asnumpy(), "w")
    assert mc.verify_crc(tmp_path / "c.ckpt") is True
    assert ms.load_checkpoint(str(tmp_path / "c.ckpt"), crc_check=True)["note"] == "hi"


def test_crc_is_read_once_per_run_by_any_number_of_workers(tmp_path, monkeypatch):
    src = ms_save(tmp_path / "many.ckpt", {f"t{i}": np.full((4, 8), i, np.float32) for i in range(24)},
                  crc_check=True)
    calls = []
    real = crc_module.verify_crc
    monkeypatch.setattr(crc_module, "verify_crc", lambda path: calls.append(path) or real(path))
    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--jobs", "2", "--max-memory", "64"])
    assert result.exit_code == 0, result.stderr
    assert calls == [src]
    calls.clear()
    assert runner.invoke(app, ["verify", str(src)]).exit_code == 0  # file check and locates share it
    assert calls == [src]


def test_check_streams_in_blocks_and_in_memory_reads_are_checked(crc_files, monkeypatch):
    monkeypatch.setattr(checksums, "CRC_BLOCK_BYTES", 7)  # many reads, none aligned to a record
    assert mc.verify_crc(crc_files["good"]) is True
    with pytest.raises(CorruptDataError, match="CRC-32 mismatch"):
        mc.verify_crc(crc_files["content"])
    index = open_index(crc_files["content"])  # the index needs no data: it opens
    with pytest.raises(CorruptDataError, match="CRC-32 mismatch"):
        read_box(index, index.tensors["b"])  # reading into memory is a read too
    with pytest.raises(CorruptDataError, match="CRC-32 mismatch"):
        index.decode_value("note")


def test_inspect_reads_no_data_and_says_whether_a_trailer_is_there(crc_files, tmp_path):
    result = runner.invoke(app, ["inspect", "--json", "--no-values", str(crc_files["content"])])
    assert result.exit_code == 0, result.stderr  # metadata only: the damage is not looked for
    doc = json.loads(result.stdout)
    assert any("CRC-32 trailer present" in note for note in doc["notes"])
    assert [t["fqn"] for t in doc["tensors"]] == ["w", "b"]
    plain = ms_save(tmp_path / "plain.ckpt", {"w": W})
    doc = json.loads(runner.invoke(app, ["inspect", "--json", str(plain)]).stdout)
    assert not any("CRC" in note for note in doc.get("notes", []))
    result = runner.invoke(app, ["inspect", str(crc_files["good"])])
    assert "CRC-32 trailer present" in result.stdout
    # decoding a value is a read: a damaged file says so instead of showing the value
    doc = json.loads(runner.invoke(app, ["inspect", "--json", str(crc_files["content"])]).stdout)
    assert "CRC-32 mismatch" in doc["values"][0]["error"]


def test_verify_reports_the_mismatch_once(crc_files):
    result = runner.invoke(app, ["verify", "--json", str(crc_files["content"])])
    assert result.exit_code == 9
    findings = json.loads(result.stdout)["findings"]
    assert [f["kind"] for f in findings] == ["corrupt-data"] and "CRC-32 mismatch" in findings[0]["message"]


def test_values_only_write_is_checked_too(crc_files, tmp_path):
    out = tmp_path / "note.ckpt"
    one_error(runner.invoke(app, ["convert", str(crc_files["string"]), "--include", "note", "-o", str(out)]),
              9, "CRC-32 mismatch")
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# 2. Empty and zero-entry files


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("saved", [{}, []])
def test_what_save_checkpoint_of_nothing_writes_is_refused_everywhere(saved, crc, tmp_path):
    src = ms_save(tmp_path / "nothing.ckpt", saved, crc_check=crc)
    assert src.read_bytes() == (mc.CRC_MARK + bytes(10) if crc else b"")  # 0 bytes, or the trailer alone
    with pytest.raises(ValueError, match="empty"):
        ms.load_checkpoint(str(src))  # MindSpore refuses it too
    with pytest.raises(NotACheckpointError):
        open_index(src)
    out = tmp_path / "out"
    out.mkdir()
    commands = [("inspect", ["inspect", str(src)]), ("verify", ["verify", str(src)]),
                ("verify-json", ["verify", "--json", str(src)])]
    commands += [(name, args) for name, args, _dest in writes(src, out)]
    for name, args in commands:
        one_error(runner.invoke(app, args), 4, str(src), "no tensor and no value")
    assert list(out.iterdir()) == []


def test_hpckpt_writes_no_ckpt_it_would_refuse(tmp_path):
    from safetensors.numpy import save_file

    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    only_empty = tmp_path / "zero.safetensors"
    save_file({"z": np.zeros((0, 3), np.float32)}, str(only_empty))
    for src in (empty, only_empty):
        out = tmp_path / f"{src.stem}.ckpt"
        one_error(runner.invoke(app, ["convert", str(src), "-o", str(out)]), 4, "nothing to write")
        assert not out.exists()


# --------------------------------------------------------------------------------------------
# 3. Python scalars stored as 0-d tensors: reported as converted


def write_values(path: Path, values: dict, crc: bool = True):
    source = memory_index({"w": MemoryTensor.whole(dtype("float32"), W)}, values, framework="torch")
    writer = format_named("ms").writer(WriterOptions(name=path.name, crc=crc))
    return write_plan(whole_tensor_plan(source), source, writer, path, WriteSettings(sync=False), file_output=True)


def test_scalars_come_back_from_mindspore_as_tensors_and_are_reported(tmp_path):
    values = {"step": 5, "lr": 0.1, "half": 0.5, "flag": True, "note": "ünï"}
    written = write_values(tmp_path / "hp.ckpt", values)
    converted = dict(written.converted)
    assert sorted(converted) == ["flag", "half", "lr", "step"]  # the str stays a str
    assert converted["step"].startswith("int stored as a 0-d Int64 tensor") and "Parameter" in converted["step"]
    assert converted["flag"].startswith("bool stored as a 0-d Bool tensor")
    assert converted["half"].startswith("float stored as a 0-d Float32 tensor")
    assert converted["lr"].startswith("float 0.1, rounded to 0.10000000149011612,")
    assert written.skipped == ()

    loaded = ms.load_checkpoint(str(tmp_path / "hp.ckpt"), crc_check=True)
    assert loaded["note"] == "ünï"
    for name, ms_type in {"step": ms.int64, "lr": ms.float32, "half": ms.float32, "flag": ms.bool_}.items():
        assert isinstance(loaded[name], ms.Parameter) and loaded[name].shape == () and loaded[name].dtype == ms_type
    assert int(loaded["step"].asnumpy()) == 5 and float(loaded["lr"].asnumpy()) == float(np.float32(0.1))

    # exactly what MindSpore's own append_dict writes for the same values
    reference = ms_save(tmp_path / "ms.ckpt", {"w": W}, crc_check=True, append_dict=values)
    assert (tmp_path / "hp.ckpt").read_bytes() == reference.read_bytes()


def test_unstorable_values_are_skipped_with_their_reason(tmp_path):
    written = write_values(tmp_path / "x.ckpt", {"big": 2**70, "nul": "a\x00", "pair": (1, 2), "ok": 1})
    skipped = dict(written.skipped)
    assert sorted(skipped) == ["big", "nul", "pair"]
    assert "does not fit" in skipped["big"] and "NUL" in skipped["nul"] and "tuple" in skipped["pair"]
    assert [name for name, _ in written.converted] == ["ok"]
    assert sorted(ms.load_checkpoint(str(tmp_path / "x.ckpt"))) == ["ok", "w"]


def test_cli_report_lists_converted_scalars(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2), "step": 7, "lr": 1e-3, "name": "run"}, src)
    out = tmp_path / "out.ckpt"
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert sorted(c["name"] for c in report["converted"]) == ["lr", "step"]
    assert all("0-d" in c["reason"] for c in report["converted"])
    assert "converted (int stored as a 0-d Int64 tensor" in result.stderr


def test_scalar_tensors_read_from_a_ckpt_are_tensors_not_values(tmp_path):
    """MindSpore turns append_dict scalars into 0-d tensors; nothing in the file tells them from
    other 0-d tensors, so hpckpt reads them as what MindSpore loads: tensors, nothing converted."""
    src = ms_save(tmp_path / "ms.ckpt", {"w": W}, append_dict={"epoch": 3, "lr": 0.5, "flag": False, "tag": "x"})
    doc = json.loads(runner.invoke(app, ["inspect", "--json", str(src)]).stdout)
    shapes = {t["fqn"]: (t["dtype"], t["shape"]) for t in doc["tensors"]}
    assert shapes == {"w": ("float32", [3, 4]), "epoch": ("int64", []), "lr": ("float32", []), "flag": ("bool", [])}
    assert [(v["fqn"], v["value"]) for v in doc["values"]] == [("tag", "x")]

    out = tmp_path / "out.pt"
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["converted"] == []
    loaded = torch.load(out, weights_only=True)
    assert loaded["epoch"].shape == () and loaded["epoch"].dtype == torch.int64 and int(loaded["epoch"]) == 3
    assert loaded["tag"] == "x"


# --------------------------------------------------------------------------------------------
# 4. tensor_types: only those MindSpore loads are ever written


MS_REFUSES = ["Complex64", "Complex128", "Float8E4M3FN", "Float8E5M2", "HiFloat8"]


def load_one(path: Path, tensor_type: str, nbytes: int):
    path.write_bytes(mc.piece_header(b"t", (2,), tensor_type.encode(), nbytes) + bytes(nbytes))
    return ms.load_checkpoint(str(path))["t"]


@pytest.mark.parametrize("tensor_type", MS_REFUSES)
def test_mindspore_refuses_these_tensor_types(tensor_type, tmp_path):
    with pytest.raises(ValueError, match=tensor_type):
        load_one(tmp_path / "t.ckpt", tensor_type, 16)


def test_writer_writes_only_tensor_types_mindspore_loads(tmp_path):
    accepted, refused = [], []
    for d in all_dtypes():
        try:
            spelling = mc.writable_spelling(d)
        except UnsupportedDTypeError:
            refused.append(d.name)
            continue
        accepted.append(spelling)
        loaded = load_one(tmp_path / f"{d.name}.ckpt", spelling, 2 * d.itemsize)
        assert str(loaded.dtype) == spelling and loaded.shape == (2,), d.name
    assert sorted(accepted) == sorted(["Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32",
                                       "UInt64", "Float16", "BFloat16", "Float32", "Float64"])
    assert {"complex64", "complex128", "float8_e4m3fn", "float8_e5m2"} <= set(refused)


@pytest.mark.parametrize("torch_dtype", ["complex64", "complex128", "float8_e4m3fn", "float8_e5m2"])
def test_unloadable_dtype_is_refused_before_anything_is_written(torch_dtype, tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"ok": torch.ones(2), "bad": torch.zeros(3, dtype=getattr(torch, torch_dtype))}, src)
    out = tmp_path / "out.ckpt"
    one_error(runner.invoke(app, ["convert", str(src), "-o", str(out)]), 15, "bad", "cannot hold")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]


# --------------------------------------------------------------------------------------------
# MindSpore's own safetensors: its crc_num is checked, its int4 tensors are refused, not misread


def ms_safetensors(path, params: dict, **kwargs):
    import mindspore as ms
    from mindspore import Parameter, Tensor

    ms.save_checkpoint({k: Parameter(Tensor(v) if isinstance(v, np.ndarray) else v, name=k) for k, v in params.items()},
                       str(path), format="safetensors", **kwargs)
    return path


def test_mindspore_safetensors_crc_num_is_checked_by_every_read(tmp_path):
    import mindspore as ms

    good = ms_safetensors(tmp_path / "good.safetensors", {"b": np.arange(6, dtype=np.float32).reshape(2, 3),
                                                          "a": np.ones(4, np.float16)}, crc_check=True)
    assert set(ms.load_checkpoint(str(good), format="safetensors", crc_check=True)) == {"a", "b"}
    runner = CliRunner()
    assert runner.invoke(app, ["verify", str(good)]).exit_code == 0
    assert runner.invoke(app, ["convert", str(good), "-o", str(tmp_path / "ok.pt")]).exit_code == 0
    bad = tmp_path / "bad.safetensors"
    data = bytearray(good.read_bytes())
    data[-3] ^= 1  # a bit of a tensor's data
    bad.write_bytes(bytes(data))
    with pytest.raises(Exception):
        ms.load_checkpoint(str(bad), format="safetensors", crc_check=True)  # MindSpore refuses it too
    for argv in (["verify", str(bad)], ["convert", str(bad), "-o", str(tmp_path / "out.pt")],
                 ["consolidate", str(bad), "-o", str(tmp_path / "out.ckpt"), "--format", "ms"]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 9, (argv, result.stderr, result.stdout)
        assert "crc_num" in result.stderr + result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors", "good.safetensors", "ok.pt",
                                                          "ok.pt.hpckpt-manifest.jsonl"]


def test_mindspore_int4_in_safetensors_is_refused_not_read_as_int8(tmp_path):
    from mindspore import Tensor
    from mindspore.common import dtype as mstype

    path = ms_safetensors(tmp_path / "q.safetensors", {
        "q": Tensor(np.array([[1, 2], [3, 4]], dtype=np.int8), dtype=mstype.qint4x2), "w": np.ones(2, np.float32)})
    result = CliRunner().invoke(app, ["convert", str(path), "-o", str(tmp_path / "out.pt")])
    assert result.exit_code == 15, (result.stderr, result.stdout)
    assert "int4" in result.stderr.lower() and not (tmp_path / "out.pt").exists()
