"""MindSpore `.ckpt`: hpckpt's streaming reader and writer against real MindSpore, no mocks.

Files are saved by `mindspore.save_checkpoint` (values wrapped in `Parameter`, since plain
`Tensor` values are dropped by it) and read back through hpckpt bit-exact; files written through
hpckpt's pipeline (a memory source -> the `.ckpt` writer -> engine -> commit) are loaded by
`mindspore.load_checkpoint` (with its CRC check) and compared bit for bit, bfloat16 by its raw
bits. Split tensors stay small: MindSpore's `SLICE_SIZE` (KiB) and
hpckpt's `SPLIT_BYTES` are lowered.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from _util import assert_bit_equal
from typer.testing import CliRunner

from hpckpt.cli.app import app
from hpckpt.converters import detect, format_named, open_index
from hpckpt.converters.base import WriterOptions
from hpckpt.converters.mindspore_ckpt import MindSporeCkptReader
from hpckpt.core.codecs import mindspore_ckpt as mc
from hpckpt.core.dtypes import dtype
from hpckpt.core.errors import (CorruptDataError, HpckptError, NotACheckpointError, UnknownFormatError,
                                UnsupportedDTypeError)
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.geometry.plan import whole_tensor_plan
from hpckpt.core.io.read import read_box
from hpckpt.core.io.write import Written, WriteSettings, write_plan

ms = pytest.importorskip("mindspore")
serialization = pytest.importorskip("mindspore.train.serialization")

runner = CliRunner()

# bfloat16 bit patterns: 1, -2, 0, -0, inf, -inf, smallest subnormal, ~3.14, ~0.33, max, min normal, -1
BF16_BITS = np.array([0x3F80, 0xC000, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x4049,
                      0x3EAB, 0x7F7F, 0x0080, 0xBF80], dtype=np.uint16).reshape(3, 4)


def bf16_as_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values that bfloat16 holds exactly, so converting them loses nothing."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def arrays() -> dict[str, np.ndarray]:
    """Every dtype MindSpore's .ckpt loader reads, 0-d and multi-dim (bf16 as raw bits)."""
    rng = np.random.default_rng(7)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((4, 2)).astype(np.float16),
        "f64": rng.standard_normal(3),
        "bf16": BF16_BITS,
        "i8": np.array([-128, -1, 0, 1, 127], np.int8),
        "u8": np.array([0, 1, 255], np.uint8),
        "i16": np.array([-32768, 7], np.int16),
        "i32": np.array([[-(2**31), -1], [0, 2**31 - 1]], np.int32),
        "i64": np.array([-(2**63), -1, 0, 2**63 - 1], np.int64),
        "u64": np.array([0, 2**64 - 1], np.uint64),
        "flags": np.array([[True, False, True]], np.bool_),
        "scalar": np.array(-7.25, np.float32),
        "scalar_i64": np.array(-5, np.int64),
        "cube": np.arange(2 * 3 * 4, dtype=np.int32).reshape(2, 3, 4),
    }


def ms_parameter(name: str, array: np.ndarray):
    if name.startswith("bf16"):
        tensor = ms.Tensor(bf16_as_f32(array), dtype=ms.bfloat16)
    else:
        tensor = ms.Tensor(array)
    return ms.Parameter(tensor, name=name)


def ms_bits(value) -> np.ndarray:
    """A loaded MindSpore Parameter as numpy (bfloat16 as its raw bits)."""
    if value.dtype == ms.bfloat16:
        return (value.astype(ms.float32).asnumpy().view(np.uint32) >> 16).astype(np.uint16)
    return value.asnumpy()


def ms_save(path: Path, data: dict[str, np.ndarray], **kwargs) -> Path:
    ms.save_checkpoint({k: ms_parameter(k, v) for k, v in data.items()}, str(path), **kwargs)
    return path


def writable(path: Path) -> Path:
    path.chmod(0o600)  # MindSpore saves files read-only
    return path


def read_all(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    index = open_index(path)
    tensors = {name: read_box(index, entry) for name, entry in index.tensors.items()}
    return tensors, {name: index.decode_value(name) for name in index.values}


def assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(actual) == list(expected)
    for name, array in expected.items():
        assert_bit_equal(actual[name], array, name)


def assert_one_error_line(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert lines and lines[0].startswith("error: "), stderr
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), stderr


# --------------------------------------------------------------------------------------------
# Files saved by MindSpore


SYNC_SPLIT = {"rows": np.arange(5 * 300, dtype=np.float32).reshape(5, 300),  # 6000 B: 6 pieces
              "bf16_split": np.arange(3 * 700, dtype=np.uint16).reshape(3, 700)}  # 4200 B: 5 pieces
ASYNC_SPLIT = {"rows": SYNC_SPLIT["rows"],  # np.array_split: 5 one-row pieces and an empty one
               "wide": np.arange(600, dtype=np.float32).reshape(1, 600)}  # 3 pieces, 2 empty


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ms")
    files = {
        "all": ms_save(root / "all.ckpt", arrays(), append_dict={"epoch": 3, "lr": 0.5, "note": "héllo wörld ∑"}),
        "crc": ms_save(root / "crc.ckpt", arrays(), crc_check=True),
        "enc": ms_save(root / "enc.ckpt", {"f32": arrays()["f32"]}, enc_key=b"0123456789abcdef"),
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serialization, "SLICE_SIZE", 1)  # KiB: split anything over 1 KiB
        files["sync_split"] = ms_save(root / "sync_split.ckpt", SYNC_SPLIT, crc_check=True)
        files["async_split"] = ms_save(root / "async_split.ckpt", ASYNC_SPLIT, async_save=True)
        serialization._wait_async_thread_save_ckpt()
    return files


def test_every_dtype_and_value_reads_back_bit_exact(saved):
    tensors, values = read_all(saved["all"])
    expected = arrays() | {"epoch": np.array(3, np.int64), "lr": np.array(0.5, np.float32)}
    assert_same(tensors, expected)
    assert values == {"note": "héllo wörld ∑"}
    index = open_index(saved["all"])
    assert (index.format, index.framework) == ("mindspore-ckpt", "mindspore")
    assert index.tensors["bf16"].dtype_spelling == "BFloat16" and index.tensors["scalar"].shape == ()
    assert index.tensors["cube"].shape == (2, 3, 4) and index.tensors["cube"].n_chunks == 1


def test_what_hpckpt_reads_is_what_mindspore_loads(saved):
    loaded = ms.load_checkpoint(str(saved["all"]))
    tensors, values = read_all(saved["all"])
    assert values["note"] == loaded["note"]
    for name, array in tensors.items():
        assert_bit_equal(array, ms_bits(loaded[name]), name)


def test_split_tensors_read_back_whole(saved):
    tensors, _ = read_all(saved["sync_split"])
    assert_same(tensors, SYNC_SPLIT)
    scan = mc.scan(saved["sync_split"])
    assert [len(t.pieces) for t in scan.tensors.values()] == [6, 5]
    # 1024-byte pieces do not hold whole 1200-byte rows: each becomes row-contiguous boxes
    assert open_index(saved["sync_split"]).tensors["rows"].n_chunks > 6

    tensors, _ = read_all(saved["async_split"])
    assert_same(tensors, ASYNC_SPLIT)
    pieces = {t.name: [p.content_nbytes for p in t.pieces] for t in mc.scan(saved["async_split"]).tensors.values()}
    assert pieces == {"rows": [1200] * 5 + [0], "wide": [2400, 0, 0]}


def test_crc_trailer_verified_and_corruption_found(saved, tmp_path):
    assert mc.verify_crc(saved["crc"]) is True
    assert mc.verify_crc(saved["all"]) is False
    assert mc.scan(saved["crc"]).has_crc
    assert runner.invoke(app, ["verify", str(saved["crc"])]).exit_code == 0
    assert_same(read_all(saved["crc"])[0], arrays())

    bad = writable(Path(shutil.copy(saved["crc"], tmp_path / "bad.ckpt")))
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of tensor data: the structure stays valid
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="crc"):
        ms.load_checkpoint(str(bad), crc_check=True)  # the damage is real to MindSpore too
    with pytest.raises(CorruptDataError, match="CRC-32 mismatch"):
        mc.verify_crc(bad)
    result = runner.invoke(app, ["verify", "--json", str(bad)])
    assert result.exit_code == CorruptDataError.exit_code
    findings = json.loads(result.stdout)["findings"]
    assert [f["kind"] for f in findings] == ["corrupt-data"] and "CRC-32" in findings[0]["message"]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_encrypted_file_refused_by_the_cli(saved, command):
    result = subprocess.run([sys.executable, "-m", "hpckpt", command, str(saved["enc"])],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == UnknownFormatError.exit_code, result.stderr
    assert_one_error_line(result.stderr)
    assert "encrypted" in result.stderr and "AES-GCM" in result.stderr


def test_int4_and_maptensor_refused(tmp_path):
    int4 = ms.Tensor(np.array([1, 2, 3, 4], np.int8), dtype=ms.qint4x2)
    ms.save_checkpoint({"q": ms.Parameter(int4, name="q")}, str(tmp_path / "int4.ckpt"))
    with pytest.raises(UnknownFormatError, match="Int4"):
        open_index(tmp_path / "int4.ckpt")
    assert "q" in mc.scan(tmp_path / "int4.ckpt").unsupported

    # MapParameter cannot be saved on CPU: a Value whose field 3 (maptensor) holds one TensorProto
    tensor = b"\x08\x02\x12\x05Int32\x1a\x08" + bytes(8)
    value = b"\x0a\x03emb" + b"\x1a" + bytes([len(tensor) + 2]) + b"\x0a" + bytes([len(tensor)]) + tensor
    (tmp_path / "map.ckpt").write_bytes(b"\x0a" + bytes([len(value)]) + value)
    result = runner.invoke(app, ["inspect", str(tmp_path / "map.ckpt")])
    assert result.exit_code == UnknownFormatError.exit_code
    assert_one_error_line(result.stderr)
    assert "maptensor" in result.stderr


def test_every_truncation_is_a_clean_error_or_a_prefix(saved, tmp_path):
    """A cut on a Value boundary is a valid shorter checkpoint (the format has no footer);
    any other cut is a CorruptDataError naming the offset, never another exception."""
    data = saved["all"].read_bytes()
    names = list(mc.scan(saved["all"]).tensors)
    cut_file = tmp_path / "cut.ckpt"
    errors = 0
    for cut in range(1, len(data)):
        cut_file.write_bytes(data[:cut])
        try:
            found = list(mc.scan(cut_file).tensors)
        except CorruptDataError as exc:
            assert "offset" in exc.message
            errors += 1
        else:
            assert found == names[: len(found)]
    assert errors > len(data) * 0.9
    cut_file.write_bytes(data[: len(data) // 2])
    result = runner.invoke(app, ["inspect", str(cut_file)])
    assert result.exit_code == CorruptDataError.exit_code
    assert_one_error_line(result.stderr)


def test_damaged_bytes_never_escape_as_other_exceptions(saved, tmp_path):
    """Every byte of a small file replaced in turn: index, tensors and values either read or fail
    with an HpckptError."""
    data = saved["all"].read_bytes()
    damaged = tmp_path / "damaged.ckpt"
    adapter = MindSporeCkptReader()
    outcomes = {"ok": 0, "refused": 0}
    for position in range(len(data)):
        for byte in (0x00, 0xFF, data[position] ^ 0x08):
            changed = bytearray(data)
            changed[position] = byte
            damaged.write_bytes(bytes(changed))
            try:
                index = adapter.read_index(damaged)
                for entry in index.tensors.values():
                    read_box(index, entry)
                for name in index.values:
                    index.decode_value(name)
            except HpckptError:
                outcomes["refused"] += 1
            else:
                outcomes["ok"] += 1
    assert outcomes["ok"] and outcomes["refused"]


def test_sniff_claims_ckpt_files_only(saved, tmp_path):
    adapter = MindSporeCkptReader()
    renamed = tmp_path / "weights.bin"
    shutil.copy(saved["all"], renamed)
    assert adapter.sniff(renamed) and detect(renamed).name == "mindspore-ckpt"
    (tmp_path / "notes.txt").write_text("\nhello, not a checkpoint\n")
    with zipfile.ZipFile(tmp_path / "lightning.ckpt", "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    for path in (tmp_path / "notes.txt", tmp_path / "lightning.ckpt"):
        assert not adapter.sniff(path)
        try:
            assert detect(path).name != "mindspore-ckpt"  # a torch.save .ckpt is another adapter's
        except NotACheckpointError:
            pass
    (tmp_path / "empty.ckpt").write_bytes(b"")  # what save_checkpoint({}) writes: claimed, then refused
    assert adapter.sniff(tmp_path / "empty.ckpt")
    with pytest.raises(NotACheckpointError, match="empty"):
        open_index(tmp_path / "empty.ckpt")


def test_cli_inspect_consolidate_reshard(saved, tmp_path):
    src = saved["sync_split"]
    result = runner.invoke(app, ["inspect", "--json", str(saved["all"])])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "mindspore-ckpt" and doc["values"][0]["value"] == "héllo wörld ∑"

    out = tmp_path / "out.safetensors"
    result = runner.invoke(app, ["consolidate", str(src), "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert_same(read_all(out)[0], dict(sorted(SYNC_SPLIT.items())))

    resharded = tmp_path / "resharded"
    result = runner.invoke(app, ["reshard", str(src), "-o", str(resharded), "--world-size", "2"])
    assert result.exit_code == 0, result.stderr
    assert runner.invoke(app, ["verify", str(resharded)]).exit_code == 0
    tensors, _ = read_all(resharded)
    assert_same({k: tensors[k] for k in SYNC_SPLIT}, SYNC_SPLIT)
    assert open_index(resharded).tensors["bf16_split"].dtype_spelling == "BFloat16"


def test_dims_zero_with_one_element_is_0d_as_mindspore_loads_it(tmp_path):
    path = tmp_path / "odd.ckpt"
    path.write_bytes(mc.piece_header(b"x", (0,), b"Float32", 4) + np.float32(2.5).tobytes())
    loaded = ms.load_checkpoint(str(path))
    assert loaded["x"].shape == () and float(loaded["x"].asnumpy()) == 2.5
    tensors, _ = read_all(path)
    assert_bit_equal(tensors["x"], np.array(2.5, np.float32), "x")


# --------------------------------------------------------------------------------------------
# Writing through the pipeline (MindSporeCkptWriter)


def write_with_hpckpt(path: Path, data: dict[str, np.ndarray], strings: dict[str, str] = {},
                      crc: bool = True, piece: int = 333, **settings) -> list[str]:
    """Write `data` (then `strings`, as plain `str` values) through the pipeline; a `piece`-byte
    `max_memory` makes the engine copy small tiles, not aligned to rows or splits. Returns the
    names the writer skipped."""
    source = memory_index({name: MemoryTensor.whole(dtype("bfloat16") if name.startswith("bf16") else dtype(array.dtype.name),
                                                    array)
                           for name, array in data.items()}, strings, framework="mindspore")
    writer = format_named("ms").writer(WriterOptions(name=path.name, crc=crc))
    written = write_plan(whole_tensor_plan(source), source, writer, path,
                         WriteSettings(sync=False, max_memory=piece, **settings), file_output=True)
    assert isinstance(written, Written)
    return [fqn for fqn, _reason in written.skipped]


def test_writer_output_loads_in_mindspore_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(mc, "SPLIT_BYTES", 1000)  # not a multiple of any row: pieces cut rows
    data = arrays() | SYNC_SPLIT | {"empty": np.zeros((0, 3), np.float32)}
    path = tmp_path / "hp.ckpt"
    skipped = write_with_hpckpt(path, data, {"note": "héllo", "blank": ""})
    assert skipped == ["empty"]
    del data["empty"]
    assert [len(t.pieces) for t in mc.scan(path).tensors.values() if t.name in SYNC_SPLIT] == [6, 5]

    loaded = ms.load_checkpoint(str(path), crc_check=True)
    assert loaded.pop("note") == "héllo" and loaded.pop("blank") == ""
    assert list(loaded) == list(data)
    for name, array in data.items():
        assert_bit_equal(ms_bits(loaded[name]), array, name)
        assert loaded[name].shape == array.shape

    tensors, values = read_all(path)
    assert_same(tensors, data)
    assert values == {"note": "héllo", "blank": ""}
    assert mc.verify_crc(path) is True
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_writer_matches_mindspore_byte_for_byte(tmp_path, monkeypatch):
    """Same entries, same split size, CRC on: the exact bytes `save_checkpoint` writes."""
    monkeypatch.setattr(serialization, "SLICE_SIZE", 1)
    monkeypatch.setattr(mc, "SPLIT_BYTES", 1024)
    data = arrays() | SYNC_SPLIT
    reference = ms_save(tmp_path / "ms.ckpt", data, crc_check=True, append_dict={"note": "ünïcode"})
    ours = tmp_path / "hp.ckpt"
    write_with_hpckpt(ours, data, {"note": "ünïcode"})
    assert ours.read_bytes() == reference.read_bytes()


class FailingProgress:
    """A progress report whose `advance` raises once a few bytes went by: a run failing mid-copy."""

    def start(self, total: int) -> None:
        self.seen = 0

    def advance(self, n: int) -> None:
        self.seen += n
        if self.seen > 4:
            raise RuntimeError("caller failed")


def test_writer_refuses_misuse_and_leaves_nothing(tmp_path):
    path = tmp_path / "x.ckpt"
    with pytest.raises(RuntimeError):
        write_with_hpckpt(path, {"a": np.zeros(2, np.float32)}, piece=4, progress=FailingProgress())
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(UnsupportedDTypeError, match="cannot hold"):
        write_with_hpckpt(path, {"c": np.zeros(1, np.complex64)})
    assert list(tmp_path.iterdir()) == []
    # (dropped: "remain", "twice", "never written", "closed before", "aborted" tested the
    # streaming CkptWriter's add_tensor/add_string/begin_tensor/write/end_tensor/close/abort API)

    write_with_hpckpt(path, {"p": np.ones(1, np.float32)})  # a failed run leaves an existing destination alone
    previous = path.read_bytes()
    with pytest.raises(RuntimeError):
        write_with_hpckpt(path, {"a": np.zeros(2, np.float32)}, {"s": "x"}, piece=4, force=True,
                          progress=FailingProgress())
    assert path.read_bytes() == previous and list(tmp_path.iterdir()) == [path]
