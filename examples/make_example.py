"""Build `examples/tiny-hp/`: a tiny HyperParallel DCP checkpoint "saved by 2 ranks".

    python examples/make_example.py [OUT_DIR]      # default: tiny-hp/ next to this script

The output directory is deleted and recreated; the files are deterministic (rerunning gives
byte-identical files). What it holds, as a trainer's `{"model", "optimizer", "extra_state"}` state
dict would flatten to:

| FQN                                   | dtype    | shape  | layout on 2 ranks                       |
|---------------------------------------|----------|--------|-----------------------------------------|
| model.embed_tokens.weight             | float32  | [9, 4] | dim 0, balanced split: rows 0:5 / 5:9   |
| model.layers.0.mlp.down_proj.weight   | bfloat16 | [4, 6] | dim 1 (column shards): cols 0:3 / 3:6   |
| model.norm.weight                     | float32  | [6]    | replicated, stored once (rank 1)        |
| model.position_ids                    | int64    | [1, 8] | replicated, stored once (rank 0)        |
| optimizer.state.0.step                | float32  | []     | replicated, stored once (rank 0) = 100  |
| optimizer.state.0.exp_avg             | float32  | [9, 4] | like the embedding                      |

Values (pickled into `_rank{r}_.bytes`): `optimizer.param_groups.0.lr` = 0.001,
`optimizer.param_groups.0.betas` = (0.9, 0.95) (rank 0); `extra_state.global_step` = 100,
`extra_state.run_name` = "tiny-example" (rank 1).

Every element is an exact small number so that tests and docs can state expected values: the
embedding is `arange(36) * 0.25`, exp_avg is `(arange(36) - 18) * 0.125`, down_proj is `arange(24) * 0.5`
rounded to bfloat16 (exact: the low 16 bits of those float32 values are zero), the norm is all
ones, and position_ids is `arange(8)`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
from hpckpt.core.geometry.box import Box
from hpckpt.core.dtypes import dtype

WORLD_SIZE = 2
DEFAULT_OUT = Path(__file__).resolve().parent / "tiny-hp"

F32, BF16, I64 = dtype("float32"), dtype("bfloat16"), dtype("int64")


def balanced_part(length: int, parts: int, j: int) -> tuple[int, int]:
    """HyperParallel's default split: (start, size) of part `j`; the first `length % parts` are one larger."""
    q, r = divmod(length, parts)
    return j * q + min(j, r), q + (1 if j < r else 0)


def sharded(array: np.ndarray, dim: int, world: int = WORLD_SIZE) -> list[ChunkData]:
    """One chunk per rank, `array` split over `dim` with the balanced rule."""
    chunks = []
    for rank in range(world):
        start, size = balanced_part(array.shape[dim], world, rank)
        offsets = tuple(start if d == dim else 0 for d in range(array.ndim))
        sizes = tuple(size if d == dim else n for d, n in enumerate(array.shape))
        part = array[Box(offsets, sizes).slices()]
        chunks.append(ChunkData(rank, Box(offsets, sizes), np.ascontiguousarray(part).tobytes()))
    return chunks


def stored_once(array: np.ndarray, rank: int) -> list[ChunkData]:
    """A replicated tensor after de-dup: one full chunk, in `rank`'s file."""
    box = Box((0,) * array.ndim, tuple(array.shape))
    return [ChunkData(rank, box, np.ascontiguousarray(array).tobytes())]


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """bfloat16 raw bits (uint16) of float32 values that bfloat16 represents exactly."""
    bits = values.astype("<f4").view("<u4")
    if np.any(bits & 0xFFFF):
        raise ValueError("values are not exact in bfloat16")
    return (bits >> 16).astype("<u2")


def build(out: Path) -> None:
    embed = (np.arange(36, dtype="<f4") * 0.25).reshape(9, 4)
    down = bf16_bits(np.arange(24, dtype="<f4") * 0.5).reshape(4, 6)
    norm = np.ones(6, dtype="<f4")
    position_ids = np.arange(8, dtype="<i8").reshape(1, 8)
    step = np.array(100.0, dtype="<f4")
    exp_avg = ((np.arange(36, dtype="<f4") - 18) * 0.125).reshape(9, 4)

    tensors = {
        "model.embed_tokens.weight": (F32, (9, 4), sharded(embed, 0)),
        "model.layers.0.mlp.down_proj.weight": (BF16, (4, 6), sharded(down, 1)),
        "model.norm.weight": (F32, (6,), stored_once(norm, 1)),
        "model.position_ids": (I64, (1, 8), stored_once(position_ids, 0)),
        "optimizer.state.0.step": (F32, (), stored_once(step, 0)),
        "optimizer.state.0.exp_avg": (F32, (9, 4), sharded(exp_avg, 0)),
    }
    values = {
        "optimizer.param_groups.0.lr": (0, 0.001),
        "optimizer.param_groups.0.betas": (0, (0.9, 0.95)),
        "extra_state.global_step": (1, 100),
        "extra_state.run_name": (1, "tiny-example"),
    }
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_checkpoint(out, tensors, values, framework="torch")


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0] in ("-h", "--help")):
        print(__doc__.strip().splitlines()[2].strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    out = Path(argv[0]) if argv else DEFAULT_OUT
    build(out)
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({len(list(out.iterdir()))} files, {total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
