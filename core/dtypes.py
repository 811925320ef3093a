"""The single dtype table: every spelling of a dtype maps to one canonical `DType`.

Checkpoints spell dtypes many ways (`torch.bfloat16`, `BFloat16`, `mindspore.bfloat16`, `BF16`,
`torch.BFloat16Storage`, ...). Everything in hpckpt goes through `dtype()` so that no second table
exists anywhere. numpy has no bfloat16 or float8, so those are carried as raw unsigned integers of
the same width (`numpy_storage`): bytes are copied, never converted, unless a cast is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpckpt.core.errors import UnknownFormatError


@dataclass(frozen=True)
class DType:
    """One element type: canonical name, item size and its name in every format we speak."""

    name: str  # canonical, the torch attribute name: "bfloat16", "float8_e4m3fn"
    itemsize: int
    safetensors: str  # safetensors header code: "BF16"
    mindspore: str | None  # MindSpore dtype string as HyperParallel writes it: "BFloat16"
    numpy_storage: str  # numpy dtype holding the raw bits little-endian: "<u2" for bfloat16
    is_floating: bool = False
    is_exact_in_numpy: bool = True  # False: numpy_storage holds raw bits, not values

    @property
    def torch(self) -> str:
        """The dtype string torch writes (`str(torch.float32)`)."""
        return f"torch.{self.name}"

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.numpy_storage)

    def __str__(self) -> str:
        return self.name


_TABLE: tuple[DType, ...] = (
    DType("bool", 1, "BOOL", "Bool", "|b1"),
    DType("uint8", 1, "U8", "UInt8", "|u1"),
    DType("int8", 1, "I8", "Int8", "|i1"),
    DType("uint16", 2, "U16", "UInt16", "<u2"),
    DType("int16", 2, "I16", "Int16", "<i2"),
    DType("uint32", 4, "U32", "UInt32", "<u4"),
    DType("int32", 4, "I32", "Int32", "<i4"),
    DType("uint64", 8, "U64", "UInt64", "<u8"),
    DType("int64", 8, "I64", "Int64", "<i8"),
    DType("float16", 2, "F16", "Float16", "<f2", is_floating=True),
    DType("bfloat16", 2, "BF16", "BFloat16", "<u2", is_floating=True, is_exact_in_numpy=False),
    DType("float32", 4, "F32", "Float32", "<f4", is_floating=True),
    DType("float64", 8, "F64", "Float64", "<f8", is_floating=True),
    DType("complex64", 8, "C64", "Complex64", "<c8"),
    DType("complex128", 16, "C128", "Complex128", "<c16"),
    DType("float8_e4m3fn", 1, "F8_E4M3", None, "|u1", is_floating=True, is_exact_in_numpy=False),
    DType("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", None, "|u1", is_floating=True, is_exact_in_numpy=False),
    DType("float8_e5m2", 1, "F8_E5M2", None, "|u1", is_floating=True, is_exact_in_numpy=False),
    DType("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", None, "|u1", is_floating=True, is_exact_in_numpy=False),
)

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}

# Other spellings, already lower-cased and stripped of a framework prefix.
_ALIASES: dict[str, str] = {
    "float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32",
    "short": "int16", "bool_": "bool", "cfloat": "complex64", "cdouble": "complex128",
    "fp16": "float16", "fp32": "float32", "fp64": "float64", "bf16": "bfloat16",
    "float8_e4m3": "float8_e4m3fn",
}
for _d in _TABLE:
    _ALIASES.setdefault(_d.safetensors.lower(), _d.name)
    if _d.mindspore:
        _ALIASES.setdefault(_d.mindspore.lower(), _d.name)

_PREFIXES = ("torch.", "mindspore.", "ms.", "numpy.", "np.")


def dtype(spelling: "str | DType") -> DType:
    """Return the canonical DType for any known spelling (case-insensitive).

    Raises:
        UnknownFormatError: the spelling names no dtype hpckpt knows.
    """
    if isinstance(spelling, DType):
        return spelling
    key = str(spelling).strip().lower()
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    key = _ALIASES.get(key, key)
    try:
        return BY_NAME[key]
    except KeyError:
        raise UnknownFormatError(f"unknown dtype {spelling!r}") from None


_BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE}


def from_safetensors(code: str) -> DType:
    """Return the DType of a safetensors header code (exact, upper-case match)."""
    try:
        return _BY_SAFETENSORS[code]
    except (KeyError, TypeError):
        raise UnknownFormatError(f"unknown safetensors dtype code {code!r}") from None


def from_numpy(array_dtype: np.dtype) -> DType:
    """Return the DType of a numpy array (bfloat16/float8 cannot be told apart from ints here)."""
    kind = np.dtype(array_dtype)
    for d in _TABLE:
        if d.is_exact_in_numpy and np.dtype(d.numpy_storage) == kind.newbyteorder("<"):
            return d
    raise UnknownFormatError(f"numpy dtype {kind} has no checkpoint dtype")


def all_dtypes() -> tuple[DType, ...]:
    return _TABLE
