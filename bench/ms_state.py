"""The synthetic state of `bench/bench_mindspore.py`: names, shapes, dtypes and values (numpy only).

About 40 tensors: 36 weights (2-D, fp32 and bf16, a few column widths), 3 1-D vectors (fp32) and
one 0-d fp32 tensor. Every non-0-d tensor is sharded on dim 0 over 4 ranks the way MindSpore's
semi-auto parallel saves it (even split: MindSpore layouts need the dimension divisible by the
device count, so every dim 0 is a multiple of 8, for 4 and for 8 ranks); the 0-d tensor is
replicated on every rank. Values are a function of the global flat index g and the tensor number t:

    value[g] = ((g * 2654435761 + 40503 * t) mod 65521 - 32760) / 4096

in float32; bf16 tensors hold that value rounded to bf16 (round to nearest even, done on the bits
here, so MindSpore's float32 -> bfloat16 cast of the rounded value is exact). Expected arrays are
numpy: float32 as float32, bf16 as its raw uint16 bits (as hpckpt's reader returns it).
"""

from __future__ import annotations

import math

import numpy as np

WORLD = 4
N_WEIGHTS = 36
_KINDS = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2"]
_COLS = [1024, 1536, 2048, 4096]
ZERO_D = ("global_step", 1234.5)  # a 0-d float32, replicated (MindSpore saves steps as float32 Parameters)


def spec(size_gib: float) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, global shape, dtype)] in save order; dtype is "float32" or "bfloat16"."""
    total = size_gib * 2**30
    per = total / N_WEIGHTS
    out = []
    for i in range(N_WEIGHTS):
        layer, k = divmod(i, len(_KINDS))
        dtype = "bfloat16" if i % 3 == 2 else "float32"
        cols = _COLS[i % len(_COLS)]
        itemsize = 4 if dtype == "float32" else 2
        rows = max(8, int(round(per / (cols * itemsize) / 8)) * 8)
        out.append((f"model.layers.{layer}.{_KINDS[k]}.weight", (rows, cols), dtype))
    for j, n in enumerate((4096, 8192, 16384)):
        out.append((f"model.norm{j}.weight", (n,), "float32"))
    out.append((ZERO_D[0], (), "float32"))
    return out


def names(size_gib: float) -> list[str]:
    return [n for n, _s, _d in spec(size_gib)]


def itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def tensor_bytes(size_gib: float) -> int:
    """Logical bytes of all tensors (the numerator of every GB/s)."""
    return sum(math.prod(s) * itemsize(d) for _n, s, d in spec(size_gib))


def rows_of(rank: int, world: int, n: int) -> tuple[int, int]:
    """MindSpore's even dim-0 split (n is a multiple of world)."""
    step = n // world
    return rank * step, (rank + 1) * step


def _bf16_bits(f32: np.ndarray) -> np.ndarray:
    bits = f32.view(np.uint32)
    rounded = bits + (((bits >> 16) & 1) + 0x7FFF)
    return (rounded >> 16).astype(np.uint16)


def expected(size_gib: float, name: str, lo: int | None = None, hi: int | None = None) -> np.ndarray:
    """Rows [lo, hi) of `name`: float32 array, or uint16 bf16 bits."""
    for t, (n, shape, dtype) in enumerate(spec(size_gib)):
        if n != name:
            continue
        if shape == ():
            return np.array(ZERO_D[1], dtype=np.float32)
        lo = 0 if lo is None else lo
        hi = shape[0] if hi is None else hi
        inner = math.prod(shape[1:])
        g = np.arange(lo * inner, hi * inner, dtype=np.int64)
        v = ((g * 2654435761 + 40503 * t) % 65521 - 32760).astype(np.float32) * np.float32(1.0 / 4096)
        v = v.reshape(hi - lo, *shape[1:])
        return _bf16_bits(v) if dtype == "bfloat16" else v
    raise KeyError(name)


def as_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    """An expected array as float32 values (bf16 bits widened exactly)."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def strategy(world: int, size_gib: float) -> dict:
    """A MindSpore strategy file (JSON form read by `_build_json_strategy`): dim 0 over `world`
    devices for every tensor with a dimension, the 0-d tensor replicated.

    `tensor_map` counts device-matrix dimensions from the right: with dev_matrix [world], 0 names
    the only one; -1 = not split. `param_split_shape` (uneven split sizes) stays empty but present.
    `parallel_strategy_item` (operator strategies, its `stage` read by some paths) is given for
    the pipeline stage.
    """
    layout = {}
    for name, shape, _dtype in spec(size_gib):
        layout[name] = {
            "dev_matrix": [world],
            "tensor_map": [0] + [-1] * (len(shape) - 1) if shape else [],
            "param_split_shape": [],
            "indices_offset": [],
            "field": 0,
            "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0,
        }
    return {
        "current_stage": 0,
        "parallel_strategy_item": {"Default/network-Net/MatMul-op0": {"stage": 0, "parallel_strategy": [[world, 1]]}},
        "parallel_layout_item": layout,
    }
