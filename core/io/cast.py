"""Casting floating tensors between float64, float32, float16 and bfloat16, bit-exactly defined.

numpy has no bfloat16, so bfloat16 is carried as its raw 16 bits: widening shifts them into the
top of a float32; narrowing rounds float32 to nearest-even on the dropped 16 bits, as PyTorch
does, turning NaNs into the canonical quiet NaN (0x7FC0). Anything else (float8, integers) is refused rather than guessed.
"""

from __future__ import annotations

import numpy as np

from hpckpt.core.dtypes import DType
from hpckpt.core.errors import UnknownFormatError

CASTABLE = ("float64", "float32", "float16", "bfloat16")


def check_cast(source: DType, target: DType) -> None:
    if source.name not in CASTABLE or target.name not in CASTABLE:
        raise UnknownFormatError(f"cannot cast {source} to {target}: only {', '.join(CASTABLE)} are cast")


def to_float32(raw: np.ndarray, source: DType) -> np.ndarray:
    if source.name == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def from_float32(values: np.ndarray, target: DType) -> np.ndarray:
    if target.name == "bfloat16":
        bits = values.astype(np.float32).view(np.uint32)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
    return values.astype(target.np)


def cast(raw: np.ndarray, source: DType, target: DType) -> np.ndarray:
    """Return `raw` (numpy storage of `source`) as numpy storage of `target`."""
    if source == target:
        return raw
    check_cast(source, target)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow gives inf, as torch's .to() does
        if source.name == "float64" and target.name != "bfloat16":
            return raw.astype(target.np)
        return from_float32(to_float32(raw, source), target)
