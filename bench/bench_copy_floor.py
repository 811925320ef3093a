"""What bounds `hpckpt reshard --no-fsync` against `cp -r`: the process's start, and the copy's CPU.

    python bench/bench_copy_floor.py SRC [--rounds 7] [--out DIR]

SRC is a HyperParallel checkpoint on 4 ranks (`bench/bench_engine.py` makes one of 1.5 GiB in
`bench/out/engine/ckpt/hp`). Each round runs, one after the other and in a rotating order (so
that no command always follows the same one), with the output removed and `sync` run before
each, the page cache warm:

  cp -r            the files copied (GNU cp: `copy_file_range`, the copy made in the kernel);
  reshard          `hpckpt reshard SRC --world-size 8 --no-fsync` (reads, hashes every byte
                   for the manifest, writes);
  reshard, no manifest   the same with `--no-manifest` (no hash: `copy_file_range` where a
                   chunk's bytes are whole in one file);
  start-up         `hpckpt reshard examples/tiny-hp --world-size 8 --no-fsync` (428 bytes: the
                   process, its imports and a plan, nothing to copy);
  imports floor    `python -c "import numpy, typer, rich.console"` (what hpckpt needs before any
                   of its own code).

Each gives wall seconds and CPU seconds (user + system, of the whole process tree, from
`wait4`; the system part, the kernel's, apart), best and median over the rounds, and for the two reshards the median of the per-round
ratio `cp -r` / reshard (hpckpt's goal: >= 0.8). CPU per GiB shows what each copy costs the
machine: on 2 cores a copy that must read, hash and write every byte in user space is bounded by
that CPU, where `cp` hands the whole copy to the kernel. The load average is printed before and
after: this machine's page allocation varies by 2-4x from minute to minute (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str]) -> tuple[float, float, float]:
    """(wall, CPU, system CPU) seconds of `cmd`, its children included."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HPCKPT_NO_CACHE="1")
    with tempfile.TemporaryFile() as err:  # (a pipe read only after the exit could fill and stall it)
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=str(ROOT))
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            sys.exit(f"failed: {' '.join(cmd)}\n{err.read().decode(errors='replace')[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_stime


def size_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "copy-floor")
    args = ap.parse_args()
    hpckpt = [sys.executable, "-m", "hpckpt", "-q", "reshard"]
    out = args.out
    commands = {
        "cp -r": ["cp", "-r", str(args.src), str(out)],
        "reshard": [*hpckpt, str(args.src), "-o", str(out), "--world-size", "8", "--no-fsync"],
        "reshard, no manifest": [*hpckpt, str(args.src), "-o", str(out), "--world-size", "8", "--no-fsync",
                                 "--no-manifest"],
        "start-up": [*hpckpt, str(ROOT / "examples" / "tiny-hp"), "-o", str(out), "--world-size", "8", "--no-fsync"],
        "imports floor": [sys.executable, "-c", "import numpy, typer, rich.console"],
    }
    gib = size_gib(args.src)
    print(f"source {args.src}: {gib:.2f} GiB; load average {os.getloadavg()[0]:.2f}", flush=True)
    subprocess.run(["cp", "-r", str(args.src), str(out)], check=True)  # the source into the page cache, once
    shutil.rmtree(out)
    names = list(commands)
    samples: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            samples[name].append(run(commands[name]))
        print(f"round {r + 1}: " + ", ".join(f"{n} {samples[n][-1][0]:.2f} s" for n in names), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print("| command | wall best / median s | CPU best / median s | of it system (kernel), median s | "
          "CPU s per GiB (median) | cp -r / it, median of rounds |")
    print("|---|---|---|---|---|---|")
    for name in names:
        walls, cpus = [w for w, _, _ in samples[name]], [c for _, c, _ in samples[name]]
        system = statistics.median(k for _, _, k in samples[name])
        per_gib = f"{statistics.median(cpus) / gib:.2f}" if name in ("cp -r", "reshard", "reshard, no manifest") else ""
        ratio = ""
        if name.startswith("reshard"):
            ratio = f"{statistics.median(c[0] / s[0] for c, s in zip(samples['cp -r'], samples[name])):.2f}"
        print(f"| {name} | {min(walls):.2f} / {statistics.median(walls):.2f} | {min(cpus):.2f} / "
              f"{statistics.median(cpus):.2f} | {system:.2f} | {per_gib} | {ratio} |")


if __name__ == "__main__":
    main()
