"""Small, untimed correctness probes of MindSpore's checkpoint tools on layouts that the main state
of `bench/bench_mindspore.py` does not have (it shards every tensor on dim 0 only).

    python bench/ms_probe.py --work /tmp/ms-probe

A 4-rank state with a float32 [16, 32] tensor split on dim 1 (tensor_map [-1, 0]; on every rank a
[16, 8] slice, a column block of the whole tensor) and a bfloat16 [16, 32] tensor split on dim 0,
written by `save_checkpoint` as .ckpt and as safetensors, with hand-written JSON strategies for
4 and 8 devices (same placements). Then:
- `transform_checkpoints` 4 -> 8, .ckpt -> .ckpt and safetensors -> safetensors;
- `unified_safetensors` of the 4 safetensors ranks;
- `merge_sliced_parameter` of the bf16 tensor's 4 slices;
each output compared element by element (numpy) with the slices it should hold. Prints one JSON
line: {"probes": [{"what", "result", "detail"}]}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import traceback
from pathlib import Path

import numpy as np

ROWS, COLS, WORLD = 16, 32, 4


def full_f32() -> np.ndarray:
    return (np.arange(ROWS * COLS, dtype=np.float32) * 0.5 - 7).reshape(ROWS, COLS)


def full_bf16_as_f32() -> np.ndarray:
    return (np.arange(ROWS * COLS, dtype=np.float32) % 97 - 48).reshape(ROWS, COLS)  # exact in bf16


def strategy(world: int) -> dict:
    common = {"param_split_shape": [], "indices_offset": [], "field": 0, "opt_weight_shard_step": 0,
              "opt_weight_shard_size": 0}
    return {
        "current_stage": 0,
        "parallel_strategy_item": {"Default/op0": {"stage": 0, "parallel_strategy": [[1, world]]}},
        "parallel_layout_item": {
            "col.weight": {"dev_matrix": [world], "tensor_map": [-1, 0], **common},
            "row.bf16": {"dev_matrix": [world], "tensor_map": [0, -1], **common},
        },
    }


def expected_slice(name: str, r: int, world: int) -> np.ndarray:
    if name == "col.weight":
        w = COLS // world
        return full_f32()[:, r * w:(r + 1) * w]
    h = ROWS // world
    return full_bf16_as_f32()[r * h:(r + 1) * h]


def as_f32(p) -> np.ndarray:
    import mindspore as ms

    if isinstance(p, np.ndarray):
        return p.astype(np.float32)
    return p.astype(ms.float32).asnumpy() if p.dtype == ms.bfloat16 else p.asnumpy()


def param_problems(label: str, params: dict, name: str, want: np.ndarray) -> list[str]:
    """What is wrong with `params[name]` (missing, dtype, shape, values) against `want` (float32
    values; `row.bf16` must be bfloat16, anything else float32)."""
    import mindspore as ms

    if name not in params:
        return [f"{label}: missing"]
    problems = []
    want_dtype = ms.bfloat16 if name == "row.bf16" else ms.float32
    if params[name].dtype != want_dtype:
        problems.append(f"{label}: dtype {params[name].dtype}, want {want_dtype}")
    got = as_f32(params[name])
    if got.shape != want.shape:
        problems.append(f"{label}: shape {got.shape}, want {want.shape}")
    elif not np.array_equal(got, want):
        problems.append(f"{label}: {int((got != want).sum())} of {want.size} elements wrong")
    return problems


def verdict(problems: list[str], shown: int | None = None) -> tuple[str, str]:
    """(result, detail) of a probe: the first `shown` problems (all by default)."""
    return ("correct", "") if not problems else ("WRONG", "; ".join(problems[:shown]))


def compare_ranks(out: Path, world: int, fmt: str) -> tuple[str, str]:
    import mindspore as ms

    problems = []
    for r in range(world):
        files = sorted((out / f"rank_{r}").glob(f"*.{fmt}"))
        if len(files) != 1:
            problems.append(f"rank {r}: {len(files)} files")
            continue
        params = ms.load_checkpoint(str(files[0]), format=fmt)
        for name in ("col.weight", "row.bf16"):
            problems += param_problems(f"rank {r} {name}", params, name, expected_slice(name, r, world))
    return verdict(problems, 6)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    args = parser.parse_args()
    import mindspore as ms
    import mindspore.train.serialization as ser

    ser._get_available_memory = lambda: None  # tiny files; not a measurement
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("ckpt", "st"):
        for r in range(WORLD):
            (work / sub / f"rank_{r}").mkdir(parents=True)
    for r in range(WORLD):
        local = {
            "col.weight": ms.Parameter(ms.Tensor(np.ascontiguousarray(expected_slice("col.weight", r, WORLD))),
                                       name="col.weight"),
            "row.bf16": ms.Parameter(ms.Tensor(expected_slice("row.bf16", r, WORLD), dtype=ms.bfloat16),
                                     name="row.bf16"),
        }
        ms.save_checkpoint(local, str(work / "ckpt" / f"rank_{r}" / f"checkpoint_{r}.ckpt"))
        ms.save_checkpoint(local, str(work / "st" / f"rank_{r}" / f"checkpoint_{r}.safetensors"), format="safetensors")
    (work / "src_4.json").write_text(json.dumps(strategy(WORLD)))
    (work / "dst_8.json").write_text(json.dumps(strategy(8)))

    probes = []

    def probe(what: str, fn) -> None:
        try:
            result, detail = fn()
        except Exception as exc:  # noqa: BLE001
            result, detail = "error", f"{type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        probes.append({"what": what, "result": result, "detail": detail})

    def transform(src: str, fmt: str):
        out = work / f"out-{src}"
        ms.transform_checkpoints(str(work / src), str(out), "checkpoint_", str(work / "src_4.json"),
                                 str(work / "dst_8.json"), output_format=fmt)
        return compare_ranks(out, 8, fmt)

    probe("`transform_checkpoints` 4 -> 8, .ckpt -> .ckpt, fp32 split on dim 1 and bf16 on dim 0",
          lambda: transform("ckpt", "ckpt"))
    probe("`transform_checkpoints` 4 -> 8, safetensors -> safetensors, fp32 split on dim 1 and bf16 on dim 0",
          lambda: transform("st", "safetensors"))

    def transform_contiguous():
        """Diagnosis: the same with MindSpore's `save_file` handed C-contiguous copies."""
        import mindspore.parallel.transform_safetensors as tst

        original = tst.save_file
        seen = []

        def contiguous_save_file(tensors, filename, metadata=None):
            seen.extend(k for k, v in tensors.items() if not v.flags.c_contiguous)
            return original({k: np.require(v, requirements="C") for k, v in tensors.items()}, filename,
                            metadata=metadata)

        tst.save_file = contiguous_save_file
        try:
            shutil.rmtree(work / "out-st", ignore_errors=True)
            result, detail = transform("st", "safetensors")
        finally:
            tst.save_file = original
        views = sorted(set(seen))
        note = f"non-contiguous arrays handed to safetensors.numpy.save_file: {views or 'none'}"
        return result, (detail + "; " if detail else "") + note

    probe("the same, with `safetensors.numpy.save_file` given C-contiguous copies (diagnosis)", transform_contiguous)

    def unified():
        out = work / "out-unified"
        from mindspore.parallel import unified_safetensors

        unified_safetensors(str(work / "st"), str(work / "src_4.json"), str(out))
        got = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(ms.load_checkpoint(str(f), format="safetensors"))
        problems = []
        for name, want in (("col.weight", full_f32()), ("row.bf16", full_bf16_as_f32())):
            problems += param_problems(name, got, name, want)
        return verdict(problems)

    probe("`unified_safetensors` of the 4 safetensors ranks (fp32 split on dim 1, bf16 on dim 0)", unified)

    def merge():
        from mindspore.parallel import merge_sliced_parameter

        slices = [ms.Parameter(ms.Tensor(expected_slice("row.bf16", r, WORLD), dtype=ms.bfloat16), name="row.bf16")
                  for r in range(WORLD)]
        merged = merge_sliced_parameter(slices)
        problems = []
        if merged.dtype != ms.bfloat16:
            problems.append(f"returns {merged.dtype} for bfloat16 slices")
        if not np.array_equal(as_f32(merged), full_bf16_as_f32()):
            problems.append("values differ")
        return verdict(problems)

    probe("`merge_sliced_parameter` of 4 bfloat16 dim-0 slices", merge)
    print(json.dumps({"probes": probes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
