"""The synthetic training state of `bench/bench_engine.py`, shared by the torch scripts and the checker.

The same state is built on any world size: every 2-D/3-D/1-D tensor is a DTensor on a 1-D mesh
with `Shard(0)` (PyTorch's ceil split, so the last ranks get fewer rows, some none at all), and
every element's value is a function of its *global* position, so any rank of any layout can build
its local shard (or check one) without communication:

    value[g] = ((g * 2654435761 + 40503 * t) mod 65521 - 32760) / 4096    (g: flat index, t: tensor number)

computed in float32 and cast (round to nearest even) for bfloat16 tensors. Besides the ~200 large
tensors (fp32 and bf16, a few MB each at 1.5 GiB) there are a tensor with fewer rows than ranks,
two 0-d tensors (plain tensors, replicated) and non-tensor values.

Imports torch lazily: `spec()` and `expected_numpy()`'s geometry work without it.
"""

from __future__ import annotations

import math

N_TENSORS = 200
_KINDS = ["attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3", "mlp.gate",
          "norm.weight", "moe.experts"]
_COLS = [1024, 1536, 2048, 3072]

VALUES = {
    "extra.epoch": 7,
    "extra.name": "bench-engine",
    "extra.lr": 3.0e-4,
    "extra.betas": [0.9, 0.95],
}
ZERO_D = {"optim.step": ("int64", 123456), "optim.loss_scale": ("float32", 65536.0)}


def spec(size_gib: float) -> list[tuple[str, tuple[int, ...], str]]:
    """[(fqn, global shape, dtype name)] of every sharded tensor, in state-dict order."""
    total = size_gib * 2**30
    per = total / (N_TENSORS * 0.9)  # 90% of the tensors carry (almost) all the bytes
    out = []
    for i in range(N_TENSORS):
        layer, k = divmod(i, len(_KINDS))
        name = f"layers.{layer}.{_KINDS[k]}"
        if k == 8:  # a small 1-D vector, uneven length
            out.append((name, (4096 + 3 + layer,), "float32"))
            continue
        if k == 9:  # 3-D, bf16
            inner, dtype = (8, 256), "bfloat16"
        else:
            inner, dtype = (_COLS[k % 4],), "float32" if k % 2 == 0 else "bfloat16"
        itemsize = 4 if dtype == "float32" else 2
        rows = max(9, int(round(per / (math.prod(inner) * itemsize))))
        rows += (3 - rows % 8) % 8  # rows % 8 == 3: uneven over 4 and over 8 ranks
        out.append((name, (rows, *inner), dtype))
    out.append(("tiny.rows3", (3, 64), "float32"))  # fewer rows than ranks: empty shards
    return out


def rows_of(rank: int, world: int, n: int) -> tuple[int, int]:
    """PyTorch's Shard(0) split (torch.chunk): ceil-sized pieces, the tail may be short or empty."""
    step = -(-n // world) if n else 0
    lo = min(rank * step, n)
    return lo, min(lo + step, n)


def _pattern_torch(t: int, shape, dtype, lo: int, hi: int):
    import torch

    inner = math.prod(shape[1:])
    g = torch.arange(lo * inner, hi * inner, dtype=torch.int64)
    v = ((g * 2654435761 + 40503 * t) % 65521).to(torch.float32).sub_(32760).mul_(1.0 / 4096)
    return v.reshape(hi - lo, *shape[1:]).to(getattr(torch, dtype))


def local_state(size_gib: float, rank: int, world: int, mesh=None, empty: bool = False) -> dict:
    """This rank's state dict: DTensors (if `mesh`) or plain local tensors, plus 0-d and values."""
    import torch

    state: dict = {}
    for t, (fqn, shape, dtype) in enumerate(spec(size_gib)):
        lo, hi = rows_of(rank, world, shape[0])
        if empty:
            local = torch.empty((hi - lo, *shape[1:]), dtype=getattr(torch, dtype))
        else:
            local = _pattern_torch(t, shape, dtype, lo, hi)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                       shape=torch.Size(shape), stride=stride)
        state[fqn] = local
    for fqn, (dtype, value) in ZERO_D.items():
        state[fqn] = torch.zeros((), dtype=getattr(torch, dtype)) if empty else torch.tensor(value, dtype=getattr(torch, dtype))
    for fqn, value in VALUES.items():
        state[fqn] = type(value)() if empty else (list(value) if isinstance(value, list) else value)
    return state


def expected_numpy(size_gib: float, fqn: str, lo: int | None = None, hi: int | None = None):
    """The expected rows [lo, hi) of `fqn` as numpy (bf16 as raw uint16 bits, as hpckpt reads it)."""
    import numpy as np
    import torch

    if fqn in ZERO_D:
        dtype, value = ZERO_D[fqn]
        return np.array(value, dtype=dtype)
    for t, (name, shape, dtype) in enumerate(spec(size_gib)):
        if name == fqn:
            lo = 0 if lo is None else lo
            hi = shape[0] if hi is None else hi
            x = _pattern_torch(t, shape, dtype, lo, hi)
            return x.view(torch.uint16).numpy() if dtype == "bfloat16" else x.numpy()
    raise KeyError(fqn)


def tensor_bytes(size_gib: float) -> int:
    """Logical bytes of every tensor of the state (the numerator of every GB/s in the table)."""
    n = sum(math.prod(s) * (4 if d == "float32" else 2) for _f, s, d in spec(size_gib))
    return n + 8 + 4


def join_gloo_job():
    """Start this torchrun rank on gloo with a 1-D CPU mesh; returns (rank, world, mesh)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world, init_device_mesh("cpu", (world,))
