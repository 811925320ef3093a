"""How close `reshard --plan`'s predicted time comes to the real run's, on this machine.

A HyperParallel checkpoint of `--size-gib` GiB on 4 ranks (random float32 and bfloat16 tensors)
is resharded onto 8 ranks, `--trials` times fsynced and as many with --no-fsync. Each trial is
what a user does on a new machine: `--plan` on an empty cache (the probes run), then the real
reshard, both after `sync` (no earlier write still draining). Prints each trial's predicted and
measured seconds (the command's own `seconds`) and their ratio, and the median ratio; the goal is
within 0.75..1.25. Then what bounds it here: the time to touch 1 GiB of memory the process never
had, against the same memory touched again (a virtual machine whose host hands out pages lazily
makes the first slow, and a run's page cache is such memory).

    python bench/bench_predict.py --size-gib 1 --trials 5
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


def fresh_memory_seconds() -> tuple[float, float]:
    """Seconds to fill 1 GiB of memory the process never touched, then the same again."""
    code = ("import time, numpy as np\n"
            "a = np.empty(1 << 30, np.uint8); t = time.perf_counter(); a.fill(1); first = time.perf_counter() - t\n"
            "t = time.perf_counter(); a.fill(2); print(first, time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, again = map(float, done.stdout.split())
    return first, again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--scratch", default=tempfile.gettempdir())
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hpckpt-bench-predict-", dir=args.scratch))
    try:
        src, out = scratch / "src", scratch / "out"
        make_source(src, args.size_gib)
        print("| write | predicted s, measured s (every trial) | predicted / measured | median | probed rates |")
        print("|---|---|---|---|---|")
        for sync in (True, False):
            flags = [] if sync else ["--no-fsync"]
            trials = []
            for _ in range(args.trials):
                env = {**os.environ, "HPCKPT_CACHE_DIR": str(scratch / "cache")}
                shutil.rmtree(scratch / "cache", ignore_errors=True)  # an empty cache: the probes run
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                p = run("reshard", str(src), "-o", str(out), "--world-size", "8", "--plan", *flags, env=env)["prediction"]
                os.sync()
                done = run("reshard", str(src), "-o", str(out), "--world-size", "8", *flags, env=env)
                assert done["prediction"]["seconds"] == p["seconds"]  # the real run finds the cached figures
                trials.append((p, done["seconds"]))
            ratios = [p["seconds"] / m for p, m in trials]
            rates = ", ".join(f"{p['read_bytes_per_s'] / 2**30:.1f}/{p['write_bytes_per_s'] / 2**30:.2f} GiB/s "
                              f"+{p['write_seconds_per_file'] * 1e3:.1f} ms" for p, _ in trials)
            pairs = ", ".join(f"{p['seconds']:.2f}/{m:.2f}" for p, m in trials)
            print(f"| {'fsynced' if sync else '--no-fsync'} | "
                  f"{pairs} | "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} | **{statistics.median(ratios):.2f}** | read/write {rates} |")
        touches = [fresh_memory_seconds() for _ in range(3)]
        print("\n| 1 GiB of memory | filled first (s) | filled again (s) |\n|---|---|---|")
        for first, again in touches:
            print(f"| a new process | {first:.2f} | {again:.2f} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
