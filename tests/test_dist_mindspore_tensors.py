"""`hpckpt.dist.frameworks.mindspore_tensors` in one process on real MindSpore tensors (no
communication): dtypes, shards from HyperParallel's `chunk_info`, host arrays and their
aliasing, in-place fills (whole, rows, converting, into a Cell's Parameter, by MindSpore's ops)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
torch = pytest.importorskip("torch")

from mindspore import Parameter, Tensor, nn  # noqa: E402

from hpckpt.core.geometry.box import Box  # noqa: E402
from hpckpt.core.dtypes import dtype  # noqa: E402
from hpckpt.core.errors import GeometryError, HpckptError  # noqa: E402
from hpckpt.dist.frameworks import mindspore_tensors as fw  # noqa: E402

# every MindSpore dtype `core.dtypes` names, with the numpy storage its elements come back in
DTYPES = [
    (ms.bool_, "bool"), (ms.int8, "int8"), (ms.uint8, "uint8"), (ms.int16, "int16"), (ms.uint16, "uint16"),
    (ms.int32, "int32"), (ms.uint32, "uint32"), (ms.int64, "int64"), (ms.uint64, "uint64"),
    (ms.float16, "float16"), (ms.bfloat16, "bfloat16"), (ms.float32, "float32"), (ms.float64, "float64"),
    (ms.complex64, "complex64"), (ms.complex128, "complex128"),
    (ms.float8_e4m3fn, "float8_e4m3fn"), (ms.float8_e5m2, "float8_e5m2"),
]
VALUES = np.array([[1.5, -2.25, 3.1], [0.0, 1e-3, -7.0]], np.float32)


def ms_tensor(ms_dtype, values=VALUES) -> Tensor:
    kind = np.complex64 if ms_dtype in (ms.complex64, ms.complex128) else np.float32
    return Tensor(np.abs(values).astype(kind) if ms_dtype in (ms.uint8, ms.uint16, ms.uint32, ms.uint64)
                  else values.astype(kind), ms_dtype)


@dataclass
class Chunk:  # the shape of HyperParallel's ChunkMeta / ChunkInfo
    offsets: tuple
    sizes: tuple


@dataclass
class ChunkInfo:
    chunk: Chunk
    global_shape: tuple


def with_chunk_info(t: Tensor, offsets, sizes, global_shape) -> Tensor:
    t.chunk_info = ChunkInfo(Chunk(offsets, sizes), global_shape)
    return t


def test_is_tensor():
    p = Parameter(Tensor(VALUES), name="p")
    assert isinstance(p, Tensor)  # a Parameter is a Tensor subclass
    assert fw.is_tensor(Tensor(VALUES)) and fw.is_tensor(p)
    assert not fw.is_tensor(VALUES) and not fw.is_tensor(torch.zeros(2)) and not fw.is_tensor(3.0)


@pytest.mark.parametrize("ms_dtype,name", DTYPES, ids=[n for _, n in DTYPES])
def test_dtype_and_host_array(ms_dtype, name):
    t = ms_tensor(ms_dtype)
    d = fw.dtype_of(t, "x")
    assert d == dtype(name)
    assert fw.shape_of(t) == (2, 3)
    array = fw.to_numpy(t, copy=False)
    assert array.dtype == d.np and array.shape == (2, 3)
    assert fw.direct_view(t, d) is not None
    assert fw.direct_view(t, dtype("int32" if name != "int32" else "int64")) is None  # another dtype


def test_unknown_dtype_names_the_tensor():
    with pytest.raises(GeometryError, match="layer.h.*HiFloat8") as e:
        fw.dtype_of(Tensor(VALUES, ms.hifloat8), "layer.h")
    assert isinstance(e.value, HpckptError) and e.value.exit_code == GeometryError.exit_code


def test_bfloat16_and_float8_bits_equal_torch():
    values = np.array([1.5, -2.25, 3.1, 1e-3, -0.0, 65504.0, 3.0e38], np.float32)
    ours = fw.to_numpy(Tensor(values, ms.bfloat16), copy=True)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert ours.dtype == np.uint16 and np.array_equal(ours, theirs)
    small = np.array([1.0, 2.0, -0.5, 0.375, 448.0], np.float32)
    for ms_dtype, torch_dtype in ((ms.float8_e4m3fn, torch.float8_e4m3fn), (ms.float8_e5m2, torch.float8_e5m2)):
        ours = fw.to_numpy(Tensor(small, ms_dtype), copy=False)
        theirs = torch.from_numpy(small).to(torch_dtype).view(torch.uint8).numpy()
        assert ours.dtype == np.uint8 and np.array_equal(ours, theirs), ms_dtype


def test_to_numpy_copy_is_independent_and_alias_is_not():
    p = Parameter(Tensor(VALUES), name="p")
    copied, aliased = fw.to_numpy(p, copy=True), fw.to_numpy(p, copy=False)
    p[0:1] = Tensor(np.full((1, 3), 9.0, np.float32))  # an in-place change after staging
    assert np.array_equal(copied, VALUES)
    assert np.array_equal(aliased[0], [9.0, 9.0, 9.0])  # on CPU asnumpy() is the tensor's memory
    assert fw.to_numpy(Tensor(np.float32(2.5)), copy=True).shape == ()


def test_direct_view_aliases_and_refuses_views():
    t = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    view = fw.direct_view(t, dtype("float32"))
    view[1, 2] = 100.0
    assert t.asnumpy()[1, 2] == 100.0
    b = Tensor(VALUES, ms.bfloat16)
    bits = fw.direct_view(b, dtype("bfloat16"))
    bits[0, 0] = 0x3F80  # 1.0
    assert float(b.astype(ms.float32).asnumpy()[0, 0]) == 1.0
    # a view tensor's asnumpy() is a fresh copy: writes there would land nowhere
    assert fw.direct_view(t[1:], dtype("float32")) is None
    assert fw.direct_view(t.transpose(1, 0), dtype("float32")) is None


def test_native_shards_plain_and_chunk_info():
    plain = Tensor(VALUES)
    s = fw.native_shards("w", plain)
    assert (s.dtype, s.shape, s.replicated) == (dtype("float32"), (2, 3), True)
    assert s.pieces[0][0] == Box((0, 0), (2, 3)) and s.pieces[0][1] is plain
    shard = with_chunk_info(Parameter(Tensor(VALUES, ms.bfloat16), name="s"), (4, 3), (2, 3), (7, 6))
    s = fw.native_shards("s", shard)
    assert (s.dtype, s.shape, s.replicated) == (dtype("bfloat16"), (7, 6), False)
    assert s.pieces == [(Box((4, 3), (2, 3)), shard)]


@pytest.mark.parametrize("offsets,sizes,global_shape", [
    ((0, 0), (3, 3), (7, 6)),  # sizes are not the local tensor's
    ((6, 0), (2, 3), (7, 6)),  # out of the global shape
    ((0,), (2,), (7,)),  # another rank
    ((-1, 0), (2, 3), (7, 6)),
])
def test_native_shards_misfit(offsets, sizes, global_shape):
    with pytest.raises(GeometryError, match="enc.w: chunk_info box"):
        fw.native_shards("enc.w", with_chunk_info(Tensor(VALUES), offsets, sizes, global_shape))


def test_native_shards_not_a_chunk_info():
    t = Tensor(VALUES)
    t.chunk_info = "0:2"
    with pytest.raises(GeometryError, match="not HyperParallel's ChunkInfo"):
        fw.native_shards("x", t)


def test_fill_whole_rows_and_keeps_memory():
    p = Parameter(Tensor(np.zeros((6, 4), np.float32)), name="p")
    address = p.data_ptr()
    fw.fill(p, np.arange(24, dtype=np.float32).reshape(6, 4), dtype("float32"))
    assert np.array_equal(p.asnumpy(), np.arange(24, dtype=np.float32).reshape(6, 4))
    fw.fill(p, np.full((2, 4), -1.0, np.float32), dtype("float32"), rows=(2, 4))
    want = np.arange(24, dtype=np.float32).reshape(6, 4)
    want[2:4] = -1.0
    assert np.array_equal(p.asnumpy(), want)
    assert p.data_ptr() == address
    scalar = Tensor(np.float32(1.0))
    fw.fill(scalar, np.array(4.5, np.float32), dtype("float32"))
    assert float(scalar.asnumpy()) == 4.5


def test_fill_converts_bfloat16_to_float32_into_a_dense_layer():
    dense = nn.Dense(3, 2, has_bias=False)
    weight = dense.weight
    values = np.array([[1.5, -2.0, 0.25], [3.0, 0.5, -1.0]], np.float32)
    bits = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    fw.fill(weight, bits, dtype("bfloat16"))
    assert dense.weight is weight
    out = dense(Tensor(np.ones((1, 3), np.float32))).asnumpy()
    assert np.array_equal(out, values.sum(axis=1, keepdims=True).T)
    fw.fill(weight, bits[1:2], dtype("bfloat16"), rows=(0, 1))  # a row range, converting
    assert np.array_equal(dense(Tensor(np.ones((1, 3), np.float32))).asnumpy(), [[2.5, 2.5]])


def test_fill_float32_into_bfloat16_rounds_like_torch():
    values = np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-9, -3.3]], np.float32)  # ties and a plain value
    t = Tensor(np.zeros((1, 3), np.float32), ms.bfloat16)
    fw.fill(t, values, dtype("float32"))
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(fw.to_numpy(t, copy=False), theirs)


def test_fill_converts_integers_and_refuses_float8_casts():
    t = Tensor(np.zeros(3, np.int64))
    fw.fill(t, np.array([1, -2, 3], np.int32), dtype("int32"))
    assert t.asnumpy().tolist() == [1, -2, 3]
    with pytest.raises(HpckptError, match="cannot cast float8_e4m3fn to float32"):
        fw.fill(Tensor(np.zeros(2, np.float32)), np.array([56, 64], np.uint8), dtype("float8_e4m3fn"))


def test_fill_by_ops_the_path_without_a_host_alias():
    """What an accelerator tensor goes through: MindSpore's in-place ops, memory kept. (Rows of
    a bfloat16 tensor cannot be assigned on CPU: its slice-copy kernel has no bfloat16.)"""
    p = Parameter(Tensor(np.zeros((4, 3), np.float32), ms.bfloat16), name="p")
    address = p.data_ptr()
    bits = fw.to_numpy(Tensor(VALUES, ms.bfloat16), copy=True)
    fw.fill_by_ops(p, np.concatenate([bits, bits]), dtype("bfloat16"))
    assert np.array_equal(fw.to_numpy(p, copy=False), np.concatenate([bits, bits]))
    assert p.data_ptr() == address
    q = Parameter(Tensor(np.zeros((4, 3), np.float32)), name="q")
    address = q.data_ptr()
    fw.fill_by_ops(q, np.ones((2, 3), np.float32), dtype("float32"), rows=(1, 3))
    assert q.asnumpy().tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]]
    assert q.data_ptr() == address


def test_tensor_of_round_trips_storage():
    for ms_dtype, name in DTYPES:
        bits = fw.to_numpy(ms_tensor(ms_dtype), copy=True)
        again = fw.tensor_of(bits, dtype(name))
        assert again.dtype == ms_dtype and np.array_equal(fw.to_numpy(again, copy=False), bits), name


def test_no_communication_here():
    assert fw.comm_of() is None
    assert fw.init_job() == (0, 1)
    assert not fw.is_scheduler()
