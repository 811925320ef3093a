"""torch.save records parsed by hpckpt.core.codecs.torch_zip, checked bit-exactly against real torch."""

from __future__ import annotations

import io
import pickle
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpckpt.core.errors import CorruptDataError, MissingFileError, UnsafePickleError
from _util import read_location, torch_bytes
from hpckpt.core.codecs.torch_zip import TensorRecord, is_zip_record, load_record


def assert_same(record: TensorRecord, path: Path, t: torch.Tensor) -> None:
    assert record.dtype.torch == str(t.dtype)
    assert record.shape == tuple(t.shape)
    arr = read_location(record.location(path))
    assert arr.shape == tuple(t.shape)
    assert arr.tobytes() == torch_bytes(t)


def dtype_zoo() -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(0)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return OrderedDict(
        fp32=torch.randn(3, 4, generator=g),
        fp64=torch.randn(2, generator=g, dtype=torch.float64),
        fp16=torch.randn(5, generator=g).half(),
        bf16=torch.randn(2, 3, generator=g).to(torch.bfloat16),
        int64=torch.arange(-3, 4),
        int32=torch.tensor([1, -2], dtype=torch.int32),
        int16=torch.tensor([7, -8], dtype=torch.int16),
        int8=torch.tensor([-128, 0, 127], dtype=torch.int8),
        uint8=torch.tensor([0, 200, 255], dtype=torch.uint8),
        uint16=torch.tensor([1, 65535], dtype=torch.uint16),
        uint32=torch.tensor([3, 2**32 - 1], dtype=torch.uint32),
        uint64=torch.tensor([5], dtype=torch.uint64),
        bool=torch.tensor([True, False, True]),
        complex64=torch.randn(2, dtype=torch.complex64, generator=g),
        complex128=torch.randn(2, dtype=torch.complex128, generator=g),
        f8_e4m3fn=torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        f8_e5m2=torch.randn(4, generator=g).to(torch.float8_e5m2),
        f8_e4m3fnuz=torch.randn(2, generator=g).to(torch.float8_e4m3fnuz),
        f8_e5m2fnuz=torch.randn(2, generator=g).to(torch.float8_e5m2fnuz),
        scalar=torch.tensor(3.25),
        scalar_bf16=torch.tensor(-1.5, dtype=torch.bfloat16),
        empty=torch.empty(0, 3),
        empty_1d=torch.empty(0, dtype=torch.int64),
        transposed=base.t(),
        column=base[:, 1],
        rows_view=base[1:],  # shares base's storage with the two views above
        stepped=base[::2, 1::2],
        param=torch.nn.Parameter(torch.ones(2, 2)),
        requires_grad=torch.ones(3, requires_grad=True),
    )


@pytest.fixture(scope="module")
def zoo_file(tmp_path_factory) -> tuple[Path, "OrderedDict[str, torch.Tensor]"]:
    path = tmp_path_factory.mktemp("zoo") / "zoo.pt"
    tensors = dtype_zoo()
    torch.save({"tensors": tensors, "step": 3, "lr": 0.5, "name": "x", "milestones": [1, 2.0], "t": (1, "a")}, path)
    return path, tensors


def test_dtype_zoo_is_bit_exact(zoo_file):
    path, tensors = zoo_file
    tree = load_record(path)
    assert isinstance(tree["tensors"], OrderedDict)
    assert list(tree["tensors"]) == list(tensors)
    for name, t in tensors.items():
        record = tree["tensors"][name]
        assert isinstance(record, TensorRecord), name
        assert_same(record, path, t)


def test_bf16_raw_bits(zoo_file):
    path, tensors = zoo_file
    record = load_record(path)["tensors"]["bf16"]
    arr = read_location(record.location(path))
    assert arr.dtype == np.uint16
    np.testing.assert_array_equal(arr, tensors["bf16"].view(torch.int16).numpy().view(np.uint16))


def test_plain_values_come_back_as_python(zoo_file):
    path, _ = zoo_file
    tree = load_record(path)
    assert tree["step"] == 3 and type(tree["step"]) is int
    assert tree["lr"] == 0.5 and type(tree["lr"]) is float
    assert tree["name"] == "x"
    assert tree["milestones"] == [1, 2.0]
    assert tree["t"] == (1, "a")


def test_views_keep_strides_and_share_storage(zoo_file):
    path, _ = zoo_file
    rec = load_record(path)["tensors"]
    assert rec["transposed"].strides == (1, 4)
    assert rec["transposed"].location(path).strides == (1, 4)
    assert rec["column"].strides == (4,)
    assert rec["column"].location(path).strides == (4,)
    assert rec["rows_view"].location(path).strides is None
    assert rec["fp32"].location(path).strides is None
    # the three views of `base` point into one storage member
    assert rec["column"].offset == rec["transposed"].offset + 4
    assert rec["rows_view"].offset == rec["transposed"].offset + 16
    assert rec["column"].storage_nbytes == rec["rows_view"].storage_nbytes == 48


def test_storage_data_is_aligned(zoo_file):
    path, _ = zoo_file
    rec = load_record(path)["tensors"]
    assert rec["fp32"].offset % 64 == 0
    assert rec["scalar"].offset % 64 == 0


def test_zero_d_and_empty(zoo_file):
    path, _ = zoo_file
    rec = load_record(path)["tensors"]
    assert rec["scalar"].shape == () and rec["scalar"].location(path).nbytes == 4
    assert rec["empty"].shape == (0, 3) and rec["empty"].location(path).nbytes == 0


def test_record_embedded_in_larger_file(tmp_path):
    buf = io.BytesIO()
    t = torch.arange(10, dtype=torch.int16).reshape(2, 5)
    torch.save({"t": t, "v": 9}, buf)
    prefix, suffix = b"\xab" * 777, b"PK\x05\x06 trailing junk that is not part of the record"
    path = tmp_path / "blob.bin"
    path.write_bytes(prefix + buf.getvalue() + suffix)
    tree = load_record(path, len(prefix), len(buf.getvalue()))
    assert tree["v"] == 9
    assert tree["t"].offset > len(prefix)
    assert_same(tree["t"], path, t)
    assert is_zip_record(path, len(prefix))
    assert not is_zip_record(path, 0)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 5), cols=st.integers(1, 6),
    r0=st.integers(0, 4), c0=st.integers(0, 5), rstep=st.integers(1, 3), cstep=st.integers(1, 3),
    transpose=st.booleans(),
)
def test_random_views(rows, cols, r0, c0, rstep, cstep, transpose):
    base = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 1.5
    view = base[min(r0, rows - 1)::rstep, min(c0, cols - 1)::cstep]
    if transpose:
        view = view.t()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.pt"
        torch.save({"v": view}, path)
        assert_same(load_record(path)["v"], path, view)


# --- hostile and broken inputs -----------------------------------------------------------------


def write_zip(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> None:
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def test_hostile_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR."
    path = tmp_path / "evil.pt"
    write_zip(path, {"evil/data.pkl": payload, "evil/byteorder": b"little", "evil/.format_version": b"1"})
    with pytest.raises(UnsafePickleError) as info:
        load_record(path)
    assert "os.system" in str(info.value)
    assert not marker.exists()


def test_hostile_global_in_rebuild_position_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (eval, ("1+1",))

    path = tmp_path / "evil.pt"
    write_zip(path, {"a/data.pkl": pickle.dumps({"x": Evil()}, protocol=2), "a/byteorder": b"little"})
    with pytest.raises(UnsafePickleError, match="eval"):
        load_record(path)


@pytest.mark.parametrize("cut", [0.5, 0.9, -10])
def test_truncated_zip(tmp_path, zoo_file, cut):
    data = zoo_file[0].read_bytes()
    end = int(len(data) * cut) if cut > 0 else len(data) + cut
    path = tmp_path / "cut.pt"
    path.write_bytes(data[:end])
    with pytest.raises(CorruptDataError) as info:
        load_record(path)
    assert str(path) in str(info.value)


def test_range_outside_file(tmp_path, zoo_file):
    size = zoo_file[0].stat().st_size
    with pytest.raises(CorruptDataError, match="outside"):
        load_record(zoo_file[0], 10, size)


def test_missing_file(tmp_path):
    with pytest.raises(MissingFileError):
        load_record(tmp_path / "nope.pt")
    assert not is_zip_record(tmp_path / "nope.pt")


def test_compressed_member_is_refused(tmp_path):
    buf = io.BytesIO()
    torch.save({"t": torch.ones(100)}, buf)
    src = zipfile.ZipFile(buf)
    path = tmp_path / "deflated.pt"
    write_zip(path, {n: src.read(n) for n in src.namelist()}, compression=zipfile.ZIP_DEFLATED)
    with pytest.raises(CorruptDataError, match="compressed"):
        load_record(path)


def rewrite(src: Path, dst: Path, change: dict[str, bytes | None]) -> None:
    """Copy a torch.save zip, replacing (or dropping, for None) some members."""
    with zipfile.ZipFile(src) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    prefix = next(n for n in members if n.endswith("/data.pkl"))[: -len("data.pkl")]
    for name, data in change.items():
        if data is None:
            members.pop(prefix + name)
        else:
            members[prefix + name] = data
    write_zip(dst, members)


def test_missing_storage_member(tmp_path):
    src = tmp_path / "one.pt"
    torch.save({"t": torch.ones(3)}, src)
    rewrite(src, tmp_path / "broken.pt", {"data/0": None})
    with pytest.raises(CorruptDataError, match="data/0"):
        load_record(tmp_path / "broken.pt")


def test_short_storage_member(tmp_path):
    src = tmp_path / "one.pt"
    torch.save({"t": torch.ones(3)}, src)
    rewrite(src, tmp_path / "broken.pt", {"data/0": b"\0" * 8})
    with pytest.raises(CorruptDataError, match="storage"):
        load_record(tmp_path / "broken.pt")


def test_big_endian_record_is_refused(tmp_path):
    src = tmp_path / "one.pt"
    torch.save({"t": torch.ones(3)}, src)
    rewrite(src, tmp_path / "be.pt", {"byteorder": b"big"})
    with pytest.raises(CorruptDataError, match="byteorder"):
        load_record(tmp_path / "be.pt")


def test_garbage_pickle(tmp_path):
    path = tmp_path / "garbage.pt"
    write_zip(path, {"a/data.pkl": b"\x80\x02}q\x00(X", "a/byteorder": b"little"})
    with pytest.raises(CorruptDataError, match="data.pkl"):
        load_record(path)


def test_builtin_values_in_protocol_2(tmp_path):
    """torch.save pickles with protocol 2, which spells builtins as `__builtin__` (and range as xrange)."""
    values = {"s": {1, 2}, "f": frozenset([3]), "c": 1 + 2j, "sl": slice(1, 5, 2), "r": range(3),
              "ba": bytearray(b"xy"), "b": b"raw\x00", "n": None, "nested": OrderedDict(a=[(1, 2)])}
    path = tmp_path / "values.pt"
    torch.save(values, path)
    tree = load_record(path)
    assert tree == values
    assert all(type(tree[k]) is type(v) for k, v in values.items())


def test_tensor_with_python_state(tmp_path):
    """Attributes on a tensor or Parameter make torch pickle `_rebuild_from_type_v2`/`_with_state`."""
    t = torch.arange(4, dtype=torch.float32)
    t.note = "kept by torch, dropped by hpckpt"
    p = torch.nn.Parameter(torch.ones(2, 2))
    p.tag = 3
    path = tmp_path / "state.pt"
    torch.save({"t": t, "p": p, "empty_tail": t[4:]}, path)
    tree = load_record(path)
    assert_same(tree["t"], path, t)
    assert_same(tree["p"], path, p)
    assert tree["empty_tail"].shape == (0,) and tree["empty_tail"].location(path).nbytes == 0
