"""Write the inputs of `bench/bench_mindspore.py` with MindSpore's own `save_checkpoint`.

    python bench/ms_make.py --size-gib 1.0 --out bench/out/mindspore/ckpt

Writes, under OUT:
    single/model.ckpt                         the whole state, one .ckpt        (format="ckpt")
    single/model.safetensors                  the whole state, one safetensors  (format="safetensors")
    ranks-ckpt/rank_{r}/checkpoint_{r}.ckpt   rank r's dim-0 slices, r = 0..3   (format="ckpt")
    ranks-st/rank_{r}/checkpoint_{r}.safetensors   the same, as safetensors     (format="safetensors")
    strategy/src_4.json, strategy/dst_8.json  hand-written strategy files, JSON form
    strategy/src_4.ckpt, strategy/dst_8.ckpt  the same as protobuf ParallelStrategyMap
and prints one JSON line (seconds spent in each save).

Every value is wrapped in `mindspore.Parameter(..., name=key)`: `save_checkpoint(dict)` silently
drops plain Tensors (see docs). MindSpore saves each rank's file in semi-auto parallel the same way:
the local slice under the parameter's full name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ms_state  # noqa: E402


def strategy_protobuf(doc: dict) -> bytes:
    """The JSON strategy as MindSpore's protobuf `ParallelStrategyMap` (node_strategy.proto)."""
    from mindspore.train import node_strategy_pb2 as pb

    smap = pb.ParallelStrategyMap()
    smap.current_stage = doc["current_stage"]
    for node, item in doc["parallel_strategy_item"].items():
        s = smap.parallel_strategy_item.add()
        s.node_name = node
        s.parallel_strategys.stage = item["stage"]
        for dims in item["parallel_strategy"]:
            s.parallel_strategys.parallel_strategy.add().dim.extend(dims)
    for name, lay in doc["parallel_layout_item"].items():
        li = smap.parallel_layout_item.add()
        li.param_name = name
        p = li.parallel_layouts
        p.dev_matrix.add().dim.extend(lay["dev_matrix"])
        p.tensor_map.add().dim.extend(lay["tensor_map"])
        p.param_split_shape.add().dim.extend(lay["param_split_shape"])  # one entry even if empty
        p.indices_offset.add().dim.extend(lay["indices_offset"])
        p.field = lay["field"]
        p.opt_weight_shard_step = lay["opt_weight_shard_step"]
        p.opt_weight_shard_size = lay["opt_weight_shard_size"]
    return smap.SerializeToString()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-gib", type=float, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import mindspore as ms
    import numpy as np

    out: Path = args.out
    world = ms_state.WORLD
    times = {}

    def param(name: str, arr: np.ndarray, dtype: str):
        # bf16: `arr` is the float32 value of the bf16 number, so the cast is exact.
        t = ms.Tensor(arr, dtype=ms.bfloat16) if dtype == "bfloat16" else ms.Tensor(arr)
        return ms.Parameter(t, name=name, requires_grad=False)

    def full(name: str, dtype: str) -> np.ndarray:
        return ms_state.as_float32(ms_state.expected(args.size_gib, name), dtype)

    # The whole state, one file per format.
    (out / "single").mkdir(parents=True, exist_ok=True)
    state = {name: param(name, full(name, dtype), dtype) for name, _shape, dtype in ms_state.spec(args.size_gib)}
    for fmt, fname in (("ckpt", "model.ckpt"), ("safetensors", "model.safetensors")):
        t0 = time.perf_counter()
        ms.save_checkpoint(state, str(out / "single" / fname), format=fmt)
        times[f"single_{fmt}"] = time.perf_counter() - t0
    del state

    # Rank r's slices (MindSpore semi-auto parallel: dim 0 over 4 devices; the 0-d one replicated).
    for r in range(world):
        local = {}
        for name, shape, dtype in ms_state.spec(args.size_gib):
            if shape:
                lo, hi = ms_state.rows_of(r, world, shape[0])
                arr = ms_state.as_float32(ms_state.expected(args.size_gib, name, lo, hi), dtype)
            else:
                arr = full(name, dtype)
            local[name] = param(name, arr, dtype)
        for fmt, sub, ext in (("ckpt", "ranks-ckpt", "ckpt"), ("safetensors", "ranks-st", "safetensors")):
            d = out / sub / f"rank_{r}"
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            ms.save_checkpoint(local, str(d / f"checkpoint_{r}.{ext}"), format=fmt)
            times[f"rank_{fmt}"] = times.get(f"rank_{fmt}", 0.0) + time.perf_counter() - t0
        del local

    # Strategy files: 4 devices (the source) and 8 (transform_checkpoints' destination).
    sdir = out / "strategy"
    sdir.mkdir(parents=True, exist_ok=True)
    for n, stem in ((world, "src_4"), (8, "dst_8")):
        doc = ms_state.strategy(n, args.size_gib)
        (sdir / f"{stem}.json").write_text(json.dumps(doc, indent=1))
        (sdir / f"{stem}.ckpt").write_bytes(strategy_protobuf(doc))

    # Both forms must give MindSpore the same layouts.
    from mindspore.parallel._parallel_serialization import _build_searched_strategy, _convert_to_list

    for stem in ("src_4", "dst_8"):
        a = _convert_to_list(_build_searched_strategy(str(sdir / f"{stem}.json")))
        b = _convert_to_list(_build_searched_strategy(str(sdir / f"{stem}.ckpt")))
        if a != b:
            print(f"strategy forms differ for {stem}", file=sys.stderr)
            return 1
    for p in out.rglob("*"):  # save_checkpoint leaves files 0400; let later steps replace them
        if p.is_file():
            os.chmod(p, 0o644)
    print(json.dumps({"save_s": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
