"""The single dtype table: every spelling of a dtype maps to one canonical `DType`.

Checkpoints spell dtypes many ways (`torch.bfloat16`, `BFloat16`, `mindspore.bfloat16`, `BF16`,
`torch.BFloat16Storage`, ...). Everything in hpckpt goes through `dtype()` so that no second table
exists anywhere. numpy has no bfloat16 or float8, so those are carried as raw unsigned integers of
the same width (`numpy_storage`): bytes are copied, never converted, unless a cast is asked for.

The table holds every dtype torch 2.13 defines and every code safetensors 0.8.0 defines. Each is
either copied bit-exactly (raw bytes) or refused with `UnsupportedDTypeError`; `unsupported_reason`
says which formats cannot hold which dtype. Facts behind the columns (checked on the real
libraries, see tests/test_dtypes_all.py):

* safetensors 0.8.0 defines BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0,
  F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64; nothing else
  (no C128, no complex32, no bits or quantized types) loads.
* Sub-byte codes count *values* in the header shape: F4 `[.., 2k]` is `k` bytes per row, and
  safetensors' torch loader turns it into `float4_e2m1fn_x2 [.., k]` (one byte = two values);
  F6 `[.., 4k]` is 3k bytes per row. hpckpt's element of such a dtype is the whole byte group
  (`safetensors_pack` values): shapes, boxes and item sizes are in groups, so no box split can
  cut a byte. A header whose last dimension is not a multiple of the pack is refused.
* MindSpore 2.10's `.ckpt` loader accepts the tensor_types Bool, Int8..Int64, UInt8..UInt64,
  Float16, Float32, Float64, BFloat16 (plus str and Int4, `tensor_to_ms_type`): no complex, no
  float8. `mindspore` is that tensor_type; `mindspore_name` is `str()` of MindSpore's dtype where
  it has one outside `.ckpt` (HyperParallel-on-MindSpore metadata spells complex so).
* torch.save writes the legacy typed storages (`torch_storage`) for the old dtypes and
  `UntypedStorage` + `_rebuild_tensor_v3` for the rest; it cannot save the shell dtypes
  int1..int7/uint1..uint7. torch DCP cannot save bits* tensors (it sizes elements with
  `torch.iinfo`). Quantized tensors carry a scale and zero point hpckpt does not copy; they are
  read (so `inspect` lists them, with torch's nominal item size: quint4x2 really packs two values
  a byte) and refused by every writer and by `verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpckpt.core.errors import UnknownFormatError, UnsupportedDTypeError


@dataclass(frozen=True)
class DType:
    """One element type: canonical name, item size and its name in every format we speak."""

    name: str  # canonical, the torch attribute name: "bfloat16", "float8_e4m3fn"
    itemsize: int  # bytes of one element (of one byte group for packed sub-byte types)
    safetensors: str | None  # safetensors header code ("BF16"); None: the format has none
    mindspore: str | None  # `.ckpt` tensor_type MindSpore's loader accepts ("BFloat16"); None: none
    numpy_storage: str  # numpy dtype holding the raw bits little-endian: "<u2" for bfloat16
    is_floating: bool = False
    is_exact_in_numpy: bool = True  # False: numpy_storage holds raw bits, not values
    torch_storage: str | None = None  # legacy typed storage torch.save names; None: UntypedStorage
    mindspore_name: str | None = None  # MindSpore's own spelling where it differs from `mindspore`
    safetensors_pack: int = 1  # values per element counted in a safetensors shape's last dim
    in_torch: bool = True  # torch has this dtype (`torch.<name>`)
    refusal: str | None = None  # why hpckpt copies no tensor of this dtype (None: it copies it)

    @property
    def torch(self) -> str:
        """The dtype string torch writes (`str(torch.float32)`)."""
        return f"torch.{self.name}"

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.numpy_storage)

    @property
    def ms_spelling(self) -> str | None:
        """MindSpore's spelling of the dtype outside `.ckpt` (HyperParallel metadata), or None."""
        return self.mindspore_name or self.mindspore

    def __str__(self) -> str:
        return self.name


def _raw(name: str, itemsize: int, safetensors: str | None, **kw) -> DType:
    """A dtype numpy cannot express: its bytes travel as unsigned integers (or void groups)."""
    storage = {1: "|u1", 2: "<u2", 4: "<u4"}.get(itemsize, f"|V{itemsize}")
    return DType(name, itemsize, safetensors, None, storage, is_exact_in_numpy=False, **kw)


_SHELL = "a shell dtype: torch itself cannot save or load its tensors"
_QUANTIZED = "a quantized tensor's scale and zero point are not carried by hpckpt"

_TABLE: tuple[DType, ...] = (
    DType("bool", 1, "BOOL", "Bool", "|b1", torch_storage="BoolStorage"),
    DType("uint8", 1, "U8", "UInt8", "|u1", torch_storage="ByteStorage"),
    DType("int8", 1, "I8", "Int8", "|i1", torch_storage="CharStorage"),
    DType("uint16", 2, "U16", "UInt16", "<u2"),
    DType("int16", 2, "I16", "Int16", "<i2", torch_storage="ShortStorage"),
    DType("uint32", 4, "U32", "UInt32", "<u4"),
    DType("int32", 4, "I32", "Int32", "<i4", torch_storage="IntStorage"),
    DType("uint64", 8, "U64", "UInt64", "<u8"),
    DType("int64", 8, "I64", "Int64", "<i8", torch_storage="LongStorage"),
    DType("float16", 2, "F16", "Float16", "<f2", is_floating=True, torch_storage="HalfStorage"),
    DType("bfloat16", 2, "BF16", "BFloat16", "<u2", is_floating=True, is_exact_in_numpy=False,
          torch_storage="BFloat16Storage"),
    DType("float32", 4, "F32", "Float32", "<f4", is_floating=True, torch_storage="FloatStorage"),
    DType("float64", 8, "F64", "Float64", "<f8", is_floating=True, torch_storage="DoubleStorage"),
    DType("complex64", 8, "C64", None, "<c8", torch_storage="ComplexFloatStorage", mindspore_name="Complex64"),
    DType("complex128", 16, None, None, "<c16", torch_storage="ComplexDoubleStorage",
          mindspore_name="Complex128"),
    _raw("float8_e4m3fn", 1, "F8_E4M3", is_floating=True),
    _raw("float8_e4m3fnuz", 1, "F8_E4M3FNUZ", is_floating=True),
    _raw("float8_e5m2", 1, "F8_E5M2", is_floating=True),
    _raw("float8_e5m2fnuz", 1, "F8_E5M2FNUZ", is_floating=True),
    # (the first 19 rows are in their historical order: index caches and listings follow it)
    _raw("float8_e8m0fnu", 1, "F8_E8M0", is_floating=True),
    _raw("float4_e2m1fn_x2", 1, "F4", is_floating=True, safetensors_pack=2),
    _raw("float6_e2m3fn_x4", 3, "F6_E2M3", is_floating=True, safetensors_pack=4, in_torch=False),
    _raw("float6_e3m2fn_x4", 3, "F6_E3M2", is_floating=True, safetensors_pack=4, in_torch=False),
    _raw("complex32", 4, None),
    _raw("bits8", 1, None),
    _raw("bits16", 2, None),
    _raw("bits1x8", 1, None),
    _raw("bits2x4", 1, None),
    _raw("bits4x2", 1, None),
    *(_raw(f"{sign}int{bits}", 1, None, refusal=_SHELL) for sign in ("u", "") for bits in range(1, 8)),
    DType("qint8", 1, None, None, "|i1", torch_storage="QInt8Storage", refusal=_QUANTIZED),
    DType("quint8", 1, None, None, "|u1", torch_storage="QUInt8Storage", refusal=_QUANTIZED),
    DType("qint32", 4, None, None, "<i4", torch_storage="QInt32Storage", refusal=_QUANTIZED),
    _raw("quint4x2", 1, None, torch_storage="QUInt4x2Storage", refusal=_QUANTIZED),
    _raw("quint2x4", 1, None, torch_storage="QUInt2x4Storage", refusal=_QUANTIZED),
)

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}

# Other spellings, already lower-cased and stripped of a framework prefix.
_ALIASES: dict[str, str] = {
    "float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32",
    "short": "int16", "bool_": "bool", "cfloat": "complex64", "cdouble": "complex128",
    "chalf": "complex32", "bit": "uint1",
    "fp16": "float16", "fp32": "float32", "fp64": "float64", "bf16": "bfloat16",
    "float8_e4m3": "float8_e4m3fn",
}
for _d in _TABLE:
    for _spelling in (_d.safetensors, _d.mindspore, _d.mindspore_name):
        if _spelling:
            _ALIASES.setdefault(_spelling.lower(), _d.name)

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


_BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _TABLE if d.safetensors}
SAFETENSORS_CODES: frozenset[str] = frozenset(_BY_SAFETENSORS)  # every code safetensors 0.8.0 defines


def from_safetensors(code: str) -> DType:
    """Return the DType of a safetensors header code (exact, upper-case match)."""
    try:
        return _BY_SAFETENSORS[code]
    except (KeyError, TypeError):
        raise UnknownFormatError(f"unknown safetensors dtype code {code!r}: not a dtype the format defines") from None


def from_numpy(array_dtype: np.dtype) -> DType:
    """Return the DType of a numpy array (bfloat16/float8 cannot be told apart from ints here)."""
    kind = np.dtype(array_dtype)
    for d in _TABLE:
        if d.is_exact_in_numpy and d.refusal is None and np.dtype(d.numpy_storage) == kind.newbyteorder("<"):
            return d
    raise UnknownFormatError(f"numpy dtype {kind} has no checkpoint dtype")


def all_dtypes() -> tuple[DType, ...]:
    return _TABLE


# --- what each format can hold ------------------------------------------------------------------

FORMAT_NAMES = ("safetensors", "hf-sharded", "hyperparallel", "mindspore-ckpt", "torch-save", "torch-dcp", "mindformers")


def unsupported_reason(dtype: DType, format_name: str) -> str | None:
    """Why `format_name` cannot hold tensors of `dtype` (None: it can, bit-exactly).

    Format names are the writers' ("safetensors", "hf-sharded", "hyperparallel",
    "mindspore-ckpt", "torch-save", "torch-dcp", "mindformers"); any other raises ValueError.
    """
    if format_name not in FORMAT_NAMES:
        raise ValueError(f"unknown format {format_name!r}; known: {', '.join(FORMAT_NAMES)}")
    if dtype.refusal:
        return dtype.refusal
    if format_name in ("safetensors", "hf-sharded", "hyperparallel") and dtype.safetensors is None:
        return f"safetensors defines no dtype code for {dtype}"
    if format_name == "hyperparallel" and not dtype.in_torch:
        return f"HyperParallel metadata names torch dtypes, and torch has no {dtype}"
    if format_name == "mindspore-ckpt" and dtype.mindspore is None:
        return f"a MindSpore .ckpt has no tensor_type for {dtype}"
    if format_name == "mindformers" and (dtype.safetensors is None or dtype.ms_spelling is None):
        return f"MindFormers keeps MindSpore safetensors, which hold no {dtype}"
    if format_name in ("torch-save", "torch-dcp") and not dtype.in_torch:
        return f"torch has no dtype {dtype}"
    if format_name == "torch-dcp" and dtype.name.startswith("bits"):
        return f"torch DCP cannot save or load {dtype} tensors (it sizes elements with torch.iinfo)"
    return None


def refuse(dtype: DType, where: str, reason: str | None = None) -> UnsupportedDTypeError:
    """The error for a tensor (`where` names it) whose dtype cannot be read or held here."""
    spelling = dtype.torch if dtype.in_torch else dtype.safetensors
    return UnsupportedDTypeError(f"{where}: dtype {spelling} not supported: {reason or dtype.refusal}")


def check_holds(dtype: DType, format_name: str, where: str) -> None:
    """Raise `UnsupportedDTypeError` naming `where` when `format_name` cannot hold `dtype`."""
    reason = unsupported_reason(dtype, format_name)
    if reason:
        raise refuse(dtype, where, reason)
