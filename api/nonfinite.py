"""NaN and infinities, counted from the bits of each float format (`verify --nan`): no cast, so
a float8 or bfloat16 tensor is judged by its own encoding.
"""

from __future__ import annotations


import numpy as np

from hpckpt.core.errors import CorruptDataError
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.safety.validate import Finding



# IEEE-like formats: (bits, magnitude mask, +Inf); -Inf is +Inf with the sign bit, NaN any larger magnitude

class NonFinite(Finding):
    """A floating tensor holding NaN or infinities: a warning (`--strict` fails on it, with
    the exit code of corrupt data: such values are usually a diverged run's)."""

    @property
    def exit_code(self) -> int:
        return CorruptDataError.exit_code


_IEEE = {"float16": (np.uint16, 0x7FFF, 0x7C00), "bfloat16": (np.uint16, 0x7FFF, 0x7F80),
         "float32": (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
         "float64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000), "float8_e5m2": (np.uint8, 0x7F, 0x7C)}
# formats without infinities: (magnitude mask, the NaN pattern under it)
_NAN_ONLY = {"float8_e4m3fn": (0x7F, 0x7F), "float8_e4m3fnuz": (0xFF, 0x80), "float8_e5m2fnuz": (0xFF, 0x80),
             "float8_e8m0fnu": (0xFF, 0xFF)}


def nonfinite_counts(values: np.ndarray, dtype_name: str) -> tuple[int, int, int]:
    """`(NaN, +Inf, -Inf)` among `values`, numpy's storage of `dtype_name` (raw bits for
    bfloat16 and float8), counted on the bit patterns (float4/float6 have none)."""
    if dtype_name in _IEEE:
        kind, mask, inf = _IEEE[dtype_name]
        bits = values.reshape(-1).view(kind)
        magnitude = np.bitwise_and(bits, kind(mask))
        special = int(np.count_nonzero(magnitude >= kind(inf)))
        if not special:
            return 0, 0, 0
        infinite = magnitude == kind(inf)
        negative = int(np.count_nonzero(infinite & (bits != magnitude)))
        positive = int(np.count_nonzero(infinite)) - negative
        return special - positive - negative, positive, negative
    if dtype_name in _NAN_ONLY:
        mask, pattern = _NAN_ONLY[dtype_name]
        bits = values.reshape(-1).view(np.uint8)
        return int(np.count_nonzero(np.bitwise_and(bits, np.uint8(mask)) == pattern)), 0, 0
    return 0, 0, 0


def nonfinite_report(index: CheckpointIndex, per_tensor: dict[str, list[int]],
                      findings: list[Finding]) -> tuple[dict, ...]:
    rows = []
    for entry in index.tensors.values():
        if not entry.dtype.is_floating or entry.dtype.refusal is not None:
            continue
        nan, pos, neg = per_tensor.get(entry.fqn, (0, 0, 0))
        rows.append({"name": entry.fqn, "dtype": entry.dtype.name, "elements": int(np.prod(entry.shape, dtype=np.int64)),
                     "nan": nan, "posinf": pos, "neginf": neg})
        if nan or pos or neg:
            said = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (pos, "+Inf"), (neg, "-Inf")) if n)
            findings.append(NonFinite("non-finite", "warning", f"{entry.fqn}: {said}", fqn=entry.fqn))
    return tuple(rows)
