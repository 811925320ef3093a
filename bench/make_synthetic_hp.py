"""Generate a synthetic HyperParallel DCP checkpoint for metadata-scale benchmarks.

    python bench/make_synthetic_hp.py --ranks 64 --tensors 10000 OUT

The state looks like an LLM trainer's: `model.embed_tokens.weight`, per layer
`input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm` and
`mlp.{gate,up,down}_proj` weights, `model.norm.weight`, `lm_head.weight`, then for each parameter
`optimizer.state.{i}.exp_avg` and `.exp_avg_sq` (float32) and, for the first `--steps`
parameters (default 100), a 0-d float32 `optimizer.state.{i}.step`, cut off at exactly
`--tensors` entries; plus a handful of values (param group hyper-parameters and `extra_state.*`).
Every tensor of rank >= 1 is FSDP-style split over dim 0 across all ranks with HyperParallel's
balanced rule (first `len % ranks` parts one row larger), so 10,000 tensors on 64 ranks make
~634,000 chunks; 0-d `step`s are replicated and, as de-dup does, stored once, spread round-robin
over the ranks. (A real AdamW state has a `step` per parameter, i.e. a quarter of all entries;
`--steps -1` gives that, with proportionally fewer chunks.) Sizes are kept
small (dim 0 in [64, 128], dim 1 = 8; weights bfloat16, norms and optimizer state float32) so the
data is a few tens of MB even though there are ~640,000 chunks; the data bytes are zeros.

The files are written by the product writer `hpckpt.converters.hyperparallel.from_memory.write_checkpoint`
(one safetensors file and at most one bytes file per rank, `.metadata` last), so the benchmark
reads exactly what hpckpt itself writes. OUT is deleted and recreated. Deterministic.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
from hpckpt.core.geometry.box import Box
from hpckpt.core.dtypes import dtype

F32, BF16 = dtype("float32"), dtype("bfloat16")
WIDTH = 8  # dim 1 of every matrix


def balanced_parts(length: int, parts: int) -> list[tuple[int, int]]:
    """HyperParallel's default split of `length` into `parts`: (start, size), first `length % parts` larger."""
    q, r = divmod(length, parts)
    return [(j * q + min(j, r), q + (1 if j < r else 0)) for j in range(parts)]


def model_parameters(count: int) -> list[tuple[str, tuple[int, ...], object]]:
    """At least `count` model parameters in state-dict order: (fqn, shape, dtype)."""

    def rows(i: int) -> int:  # a deterministic spread over [64, 128]
        return 64 + (i * 37) % 65

    params: list[tuple[str, tuple[int, ...], object]] = [("model.embed_tokens.weight", (rows(0), WIDTH), BF16)]
    layer = 0
    while len(params) < count:
        prefix = f"model.layers.{layer}."
        for name in ("input_layernorm.weight",):
            params.append((prefix + name, (rows(len(params)),), F32))
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight"):
            params.append((prefix + name, (rows(len(params)), WIDTH), BF16))
        params.append((prefix + "post_attention_layernorm.weight", (rows(len(params)),), F32))
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            params.append((prefix + name, (rows(len(params)), WIDTH), BF16))
        layer += 1
    params.append(("model.norm.weight", (rows(len(params)),), F32))
    params.append(("lm_head.weight", (rows(len(params)), WIDTH), BF16))
    return params


def state_entries(n_tensors: int, n_steps: int = 100) -> list[tuple[str, tuple[int, ...], object]]:
    """Exactly `n_tensors` entries: model parameters, then optimizer state per parameter.

    Parameter i gets a 0-d `step` when i < n_steps (all of them when n_steps < 0).
    """
    n_params = 1
    while n_params * 3 + (n_params if n_steps < 0 else min(n_steps, n_params)) < n_tensors:
        n_params += 1
    params = model_parameters(n_params)
    entries = list(params)
    for i, (_fqn, shape, _dtype) in enumerate(params):
        if n_steps < 0 or i < n_steps:
            entries.append((f"optimizer.state.{i}.step", (), F32))
        entries.append((f"optimizer.state.{i}.exp_avg", shape, F32))
        entries.append((f"optimizer.state.{i}.exp_avg_sq", shape, F32))
    return entries[:n_tensors]


def build(out: Path, ranks: int, n_tensors: int, n_steps: int = 100) -> dict:
    """Write the checkpoint into `out` (recreated); return counts for the caller to print."""
    entries = state_entries(n_tensors, n_steps)
    largest = max((d.itemsize * (s[0] if s else 1) * (s[1] if len(s) > 1 else 1)) for _, s, d in entries)
    zeros = memoryview(bytes(largest))  # every chunk's bytes are a prefix of one zero buffer
    tensors = {}
    n_chunks = 0
    replicated = 0
    for fqn, shape, dt in entries:
        if not shape:
            rank = replicated % ranks
            replicated += 1
            chunks = [ChunkData(rank, Box((), ()), zeros[:dt.itemsize])]
        else:
            row = dt.itemsize * (shape[1] if len(shape) > 1 else 1)
            rest = (0,) * (len(shape) - 1)
            chunks = [
                ChunkData(rank, Box((start,) + rest, (size,) + shape[1:]), zeros[:size * row])
                for rank, (start, size) in enumerate(balanced_parts(shape[0], ranks))
            ]
        n_chunks += len(chunks)
        tensors[fqn] = (dt, shape, chunks)
    n_params = sum(1 for fqn, _, _ in entries if not fqn.startswith("optimizer."))
    values = {
        "optimizer.param_groups.0.lr": (0, 3e-4),
        "optimizer.param_groups.0.betas": (0, (0.9, 0.95)),
        "optimizer.param_groups.0.eps": (0, 1e-8),
        "optimizer.param_groups.0.weight_decay": (0, 0.1),
        "optimizer.param_groups.0.params": (0, list(range(n_params))),
        "extra_state.global_step": (min(1, ranks - 1), 1000),
        "extra_state.run_name": (min(1, ranks - 1), "synthetic-bench"),
        "extra_state.config": (min(2, ranks - 1), {"ranks": ranks, "tensors": n_tensors, "width": WIDTH}),
    }
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_checkpoint(out, tensors, values, framework="torch")
    return {"tensors": len(tensors), "chunks": n_chunks, "values": len(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("out", type=Path, help="output directory (deleted and recreated)")
    parser.add_argument("--ranks", type=int, default=64, help="world size (default 64)")
    parser.add_argument("--tensors", type=int, default=10_000, help="number of tensor entries (default 10000)")
    parser.add_argument("--steps", type=int, default=100,
                        help="0-d optimizer `step` tensors for the first N parameters (-1: every parameter; default 100)")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.tensors < 1:
        parser.error("--ranks and --tensors must be positive")
    start = time.perf_counter()
    counts = build(args.out, args.ranks, args.tensors, args.steps)
    elapsed = time.perf_counter() - start
    files = [p for p in args.out.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    meta = (args.out / ".metadata").stat().st_size
    print(f"wrote {args.out}: {counts['tensors']} tensors in {counts['chunks']} chunks, {counts['values']} values, "
          f"{len(files)} files, {total / 2**20:.1f} MiB (.metadata {meta / 2**20:.1f} MiB) in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
