"""A bench-sized kill -9 sweep of the live save: tests/test_dist_kill.py with more points.

    python bench/dist_kill_sweep.py                      # 200 points per save, seed 13
    python bench/dist_kill_sweep.py --points 0 --seed 7  # every call of every rank (0: all)

Runs the test file (pytest, its output shown) with `HPCKPT_KILL_POINTS` and `HPCKPT_KILL_SEED`
set; each save's line says how many calls each rank made, where the commit is, and what the
kills left. The exit code is pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=200, help="points per save (0: every call)")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("-k", default=None, help="only the saves whose test id matches (pytest -k)")
    args = parser.parse_args()
    env = dict(os.environ, HPCKPT_KILL_POINTS=str(args.points or 10**9), HPCKPT_KILL_SEED=str(args.seed))
    command = [sys.executable, "-m", "pytest", "-q", "-s", str(REPO / "tests" / "test_dist_kill.py")]
    if args.k:
        command += ["-k", args.k]
    return subprocess.run(command, cwd=REPO, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
