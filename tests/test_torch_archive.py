"""torch.save files written without torch, checked bit-exactly by real torch.load.

Two ways of producing a file: the codec alone (`TorchArchive`: declare, `layout(0)`, write
`fixed`, the tensor bytes at `tensor_extent` in odd-sized pieces out of order, `finish(crcs)`),
which lets values and tensors interleave in declaration order; and the real pipeline (a memory
source -> `TorchSaveFileWriter` -> engine -> commit), tensors first, then values.
"""

from __future__ import annotations

import math
import os
import struct
import tracemalloc
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.serialization
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _util import read_location, torch_bytes
from hpckpt.converters import format_named
from hpckpt.converters.base import WriterOptions
from hpckpt.core.io import checksums
from hpckpt.core.io.crc import crc32
from hpckpt.core import dtypes
from hpckpt.core.geometry.box import full_box
from hpckpt.core.codecs import torch_archive as ta
from hpckpt.core.errors import DestinationExistsError, EntryMismatchError
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.geometry.plan import whole_tensor_plan
from hpckpt.core.codecs.torch_archive import TorchArchive, archive_name_for
from hpckpt.core.codecs.torch_zip import TensorRecord, load_record
from hpckpt.core.io.write import WriteSettings, write_plan


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


# --------------------------------------------------------------------------------------------
# Producing files: the codec alone, and the real pipeline


def fill_archive(path: Path, archive: TorchArchive, data: dict[str, bytes], *, piece: int = 7) -> None:
    """Lay `archive` out at 0 and write it: fixed bytes, every tensor's bytes (`data[key]`) at its
    extent in `piece`-sized pieces, last piece first and last tensor first (odd sizes cut across
    elements), then the `finish` patches with each tensor's zlib CRC-32."""
    archive.layout(0)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, archive.size)
        for at, blob in archive.fixed:
            os.pwrite(fd, blob, at)
        crcs = {}
        for key in reversed(archive.tensor_keys()):
            at, nbytes = archive.tensor_extent(key)
            raw = memoryview(data[key])
            assert len(raw) == nbytes, key
            for start in reversed(range(0, nbytes, piece)):
                os.pwrite(fd, raw[start : start + piece], at + start)
            crcs[key] = zlib.crc32(raw)
        for at, blob in archive.finish(crcs):
            os.pwrite(fd, blob, at)
    finally:
        os.close(fd)


def write(path: Path, tensors, values=(), *, piece: int = 7, interleave: bool = True,
          archive_name: str | None = None) -> None:
    """Through the codec: declare tensors (values interleaved) and write each tensor's bytes in
    `piece`-sized pieces, out of order."""
    values = list(dict(values).items())
    archive = TorchArchive(archive_name or archive_name_for(path))
    data = {}
    for i, (name, t) in enumerate(tensors.items()):
        data[archive.add_tensor(name, dtypes.dtype(str(t.dtype)), tuple(t.shape))] = torch_bytes(t)
        if interleave and i < len(values):
            archive.add_value(*values[i])
    for name, value in values[len(tensors) if interleave else 0 :]:
        archive.add_value(name, value)
    fill_archive(path, archive, data, piece=piece)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as the numpy storage of its dtype (raw bits for bfloat16 and float8)."""
    kind = dtypes.dtype(str(t.dtype))
    return np.frombuffer(torch_bytes(t), dtype=kind.np).reshape(tuple(t.shape))


def memory_source(tensors, values=()):
    return memory_index({name: MemoryTensor.whole(dtypes.dtype(str(t.dtype)), as_numpy(t))
                         for name, t in tensors.items()}, dict(values))


def write_source(path: Path, source, *, max_memory: int = 37, **settings):
    """Through the real pipeline: plan -> `TorchSaveFileWriter` -> engine -> commit. A small
    `max_memory` makes the engine write many small, odd-sized tiles."""
    writer = format_named("pt").writer(WriterOptions(name=path.name, crc=True))
    return write_plan(whole_tensor_plan(source), source, writer, path,
                      WriteSettings(sync=False, max_memory=max_memory, **settings), file_output=True)


def write_pipeline(path: Path, tensors, values=(), **kwargs):
    return write_source(path, memory_source(tensors, values), **kwargs)


def expected_order(tensors, values) -> list[str]:
    names, values = [], list(dict(values))
    for i, name in enumerate(tensors):
        names.append(name)
        if i < len(values):
            names.append(values[i])
    return names + values[len(tensors) :]


def pipeline_order(tensors, values) -> list[str]:
    return list(tensors) + list(dict(values))


#: (producer, the order its dict loads in): every end-to-end property is checked for both.
PRODUCERS = {
    "codec": (write, expected_order),
    "pipeline": (write_pipeline, pipeline_order),
}
producers = pytest.mark.parametrize("produce, order", PRODUCERS.values(), ids=PRODUCERS.keys())


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


def members(path: Path) -> list[zipfile.ZipInfo]:
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC is right
        return zf.infolist()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=70_000), st.integers(0, 2**32 - 1), st.integers(1, 9))
def test_the_crc_is_zlib_s_whatever_the_buffer_and_the_pieces(data, start, parts):
    """`core.io.crc.crc32` (zlib-ng's) gives `zlib.crc32`'s values: from any running value, over
    the bytes in pieces, from bytes, bytearray, memoryview and numpy buffers (what the writers and
    the checks hand it)."""
    expected = zlib.crc32(data, start)
    for buffer in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert crc32(buffer, start) == expected
    crc, step = start, max(1, len(data) // parts)
    view = memoryview(data)
    for at in range(0, len(data), step):
        crc = crc32(view[at:at + step], crc)
    assert crc == expected
    assert crc32(data) == zlib.crc32(data)


# --------------------------------------------------------------------------------------------
# What torch and hpckpt load


@producers
def test_dtype_zoo_and_values_load_in_torch(tmp_path, produce, order):
    tensors = zoo()
    path = tmp_path / "zoo.pt"
    produce(path, tensors, VALUES)
    for mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert list(loaded) == order(tensors, VALUES)
        for name, t in tensors.items():
            assert_tensor_equal(loaded[name], t, name)
        for name, value in VALUES.items():
            assert_values_equal(loaded[name], value, name)
    bits = torch.load(path, weights_only=True)["bf16"].view(torch.int16)
    assert bits.flatten().tolist() == [0x3F80, 0x7FC0, -0x80, 0x0001, -0x8000, 0x4049]


@producers
def test_hpckpt_reader_reads_what_we_wrote(tmp_path, produce, order):
    tensors = zoo()
    path = tmp_path / "zoo.pt"
    produce(path, tensors, VALUES, **({"piece": 13} if produce is write else {"max_memory": 13}))
    tree = load_record(path)
    assert list(tree) == order(tensors, VALUES)
    for name, t in tensors.items():
        record = tree[name]
        assert isinstance(record, TensorRecord)
        assert record.dtype.torch == str(t.dtype) and record.shape == tuple(t.shape)
        assert record.offset % 64 == 0
        assert read_location(record.location(path)).tobytes() == torch_bytes(t)
    for name, value in VALUES.items():
        assert tree[name] == value


@pytest.mark.parametrize("produce", [write, write_pipeline], ids=["codec", "pipeline"])
def test_layout_matches_torch_save(tmp_path, monkeypatch, produce):
    """Same records, order, flags, 64-byte alignment as torch.save; torch's own offset
    calculation (which assumes miniz's layout) agrees with the real offsets."""
    tensors = zoo()
    (tmp_path / "ours").mkdir()
    ours, ref = tmp_path / "ours" / "ref.pt", tmp_path / "ref.pt"  # same name: same archive name
    if produce is write:
        write(ours, tensors, VALUES, interleave=False)
    else:
        write_pipeline(ours, tensors, VALUES)
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


@producers
def test_values_only_and_empty(tmp_path, produce, order):
    produce(tmp_path / "v.pt", {}, VALUES)
    loaded = torch.load(tmp_path / "v.pt", weights_only=True)
    assert_values_equal(dict(loaded), dict(VALUES))
    produce(tmp_path / "e.pt", {}, {})
    assert torch.load(tmp_path / "e.pt", weights_only=True) == {}


def test_numpy_shapes_default_name_and_strided_sources(tmp_path):
    """(Was the streaming API's write_tensor/write_tensor_from helpers.) Shapes may be numpy
    ints; the archive name defaults to "archive"; the pipeline copies a 1000-element tensor in
    many tiles and reads a strided (non-contiguous) array of a memory source correctly."""
    data = np.arange(1000, dtype=np.float32)
    path = tmp_path / "h.pt"
    archive = TorchArchive()
    keys = [archive.add_tensor("from_file", "float32", (10, 100)),
            archive.add_tensor("one_buffer", "int16", np.array([2, 3]).astype(np.int64))]
    fill_archive(path, archive, {keys[0]: data.tobytes(), keys[1]: np.arange(6, dtype=np.int16).tobytes()}, piece=333)
    loaded = torch.load(path, weights_only=True)
    assert np.array_equal(loaded["from_file"].numpy().ravel(), data)
    assert loaded["one_buffer"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert zipfile.ZipFile(path).namelist()[0] == "archive/data.pkl"

    strided = np.arange(8, dtype=np.float16).reshape(4, 2)[:, 0]
    source = memory_index({"generator": MemoryTensor.whole(dtypes.dtype("float32"), data),
                           "strided": MemoryTensor.whole(dtypes.dtype("float16"), strided)})
    write_source(tmp_path / "ünï.pt", source, max_memory=37)
    loaded = torch.load(tmp_path / "ünï.pt", weights_only=True)
    assert np.array_equal(loaded["generator"].numpy(), data)
    assert loaded["strided"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert zipfile.ZipFile(tmp_path / "ünï.pt").namelist()[0] == "archive/data.pkl"


def test_pipeline_output_matches_the_codec_byte_for_byte(tmp_path, monkeypatch):
    """The pipeline (engine tiles, CRCs read back on workers, descriptors patched by `finish`)
    gives exactly the bytes of the codec written by hand, zip64 included."""
    tensors = zoo()
    for limit in (ta.ZIP64_LIMIT, 300):
        monkeypatch.setattr(ta, "ZIP64_LIMIT", limit)
        streamed, placed = tmp_path / f"s{limit}" / "a.pt", tmp_path / f"p{limit}" / "a.pt"
        streamed.parent.mkdir()
        placed.parent.mkdir()
        write(streamed, tensors, VALUES, interleave=False)
        write_pipeline(placed, tensors, VALUES, max_memory=5)
        assert placed.read_bytes() == streamed.read_bytes()
        members(placed)  # zipfile checks every CRC
    loaded = torch.load(placed, weights_only=True, mmap=True)
    for name, t in tensors.items():
        assert_tensor_equal(loaded[name], t, name)


# --------------------------------------------------------------------------------------------
# Failures: nothing written, an existing destination untouched


def two_tensors(t=None):
    """A memory source of t: float32[4] and u: int8[2]; `t` replaces t's array (any size)."""
    t = np.zeros(4, np.float32) if t is None else t
    return memory_index({"t": MemoryTensor(dtypes.dtype("float32"), (4,), [(full_box((4,)), t)]),
                         "u": MemoryTensor.whole(dtypes.dtype("int8"), np.zeros(2, np.int8))})


class Failing:
    """A progress report whose `advance` raises `error` once `after` bytes went by."""

    def __init__(self, error: BaseException, after: int = 0):
        self.error, self.after, self.seen = error, after, 0

    def start(self, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        self.seen += n
        if self.seen > self.after:
            raise self.error


def test_copy_that_fails_or_falls_short_leaves_no_file(tmp_path):
    """(Was: an in-place fill that raised or wrote too few bytes.) The copy fails mid-way."""
    for source, settings_ in ((two_tensors(np.zeros(3, np.float32)), {}),
                              (two_tensors(), {"progress": Failing(ZeroDivisionError("boom"), after=8)})):
        with pytest.raises((EntryMismatchError, ZeroDivisionError)):
            write_source(tmp_path / "x.pt", source, max_memory=4, **settings_)
        assert list(tmp_path.iterdir()) == []


def test_too_many_bytes_raises_and_leaves_no_file(tmp_path):
    """(Was: write_bytes past the declared size.) An array larger than its declared shape."""
    with pytest.raises(EntryMismatchError, match=r"float32\[5\], not float32\[4\]"):
        write_source(tmp_path / "x.pt", two_tensors(np.zeros(5, np.float32)))
    assert list(tmp_path.iterdir()) == []


def test_too_few_bytes_raises_and_leaves_no_file(tmp_path):
    """(Was: end_tensor before the declared size.) An array smaller than its declared shape, or
    of a narrower dtype."""
    for short in (np.zeros(3, np.float32), np.zeros(4, np.float16)):
        with pytest.raises(EntryMismatchError, match=r"not float32\[4\]"):
            write_source(tmp_path / "x.pt", two_tensors(short))
        assert list(tmp_path.iterdir()) == []


def test_finish_needs_every_tensors_crc(tmp_path):
    """(Was: missing or out-of-order tensors.) Tensors may be filled in any order (the codec
    helper writes them last first), but the archive cannot be finished without the CRC of each
    declared non-empty tensor."""
    archive = TorchArchive()
    t, u = archive.add_tensor("t", "float32", (4,)), archive.add_tensor("u", "int8", (2,))
    archive.layout(0)
    with pytest.raises(KeyError):
        archive.finish({t: 0})
    assert archive.finish({t: 0, u: 0})


def test_exception_mid_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.pt"
    write_source(path, two_tensors())  # (--force replaces only a file hpckpt recognises)
    previous = path.read_bytes()
    with pytest.raises(DestinationExistsError):
        write_source(path, two_tensors())  # force=False: an existing file is refused
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == previous
    with pytest.raises(KeyboardInterrupt):
        write_source(path, two_tensors(), max_memory=4, force=True, progress=Failing(KeyboardInterrupt(), after=8))
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == previous
    write_source(path, two_tensors(), force=True)  # a successful forced run replaces it
    assert list(tmp_path.iterdir()) == [path]
    assert torch.load(path, weights_only=True)["t"].tolist() == [0.0] * 4


def test_bad_declarations_are_refused_before_any_write(tmp_path):
    archive = TorchArchive(archive_name_for(tmp_path / "x.pt"))
    archive.add_value("ok", 1)
    with pytest.raises(TypeError, match=r"bad\[1\]\['k'\]: cannot save a numpy.float32"):
        archive.add_value("bad", [1, {"k": np.float32(1)}])
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="contains itself"):
        archive.add_value("loop", loop)
    with pytest.raises(ValueError, match="declared twice"):
        archive.add_tensor("ok", "float32", (1,))
    with pytest.raises(ValueError, match="non-negative"):
        archive.add_tensor("neg", "float32", (2, -1))
    with pytest.raises(ValueError, match="non-negative"):
        archive.add_tensor("flag", "float32", (True,))
    assert list(tmp_path.iterdir()) == []
    archive.add_value("bad", "fine now")  # failed declarations left nothing behind
    fill_archive(tmp_path / "x.pt", archive, {})
    assert torch.load(tmp_path / "x.pt", weights_only=True) == {"ok": 1, "bad": "fine now"}
    with pytest.raises(RuntimeError):
        archive.add_value("late", 1)

    # the pipeline writes the numpy scalar as the Python number torch loads, and says so; a value
    # torch cannot load at all is left out and named, never an internal error
    import datetime

    written = write_source(tmp_path / "y.pt", memory_index({}, {"bad": [1, {"k": np.float32(1)}],
                                                                "when": datetime.date(2026, 1, 2)}))
    assert [fqn for fqn, _ in written.converted] == ["bad"] and [fqn for fqn, _ in written.skipped] == ["when"]
    assert torch.load(tmp_path / "y.pt", weights_only=True) == {"bad": [1, {"k": 1.0}]}


@producers
def test_zip64_path_with_lowered_limit(tmp_path, monkeypatch, produce, order):
    monkeypatch.setattr(ta, "ZIP64_LIMIT", 300)
    tensors = OrderedDict(
        small=torch.arange(5, dtype=torch.int8),  # header below the limit...
        big=torch.randn(200),  # 800 bytes: sizes in zip64 fields
        after=torch.arange(3, dtype=torch.int64),  # header offset in a zip64 field
        empty=torch.empty(0, 2, dtype=torch.bfloat16),
    )
    path = tmp_path / "z64.pt"
    produce(path, tensors, {"v": [1, 2]}, **({"piece": 61} if produce is write else {"max_memory": 61}))
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
    """64 MiB written through the pipeline with 1 MiB of copy memory: the pipeline holds
    nothing of the tensor, only its tile buffers and the engine's CRC read-back buffer
    (`checksums.CRC_BLOCK_BYTES`, which `max_memory` does not bound)."""
    array = np.ones(64 << 20, np.uint8)  # the source's own memory, allocated before tracing
    source = memory_index({"t": MemoryTensor.whole(dtypes.dtype("uint8"), array)})
    tracemalloc.start()
    try:
        write_source(tmp_path / "m.pt", source, max_memory=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < checksums.CRC_BLOCK_BYTES + (4 << 20)
    assert (tmp_path / "m.pt").stat().st_size > 64 << 20


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
    root = tmp_path_factory.mktemp("h")
    (root / "codec").mkdir()
    path, codec = root / "r.pt", root / "codec" / "r.pt"
    write(path, tensors, {"seed": seed}, piece=piece)
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == expected_order(tensors, {"seed": seed})
    for name, t in tensors.items():
        assert_tensor_equal(loaded[name], t, name)

    pipeline = root / "pipeline.pt"
    write_pipeline(pipeline, tensors, {"seed": seed}, max_memory=piece)
    loaded = torch.load(pipeline, weights_only=True)
    assert list(loaded) == pipeline_order(tensors, {"seed": seed})
    for name, t in tensors.items():
        assert_tensor_equal(loaded[name], t, name)
    write(codec, tensors, {"seed": seed}, piece=piece, interleave=False, archive_name="pipeline")
    assert pipeline.read_bytes() == codec.read_bytes()
