"""What a live save costs one process besides the bytes: wall and CPU of `hdist.save`, and its commit's read-back.

    python bench/bench_save_cpu.py [--tensors 256] [--rows 1024] [--cols 768] [--repeat 7]
    PYTHONPATH=SNAPSHOT python bench/bench_save_cpu.py     # another commit (a `git archive` of it)

One process, no process group (`no_dist=True`): a state of `--tensors` bfloat16 tensors of
`--rows` x `--cols` (256 x 1024 x 768: 384 MiB, a rank's share of the 1.5 GiB state on 4 ranks),
saved `--repeat` times after one unmeasured save, each into a fresh directory after `sync`, the
cyclic collector off during each (a full collection lands in some saves and not others). Prints
the best and median wall seconds and the median user and system CPU seconds of the saves.

Then the commit's read-back: the saved `.metadata` read as the HyperParallel reader reads it,
`--repeat` times each, with the opcode pre-scan (any loader) and without it (a write reading back
what it has just staged, `core.safety.unpickle.reading_own_output`), the collector off as well.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=256)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    import torch

    import hpckpt
    import hpckpt.dist as hdist
    from hpckpt.converters.hyperparallel.reader import HyperParallelReader
    from hpckpt.core.safety.unpickle import reading_own_output

    state = {f"layers.{i}.weight": torch.randn(args.rows, args.cols).to(torch.bfloat16) for i in range(args.tensors)}
    mib = args.tensors * args.rows * args.cols * 2 / 2**20
    print(f"hpckpt from {Path(hpckpt.__file__).parent}; {args.tensors} tensors, {mib:.0f} MiB; "
          f"load average {os.getloadavg()[0]:.2f}")
    scratch = Path(__file__).resolve().parent / "out"
    scratch.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hpckpt-save-cpu-", dir=scratch) as tmp:
        dest = Path(tmp) / "ckpt"

        def save() -> tuple[float, float, float]:
            shutil.rmtree(dest, ignore_errors=True)
            os.sync()
            before = resource.getrusage(resource.RUSAGE_SELF)
            gc.disable()
            try:
                started = time.perf_counter()
                hdist.save(state, dest, no_dist=True)
                wall = time.perf_counter() - started
            finally:
                gc.enable()
            after = resource.getrusage(resource.RUSAGE_SELF)
            return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime

        save()
        runs = [save() for _ in range(args.repeat)]
        walls = [r[0] for r in runs]
        print(f"save: wall best {min(walls):.3f} s, median {statistics.median(walls):.3f} s; CPU median user "
              f"{statistics.median(r[1] for r in runs):.3f} s, system {statistics.median(r[2] for r in runs):.3f} s")

        reader = HyperParallelReader()

        def read_back() -> float:
            gc.disable()
            try:
                started = time.perf_counter()
                reader.read_index(dest)
                return time.perf_counter() - started
            finally:
                gc.enable()

        scanned, own = [], []
        for _ in range(args.repeat):
            scanned.append(read_back())
            with reading_own_output():
                own.append(read_back())
        size = (dest / ".metadata").stat().st_size
        print(f"read-back of its {size / 1024:.0f} KiB .metadata: with the opcode scan median "
              f"{statistics.median(scanned) * 1000:.1f} ms, without {statistics.median(own) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
