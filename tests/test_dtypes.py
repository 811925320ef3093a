"""One dtype vocabulary: every spelling maps to one canonical dtype, item size and code."""

from __future__ import annotations

import pytest
import torch

from hpckpt.core import dtypes
from hpckpt.core.errors import UnknownFormatError

# The spec's safetensors code table (format spec 4.1) plus MindSpore's spellings (4.5).
SPEC_TABLE = {
    "BOOL": "torch.bool", "U8": "torch.uint8", "I8": "torch.int8", "U16": "torch.uint16",
    "I16": "torch.int16", "U32": "torch.uint32", "I32": "torch.int32", "U64": "torch.uint64",
    "I64": "torch.int64", "F8_E4M3": "torch.float8_e4m3fn", "F8_E4M3FNUZ": "torch.float8_e4m3fnuz",
    "F8_E5M2": "torch.float8_e5m2", "F8_E5M2FNUZ": "torch.float8_e5m2fnuz", "F16": "torch.float16",
    "BF16": "torch.bfloat16", "F32": "torch.float32", "F64": "torch.float64", "C64": "torch.complex64",
}


@pytest.mark.parametrize("spelling", ["torch.bfloat16", "BFloat16", "mindspore.bfloat16", "BF16", "bf16", "bfloat16"])
def test_bfloat16_spellings(spelling):
    d = dtypes.dtype(spelling)
    assert (d.name, d.itemsize, d.safetensors, d.mindspore) == ("bfloat16", 2, "BF16", "BFloat16")


@pytest.mark.parametrize(("code", "torch_name"), sorted(SPEC_TABLE.items()))
def test_spec_table_round_trips_and_matches_real_torch(code, torch_name):
    d = dtypes.from_safetensors(code)
    assert dtypes.dtype(torch_name) is d
    assert dtypes.dtype(code) is d
    assert d.torch == torch_name
    real = getattr(torch, torch_name.split(".", 1)[1])
    assert str(real) == torch_name
    assert torch.empty((), dtype=real).element_size() == d.itemsize


@pytest.mark.parametrize(
    ("spelling", "name"),
    [("Float32", "float32"), ("Float16", "float16"), ("Int64", "int64"), ("Int32", "int32"),
     ("Bool", "bool"), ("UInt8", "uint8"), ("mindspore.float32", "float32"), ("torch.float", "float32"),
     ("torch.half", "float16"), ("torch.long", "int64"), ("fp32", "float32")],
)
def test_framework_spellings(spelling, name):
    assert dtypes.dtype(spelling).name == name


def test_mindspore_spellings_match_real_mindspore():
    import mindspore as ms

    for name in ("float32", "float16", "bfloat16", "int64", "int32", "bool", "uint8", "int8"):
        assert dtypes.BY_NAME[name].mindspore == str(getattr(ms, name if name != "bool" else "bool_")), name


def test_unknown_dtype_is_a_typed_error():
    with pytest.raises(UnknownFormatError, match="unknown dtype 'torch.float7'"):
        dtypes.dtype("torch.float7")
