#!/usr/bin/env python3
"""Peak memory of writes to and from an object store, against the same command without a write
(`hpckpt inspect` of the store's copy: the interpreter, hpckpt and the client) and a local write.

    python bench/bench_s3_memory.py [--size-gib 1] [--max-memory 64MiB] [--ckpt DIR]

A 4-rank PyTorch DCP checkpoint (`bench/torch_dcp_make.py` under torchrun, unless `--ckpt` names
one) is resharded to 2 ranks: local -> local, local -> store, store -> store, store -> local, and
consolidated local -> store (one object). Each command is a child process; its peak RSS is
`/usr/bin/time -f %M`. The store is s3rver (`bench_s3.py --server s3rver` installs it), whose data
directory is removed at the end. Figures of 2026-12-04: docs/benchmarks.md, "Object storage".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_s3

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--max-memory", default=None, help="passed to every writing command (default: hpckpt's)")
    ap.add_argument("--ckpt", type=Path, help="a checkpoint to use instead of making one")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hpckpt-bench-s3-memory-"))
    server = None
    try:
        ckpt = args.ckpt
        if ckpt is None:
            ckpt = work / "dcp"
            torchrun = Path(sys.executable).with_name("torchrun")
            subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "4", str(REPO / "bench" / "torch_dcp_make.py"),
                            "--size-gib", str(args.size_gib), "--dcp", str(ckpt)], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
        server, env = bench_s3.start_s3rver()
        env = {**os.environ, **env}
        extra = ["--max-memory", args.max_memory] if args.max_memory else []
        store = f"s3://{bench_s3.BUCKET}"
        rows = [
            ("local -> local", ["reshard", str(ckpt), "-o", str(work / "local"), "--world-size", "2", *extra]),
            ("local -> store", ["reshard", str(ckpt), "-o", f"{store}/a", "--world-size", "2", *extra]),
            ("inspect of the store (baseline)", ["inspect", f"{store}/a"]),
            ("store -> store", ["reshard", f"{store}/a", "-o", f"{store}/b", "--world-size", "4", *extra]),
            ("store -> local", ["reshard", f"{store}/a", "-o", str(work / "back"), "--world-size", "4", *extra]),
            ("consolidate local -> store", ["consolidate", str(ckpt), "-o", f"{store}/one.safetensors", *extra]),
        ]
        print(f"{'command':34} {'seconds':>8} {'peak RSS (MiB)':>15}")
        for label, argv in rows:
            t0 = time.perf_counter()
            done = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "hpckpt", *argv], env=env,
                                  capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            if done.returncode:
                raise SystemExit(f"{label} failed:\n{done.stderr[-2000:]}")
            peak = int(done.stderr.strip().splitlines()[-1]) / 1024
            print(f"{label:34} {seconds:8.2f} {peak:15.0f}", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait()
            shutil.rmtree(server.data_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
