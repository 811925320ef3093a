"""How often a job that checkpoints and then ends normally dies at exit: hpckpt against torch alone.

    python bench/exit_aborts.py                      # 200 jobs a side, 3 ranks
    python bench/exit_aborts.py --runs 40 --ranks 2 --sides hpckpt

Each job is `tests/dist_scripts/exit_job.py` under torchrun: an FSDP2 model on a mesh of every
rank, one checkpoint operation, its check, `dist.destroy_process_group()`, a normal interpreter
exit. The hpckpt side rotates through its paths (save, async_save, save with storage
coordination, load, load with broadcast), the torch side through torch DCP's (save, async_save,
load) and a bare `all_gather_object`; the two sides alternate job by job, so both meet the same
machine. A job counts as an abort when torchrun reports a rank killed by a signal or a rank
printed "terminate called"; as failed when a rank reported a failed check or exited non-zero
otherwise. The table gives aborts per path and side, with a 95 % Wilson upper bound on the rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "dist_scripts" / "exit_job.py"
SIDES = {"hpckpt": ("save", "async_save", "save-storage", "load", "load-broadcast"),
         "torch": ("dcp-save", "dcp-async-save", "dcp-load", "all-gather")}


def torchrun(ranks: int, *args: str, timeout: float = 300) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="0")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(JOB), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return -1, f"timeout\n{exc.stdout or ''}{exc.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


def outcome(code: int, text: str, ranks: int, path: str) -> str:
    """ok, abort (a rank killed by a signal at exit) or failed (a check failed, a crash)."""
    if "terminate called" in text or "(SIGABRT)" in text or "Signal 6" in text:
        return "abort"
    if code == 0 and len(re.findall(rf"rank \d+: OK {re.escape(path)}\.", text)) == ranks:
        return "ok"
    return "failed"


def upper95(k: int, n: int) -> float:
    """Wilson score upper bound of a binomial rate."""
    if n == 0:
        return 1.0
    z, p = 1.96, k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre + spread) / (1 + z * z / n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="jobs per side")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--sides", default="hpckpt,torch", help="comma-separated: hpckpt, torch")
    parser.add_argument("--json", type=Path, default=None, help="also write the counts here")
    parser.add_argument("--keep-logs", type=Path, default=None, help="write each failed job's output here")
    args = parser.parse_args()
    sides = [s for s in args.sides.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="hpckpt-exit-"))
    try:
        code, text = torchrun(args.ranks, str(work), "setup")
        if outcome(code, text, args.ranks, "setup") != "ok":
            print(f"setup failed (exit {code}):\n{text[-3000:]}", file=sys.stderr)
            return 1
        counts: dict[tuple[str, str], Counter] = {}
        started = time.monotonic()
        for i in range(args.runs):
            for side in sides:
                path = SIDES[side][i % len(SIDES[side])]
                code, text = torchrun(args.ranks, str(work), path, f"run-{i}")
                shutil.rmtree(work / f"run-{i}", ignore_errors=True)
                result = outcome(code, text, args.ranks, path)
                counts.setdefault((side, path), Counter())[result] += 1
                if result != "ok" and args.keep_logs:
                    args.keep_logs.mkdir(parents=True, exist_ok=True)
                    (args.keep_logs / f"{side}-{path}-{i}.log").write_text(text)
            if (i + 1) % 10 == 0:
                done = {s: sum(c["abort"] for (side, _), c in counts.items() if side == s) for s in sides}
                print(f"[{time.monotonic() - started:6.0f} s] {i + 1} rounds; aborts so far {done}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.runs} jobs a side, {args.ranks} ranks, python {sys.version.split()[0]}")
    print(f"{'side':8} {'path':16} {'jobs':>5} {'aborts':>7} {'failed':>7} {'rate':>7} {'95% upper':>10}")
    rows = []
    for side in sides:
        total = Counter()
        for path in SIDES[side]:
            c = counts.get((side, path), Counter())
            total.update(c)
            rows.append((side, path, c))
        rows.append((side, "(all)", total))
    for side, path, c in rows:
        n = sum(c.values())
        print(f"{side:8} {path:16} {n:5d} {c['abort']:7d} {c['failed']:7d} {c['abort'] / max(n, 1):7.1%} "
              f"{upper95(c['abort'], n):10.1%}")
    if args.json:
        args.json.write_text(json.dumps([{"side": s, "path": p, **dict(c)} for s, p, c in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
