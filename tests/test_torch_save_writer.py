"""TorchSaveWriter: files written without torch, checked bit-exactly by real torch.load."""

from __future__ import annotations

import io
import math
import os
import struct
import tracemalloc
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.serialization
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _util import read_location, torch_bytes
from hpckpt.core import dtypes
from hpckpt.core import torch_save_writer as tsw
from hpckpt.core.torch_save_writer import TorchSaveWriter, archive_name_for
from hpckpt.core.torch_zip import TensorRecord, load_record


def pieces(data: bytes, size: int):
    """Feed bytes in pieces of `size` (odd sizes cut across elements)."""
    view = memoryview(data)
    return [view[i : i + size] for i in range(0, len(data), size)]


def zoo() -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(1)
    bf16_bits = torch.tensor([0x3F80, 0x7FC0, 0xFF80, 0x0001, 0x8000, 0x4049], dtype=torch.int32).to(torch.int16)
    return OrderedDict(
        fp32=torch.randn(3, 5, generator=g),
        bf16=bf16_bits.view(torch.bfloat16).reshape(2, 3),  # raw bits, NaN and -inf included
        fp16=torch.randn(7, generator=g).half(),
        fp64=torch.randn(2, generator=g, dtype=torch.float64),
        int64=torch.tensor([-(2**63), -1, 0, 2**63 - 1]),
        int32=torch.tensor([-7, 2**31 - 1], dtype=torch.int32),
        int16=torch.tensor([-300, 5], dtype=torch.int16),
        int8=torch.tensor([-128, 0, 127], dtype=torch.int8),
        uint8=torch.tensor([0, 200, 255], dtype=torch.uint8),
        uint16=torch.tensor([1, 65535], dtype=torch.uint16),
        uint32=torch.tensor([3, 2**32 - 1], dtype=torch.uint32),
        uint64=torch.tensor([5, 2**40], dtype=torch.uint64),
        bool=torch.tensor([True, False, True]),
        complex64=torch.randn(3, dtype=torch.complex64, generator=g),
        complex128=torch.randn(2, dtype=torch.complex128, generator=g),
        f8_e4m3fn=torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        f8_e5m2=torch.randn(4, generator=g).to(torch.float8_e5m2),
        scalar=torch.tensor(3.25),
        empty=torch.empty(0, 4),
        cube=torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
    )


VALUES = OrderedDict(
    step=1234,
    lr=3e-4,
    name="run-α",
    milestones=[10, 20, 2**70, -(2**40)],
    nested={"a": {"b": (1, "two", None), "c": [True, False]}, 7: b"\x00\xffraw"},
    shape=(2, 3),
    nothing=None,
    ordered=OrderedDict(z=1, a=2),
    extras=[{1, 2}, 1 + 2j, bytearray(b"ab"), float("inf"), -0.0, (), [], {}],
)


def write(path: Path, tensors, values=(), *, piece: int = 7, interleave: bool = True, **kwargs) -> None:
    """Declare tensors (values interleaved) and stream each tensor's bytes in `piece`-sized pieces."""
    values = list(dict(values).items())
    with TorchSaveWriter(path, **kwargs) as w:
        for i, (name, t) in enumerate(tensors.items()):
            w.add_tensor(name, dtypes.dtype(str(t.dtype)), tuple(t.shape))
            if interleave and i < len(values):
                w.add_value(*values[i])
        for name, value in values[len(tensors) if interleave else 0 :]:
            w.add_value(name, value)
        for name, t in tensors.items():
            w.begin_tensor(name)
            for p in pieces(torch_bytes(t), piece):
                w.write_bytes(p)
            w.end_tensor()


def expected_order(tensors, values) -> list[str]:
    names, values = [], list(dict(values))
    for i, name in enumerate(tensors):
        names.append(name)
        if i < len(values):
            names.append(values[i])
    return names + values[len(tensors) :]


def assert_tensor_equal(loaded: torch.Tensor, original: torch.Tensor, name: str) -> None:
    assert loaded.dtype == original.dtype, name
    assert loaded.shape == original.shape, name
    assert loaded.stride() == original.contiguous().stride(), name
    assert torch_bytes(loaded) == torch_bytes(original), name


def assert_values_equal(loaded, expected, where: str = "") -> None:
    """Equal and of exactly the same types, recursively (NaN-free values)."""
    assert type(loaded) is type(expected), f"{where}: {type(loaded)} != {type(expected)}"
    if isinstance(expected, dict):
        assert list(loaded) == list(expected), where
        for k in expected:
            assert_values_equal(loaded[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(loaded) == len(expected), where
        for i, (a, b) in enumerate(zip(loaded, expected)):
            assert_values_equal(a, b, f"{where}[{i}]")
    else:
        assert loaded == expected, where
        if isinstance(expected, float):
            assert math.copysign(1, loaded) == math.copysign(1, expected), where


def test_dtype_zoo_and_values_load_in_torch(tmp_path):
    tensors = zoo()
    path = tmp_path / "zoo.pt"
    write(path, tensors, VALUES)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert list(loaded) == expected_order(tensors, VALUES)
        for name, t in tensors.items():
            assert_tensor_equal(loaded[name], t, name)
        for name, value in VALUES.items():
            assert_values_equal(loaded[name], value, name)
    bits = torch.load(path, weights_only=True)["bf16"].view(torch.int16)
    assert bits.flatten().tolist() == [0x3F80, 0x7FC0, -0x80, 0x0001, -0x8000, 0x4049]


def test_hpckpt_reader_reads_what_we_wrote(tmp_path):
    tensors = zoo()
    path = tmp_path / "zoo.pt"
    write(path, tensors, VALUES, piece=13)
    tree = load_record(path)
    assert list(tree) == expected_order(tensors, VALUES)
    for name, t in tensors.items():
        record = tree[name]
        assert isinstance(record, TensorRecord)
        assert record.dtype.torch == str(t.dtype) and record.shape == tuple(t.shape)
        assert record.offset % 64 == 0
        assert read_location(record.location(path)).tobytes() == torch_bytes(t)
    for name, value in VALUES.items():
        assert tree[name] == value


def members(path: Path) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC is right
        return zf.infolist()


def test_layout_matches_torch_save(tmp_path, monkeypatch):
    """Same records, order, flags, 64-byte alignment as torch.save; torch's own offset
    calculation (which assumes miniz's layout) agrees with the real offsets."""
    tensors = zoo()
    ours, ref = tmp_path / "ours.pt", tmp_path / "ref.pt"
    write(ours, tensors, VALUES, interleave=False, archive_name="ref")
    torch.save(OrderedDict(**tensors, **VALUES), ref)
    a, b = members(ours), members(ref)
    assert [m.filename for m in a] == [m.filename for m in b]
    assert [m.flag_bits for m in a] == [m.flag_bits for m in b]
    assert [m.compress_type for m in a] == [zipfile.ZIP_STORED] * len(a)
    with zipfile.ZipFile(ours) as zo, zipfile.ZipFile(ref) as zr:
        for m in a:
            if m.filename not in ("ref/data.pkl", "ref/.data/serialization_id"):
                assert zo.read(m) == zr.read(m.filename), m.filename
        serial = zo.read("ref/.data/serialization_id")
    assert len(serial) == 40 and serial.isdigit()
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # torch checks computed == real offsets
    config = torch.utils.serialization.config.load
    config.calculate_storage_offsets = True  # (monkeypatch.setattr would delete it on undo)
    try:
        loaded = torch.load(ours, weights_only=True, mmap=True)
    finally:
        config.calculate_storage_offsets = False
    for name, t in tensors.items():
        assert_tensor_equal(loaded[name], t, name)


def test_archive_name_follows_torch():
    assert archive_name_for("/x/model.final.pt") == "model.final"
    assert archive_name_for("noext") == "noext"
    assert archive_name_for("ünï.pt") == "archive"
    assert archive_name_for(".pt") == "archive"


def test_values_only_and_empty(tmp_path):
    write(tmp_path / "v.pt", {}, VALUES)
    loaded = torch.load(tmp_path / "v.pt", weights_only=True)
    assert_values_equal(dict(loaded), dict(VALUES))
    TorchSaveWriter(tmp_path / "e.pt").close()
    assert torch.load(tmp_path / "e.pt", weights_only=True) == {}


def test_write_tensor_helpers(tmp_path):
    data = np.arange(1000, dtype=np.float32)
    source = io.BytesIO(b"junk" + data.tobytes() + b"tail")
    path = tmp_path / "h.pt"
    with TorchSaveWriter(path, archive_name="archive") as w:
        w.add_tensor("from_file", "float32", (10, 100))
        w.add_tensor("one_buffer", "int16", np.array([2, 3]).astype(np.int64))
        w.add_tensor("generator", "float32", (1000,))
        assert w.next_tensor == "from_file"
        w.write_tensor_from("from_file", source, offset=4, chunk_bytes=333)
        w.write_tensor("one_buffer", np.arange(6, dtype=np.int16).reshape(2, 3))
        w.write_tensor("generator", (data[i : i + 37] for i in range(0, 1000, 37)))
        assert w.next_tensor is None
    loaded = torch.load(path, weights_only=True)
    assert np.array_equal(loaded["from_file"].numpy().ravel(), data)
    assert loaded["one_buffer"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert np.array_equal(loaded["generator"].numpy(), data)
    assert zipfile.ZipFile(path).namelist()[0] == "archive/data.pkl"


def write_in_place(path: Path, tensors, values=(), **kwargs) -> None:
    """Like `write`, but every tensor is placed by a fill callback with positioned writes."""
    with TorchSaveWriter(path, **kwargs) as w:
        for name, t in tensors.items():
            w.add_tensor(name, dtypes.dtype(str(t.dtype)), tuple(t.shape))
        for name, value in dict(values).items():
            w.add_value(name, value)
        for name, t in tensors.items():
            data = torch_bytes(t)

            def fill(fd, offset, data=data):
                for start in range(0, len(data), 5):  # several small pwrites, out of order
                    os.pwrite(fd, data[start : start + 5], offset + start)

            w.write_tensor_in_place(name, fill)


def test_in_place_tensors_match_streamed_ones_byte_for_byte(tmp_path, monkeypatch):
    """The in-place path (data placed by the caller, CRC read back on a thread, descriptors
    patched at close) gives exactly the bytes of the streaming path, zip64 included."""
    tensors = zoo()
    for limit in (tsw.ZIP64_LIMIT, 300):
        monkeypatch.setattr(tsw, "ZIP64_LIMIT", limit)
        streamed, placed = tmp_path / f"s{limit}" / "a.pt", tmp_path / f"p{limit}" / "a.pt"
        streamed.parent.mkdir()
        placed.parent.mkdir()
        write(streamed, tensors, VALUES, interleave=False)
        write_in_place(placed, tensors, VALUES)
        assert placed.read_bytes() == streamed.read_bytes()
        members(placed)  # zipfile checks every CRC
    loaded = torch.load(placed, weights_only=True, mmap=True)
    for name, t in tensors.items():
        assert_tensor_equal(loaded[name], t, name)


def test_in_place_fill_that_fails_or_falls_short_leaves_no_file(tmp_path):
    for fill in (lambda fd, offset: os.pwrite(fd, b"\0" * 3, offset),
                 lambda fd, offset: 1 / 0):
        w = single_tensor_writer(tmp_path / "x.pt")
        with pytest.raises((ValueError, ZeroDivisionError)):
            w.write_tensor_in_place("t", fill)
        assert list(tmp_path.iterdir()) == []


def single_tensor_writer(path: Path) -> TorchSaveWriter:
    w = TorchSaveWriter(path)
    w.add_tensor("t", "float32", (4,))
    w.add_tensor("u", "int8", (2,))
    return w


def test_too_many_bytes_raises_and_leaves_no_file(tmp_path):
    w = single_tensor_writer(tmp_path / "x.pt")
    w.begin_tensor("t")
    w.write_bytes(b"\0" * 15)
    with pytest.raises(ValueError, match="17 bytes given, only 16 expected"):
        w.write_bytes(b"\0\0")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="failed"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_too_few_bytes_raises_and_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="15 bytes given, 16 expected"):
        with single_tensor_writer(tmp_path / "x.pt") as w:
            w.write_tensor("t", b"\0" * 15)
    assert list(tmp_path.iterdir()) == []


def test_missing_or_out_of_order_tensors_raise(tmp_path):
    with pytest.raises(ValueError, match="1 declared tensor"):
        with single_tensor_writer(tmp_path / "x.pt") as w:
            w.write_tensor("t", b"\0" * 16)
    with pytest.raises(ValueError, match="out of order: expected 't'"):
        with single_tensor_writer(tmp_path / "x.pt") as w:
            w.begin_tensor("u")
    with pytest.raises(ValueError, match="C-contiguous"):
        with single_tensor_writer(tmp_path / "x.pt") as w:
            w.write_tensor("t", np.zeros((4, 2), np.float16)[:, 0])
    assert list(tmp_path.iterdir()) == []


def test_exception_mid_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.pt"
    path.write_bytes(b"previous")
    with pytest.raises(KeyboardInterrupt):
        with single_tensor_writer(path) as w:
            w.begin_tensor("t")
            w.write_bytes(b"\0" * 8)
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"previous"
    w = single_tensor_writer(path)
    w.write_tensor("t", b"\0" * 16)
    del w  # dropped without close(): its temporary file goes too
    assert list(tmp_path.iterdir()) == [path]


def test_bad_declarations_are_refused_before_any_write(tmp_path):
    w = TorchSaveWriter(tmp_path / "x.pt")
    w.add_value("ok", 1)
    with pytest.raises(TypeError, match=r"bad\[1\]\['k'\]: cannot save a numpy.float32"):
        w.add_value("bad", [1, {"k": np.float32(1)}])
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        w.add_value("loop", loop)
    with pytest.raises(ValueError, match="declared twice"):
        w.add_tensor("ok", "float32", (1,))
    with pytest.raises(ValueError, match="non-negative"):
        w.add_tensor("neg", "float32", (2, -1))
    with pytest.raises(ValueError, match="non-negative"):
        w.add_tensor("flag", "float32", (True,))
    assert list(tmp_path.iterdir()) == []
    w.add_value("bad", "fine now")  # failed declarations left nothing behind
    w.close()
    assert torch.load(tmp_path / "x.pt", weights_only=True) == {"ok": 1, "bad": "fine now"}
    with pytest.raises(RuntimeError):
        w.add_value("late", 1)


def test_zip64_path_with_lowered_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(tsw, "ZIP64_LIMIT", 300)
    tensors = OrderedDict(
        small=torch.arange(5, dtype=torch.int8),  # header below the limit...
        big=torch.randn(200),  # 800 bytes: sizes in zip64 fields
        after=torch.arange(3, dtype=torch.int64),  # header offset in a zip64 field
        empty=torch.empty(0, 2, dtype=torch.bfloat16),
    )
    path = tmp_path / "z64.pt"
    write(path, tensors, {"v": [1, 2]}, piece=61)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        for name, t in tensors.items():
            assert_tensor_equal(loaded[name], t, name)
    tree = load_record(path)
    assert read_location(tree["big"].location(path)).tobytes() == torch_bytes(tensors["big"])
    raw = path.read_bytes()
    end = raw[-22:]
    assert struct.unpack("<IHHHHIIH", end)[5:7] == (0xFFFFFFFF, 0xFFFFFFFF)  # cd size/offset in zip64 record
    big = next(m for m in members(path) if m.filename == "z64/data/1")
    assert big.extra[:2] == b"\x01\x00" and big.file_size == 800


def test_memory_stays_bounded(tmp_path):
    """32 MiB streamed in 1 MiB pieces: the writer holds nothing of the tensor."""
    piece = bytes(1 << 20)
    tracemalloc.start()
    try:
        with TorchSaveWriter(tmp_path / "m.pt", fsync=False) as w:
            w.add_tensor("t", "uint8", (32 << 20,))
            w.write_tensor("t", (piece for _ in range(32)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    assert (tmp_path / "m.pt").stat().st_size > 32 << 20


DTYPE_NAMES = ["float32", "bfloat16", "float16", "int64", "int8", "uint8", "bool", "complex64",
               "uint16", "float8_e5m2"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPE_NAMES), st.lists(st.integers(0, 5), max_size=3)),
        max_size=5,
    ),
    piece=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_dtypes_and_pieces(tmp_path_factory, specs, piece, seed):
    rng = np.random.default_rng(seed)
    tensors = OrderedDict()
    for i, (name, shape) in enumerate(specs):
        dtype = getattr(torch, name)
        raw = rng.integers(0, 256, math.prod(shape) * dtypes.dtype(name).itemsize, dtype=np.uint8)
        if name == "bool":
            raw &= 1
        t = torch.empty(shape, dtype=dtype)
        t.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(raw))
        tensors[f"t{i}"] = t
    path = tmp_path_factory.mktemp("h") / "r.pt"
    write(path, tensors, {"seed": seed}, piece=piece, fsync=False)
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == expected_order(tensors, {"seed": seed})
    for name, t in tensors.items():
        assert_tensor_equal(loaded[name], t, name)
