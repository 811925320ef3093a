"""How close `reshard --plan`'s predicted time comes to the real run's, on this machine.

A HyperParallel checkpoint of `--size-gib` GiB on 4 ranks (random float32 and bfloat16 tensors)
is resharded onto 8 ranks: first `--plan` (the bandwidth probes run on an empty cache, as on a new
machine), then the real reshard `--rounds` times (fsynced, and with --no-fsync), each from the
page cache as the probe read it. Prints the predicted and the measured seconds (the command's own
`seconds`, the median of the rounds) and their ratio; the goal is a ratio within 0.75..1.25. Then
the write probe alone at three sizes, twice each (what a fixed cost per fsync does to it).

    python bench/bench_predict.py --size-gib 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HPCKPT = [sys.executable, "-m", "hpckpt"]


def make_source(root: Path, size_gib: float) -> None:
    from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
    from hpckpt.core import dtypes
    from hpckpt.core.geometry.box import Box

    rng = np.random.default_rng(0)
    tensors, total, i = {}, int(size_gib * 2**30), 0
    while total > 0:
        rows, cols = 4096, 2048
        dtype = np.float32 if i % 2 else np.uint16  # bfloat16 as its raw bits
        array = rng.integers(0, 2**16, (rows, cols), dtype=np.uint16) if dtype is np.uint16 else \
            rng.standard_normal((rows, cols), dtype=np.float32)
        name = dtypes.dtype("bfloat16" if dtype is np.uint16 else "float32")
        quarter = rows // 4
        tensors[f"layers.{i}.weight"] = (name, (rows, cols), [
            ChunkData(r, Box((r * quarter, 0), (quarter, cols)), array[r * quarter:(r + 1) * quarter].tobytes())
            for r in range(4)])
        total -= array.nbytes
        i += 1
    write_checkpoint(root, tensors, {"step": (0, 1)})


def run(*args: str, env: dict) -> dict:
    done = subprocess.run([*HPCKPT, *args, "--json"], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scratch", default=tempfile.gettempdir())
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hpckpt-bench-predict-", dir=args.scratch))
    try:
        src, out = scratch / "src", scratch / "out"
        make_source(src, args.size_gib)
        print(f"| write | predicted s | measured s (median of {args.rounds}) | predicted / measured | bandwidth used |")
        print("|---|---|---|---|---|")
        for sync in (True, False):
            env = {**os.environ, "HPCKPT_CACHE_DIR": str(scratch / "cache")}  # an empty cache: the probes run
            flags = [] if sync else ["--no-fsync"]
            plan = run("reshard", str(src), "-o", str(out), "--world-size", "8", "--plan", *flags, env=env)
            predicted = plan["prediction"]["seconds"]
            measured = []
            for _ in range(args.rounds):
                shutil.rmtree(out, ignore_errors=True)
                done = run("reshard", str(src), "-o", str(out), "--world-size", "8", *flags, env=env)
                measured.append(done["seconds"])
                assert done["prediction"]["seconds"] == predicted  # the real run finds the cached figures
            median = statistics.median(measured)
            p = plan["prediction"]
            print(f"| {'fsynced' if sync else '--no-fsync'} | {predicted:.2f} | {median:.2f} "
                  f"({', '.join(f'{m:.2f}' for m in measured)}) | {predicted / median:.2f} | read "
                  f"{p['read_bytes_per_s'] / 2**30:.2f} GiB/s, write {p['write_bytes_per_s'] / 2**30:.2f} GiB/s |")
        from hpckpt.core.io.bandwidth import probe_write

        print("\n| write probe, fsynced | MiB/s (twice) |\n|---|---|")
        for mib in (16, 64, 256):
            speeds = [probe_write(scratch, True, mib << 20) / 2**20 for _ in range(2)]
            print(f"| {mib} MiB | {speeds[0]:.0f}, {speeds[1]:.0f} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
