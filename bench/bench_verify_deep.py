"""Benchmark `hpckpt verify --deep` (and `--nan`) against reading the files with `cat`.

    python bench/bench_verify_deep.py [--gib 2] [--ranks 4] [--repeat 3] [--ckpt DIR] [--regenerate]

Builds, when absent, a HyperParallel checkpoint of about `--gib` GiB under `bench/out/`
(git-ignored): a safetensors file of random float32 and bfloat16 tensors written with numpy
and `safetensors`, converted by `hpckpt convert --to hp --world-size RANKS` (so it has hpckpt's
manifest); the source is deleted afterwards. Then, with the page cache warm (one unmeasured run of
each command first), times as child processes, start to exit, the best of `--repeat` runs of:
`cat` of every data file to /dev/null (the peer), `hpckpt verify`, `verify --deep`,
`verify --deep --nan`, and `verify --deep` without the manifest (every chunk read through the
reader). Prints seconds, GiB/s of the data files and each time as a ratio of `cat`'s.
Target: `verify --deep` at least 1 GB/s warm on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
HPCKPT = [sys.executable, "-m", "hpckpt"]


def build(ckpt: Path, gib: float, ranks: int) -> None:
    from safetensors.numpy import save_file

    src = ckpt.parent / "verify-deep-src.safetensors"
    rng = np.random.default_rng(0)
    tensor_bytes = 64 << 20
    count = max(1, int(gib * (1 << 30)) // tensor_bytes)
    tensors = {}
    for i in range(count):  # a mix of float32 (with a NaN and an Inf here and there) and raw bf16 bits
        if i % 2:
            tensors[f"layers.{i}.weight"] = rng.integers(0, 0x7F00, size=(4096, tensor_bytes // 8192), dtype=np.uint16)
        else:
            a = rng.standard_normal((4096, tensor_bytes // 16384), dtype=np.float32)
            a[i % 4096, 0] = np.nan if i % 4 == 0 else np.inf
            tensors[f"layers.{i}.weight"] = a
    save_file(tensors, str(src))
    del tensors
    shutil.rmtree(ckpt, ignore_errors=True)
    subprocess.run([*HPCKPT, "--no-progress", "-q", "convert", str(src), "-o", str(ckpt), "--to", "hp",
                    "--world-size", str(ranks)], check=True)
    src.unlink()


def timed(argv: list[str], repeat: int, env: dict | None = None) -> float:
    subprocess.run(argv, stdout=subprocess.DEVNULL, env=env)  # warm: the page cache and the imports
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ckpt", type=Path, default=HERE / "out" / "verify-deep")
    parser.add_argument("--regenerate", action="store_true")
    args = parser.parse_args()
    ckpt = args.ckpt
    if args.regenerate or not (ckpt / ".metadata").is_file():
        print(f"building {ckpt} ({args.gib} GiB, {args.ranks} ranks)...", flush=True)
        build(ckpt, args.gib, args.ranks)
    files = sorted(str(p) for p in ckpt.iterdir() if p.suffix in (".safetensors", ".bytes"))
    data = sum(os.path.getsize(f) for f in files)
    print(f"{ckpt}: {len(files)} data files, {data / 2**30:.2f} GiB; {os.cpu_count()} cores; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    bare = ckpt.parent / (ckpt.name + "-no-manifest")  # the same files, no manifest (hard links)
    if not (bare / ".metadata").is_file():
        shutil.rmtree(bare, ignore_errors=True)
        bare.mkdir()
        for p in ckpt.iterdir():
            if p.name != ".hpckpt-manifest.jsonl":
                os.link(p, bare / p.name)
    runs = [("cat DATA_FILES > /dev/null", ["cat", *files]),
            ("hpckpt verify", [*HPCKPT, "--no-progress", "verify", str(ckpt)]),
            ("hpckpt verify --deep", [*HPCKPT, "--no-progress", "verify", "--deep", str(ckpt)]),
            ("hpckpt verify --deep --nan", [*HPCKPT, "--no-progress", "verify", "--deep", "--nan", str(ckpt)]),
            ("hpckpt verify --deep (no manifest)", [*HPCKPT, "--no-progress", "verify", "--deep", str(bare)])]
    results = []
    for what, argv in runs:
        results.append((what, timed(argv, args.repeat)))
        print(f"  {what}: {results[-1][1]:.3f} s", flush=True)
    peer = results[0][1]
    print("\n| command | seconds (best of %d, warm) | GiB/s of data | x cat |" % args.repeat)
    print("|---|---:|---:|---:|")
    for what, seconds in results:
        print(f"| `{what}` | {seconds:.3f} | {data / seconds / 2**30:.2f} | {seconds / peer:.2f} |")
    print(f"\nload {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
