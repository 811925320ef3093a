"""Benchmark planning at scale: `hpckpt reshard --plan` from 256-1024 source ranks to 1024-4096 targets.

    python bench/bench_plan.py                      # the published table (docs/benchmarks.md)
    python bench/bench_plan.py --cases 256x1000:1024 --repeat 1 --no-baseline      # a quick look

Each source is a synthetic HyperParallel checkpoint made by `bench/make_synthetic_hp.py` (1,000
tensors FSDP-split over every rank: 921,700 chunks at 1,024 ranks), kept under `bench/out/`. For
each (source, target) pair this measures, each in a fresh process, best of `--repeat`:

- `hpckpt reshard SRC -o OUT --world-size N --plan --json`, start to exit, and its peak RSS
  (`ru_maxrss` of the child, from `os.wait4`), with nothing cached (`HPCKPT_NO_CACHE`: the
  storage probe for the predicted time runs, as on a file system's first `--plan` of the day);
- the same with `--bandwidth 2GiB,1GiB` (no probe: what every later run does with the probe's
  figures cached);
- the same command at the baseline commit (`--baseline`, default c1f8e00, the planner before
  issue 8), side by side; both sides are byte-compiled snapshots (`bench_ab.snapshot`), the
  working tree and `git archive` of the baseline;
- a phase breakdown inside one process: reading the metadata, planning, the per-rank read
  figures, and laying the plan out as HyperParallel files, with the peak RSS after each.

The planning phases (everything after the metadata is read) must grow linearly with source chunks +
target boxes: the table gives their time per million (chunks + boxes), which stays flat when they do.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
sys.path.insert(0, str(HERE))

from bench_ab import snapshot  # noqa: E402  (byte-compiled snapshots of two commits)

PROBE = r"""
import gc, json, resource, sys, time
gc.disable()
from hpckpt.converters import format_named, open_index
from hpckpt.converters.base import WriterOptions
from hpckpt.core.geometry.layout import LayoutSpec
from hpckpt.core.geometry.plan import make_plan
from hpckpt.core.geometry.plan_stats import rank_stats
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = [time.perf_counter()]
index = open_index(sys.argv[1]); t.append(time.perf_counter()); m = [rss()]
world = int(sys.argv[2])
plan = make_plan(index, LayoutSpec.for_world_size(world), world); t.append(time.perf_counter()); m.append(rss())
stats = rank_stats(plan, index); t.append(time.perf_counter()); m.append(rss())
writer = format_named("hyperparallel").writer(WriterOptions(name="out"))
layout = writer.layout(plan, {v.fqn: index.decode_value(v.fqn) for v in plan.values}); t.append(time.perf_counter()); m.append(rss())
print(json.dumps({"read": t[1] - t[0], "plan": t[2] - t[1], "stats": t[3] - t[2], "layout": t[4] - t[3],
                  "rss": m, "chunks": sum(e.n_chunks for e in index.tensors.values()),
                  "boxes": sum(len(x.boxes) for x in plan.tensors), "files": len(layout.files)}))
"""


def run_child(args: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[float, float, str]:
    """(seconds, peak RSS in MiB, stdout) of one child process, reaped here so that its own
    `ru_maxrss` is known."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    chunks = []
    while True:
        data = proc.stdout.read(1 << 16)
        if not data:
            break
        chunks.append(data)
    err = proc.stderr.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, args))} failed: {err.decode()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024, b"".join(chunks).decode()


def source(ranks: int, tensors: int) -> Path:
    path = OUT / f"hp-{ranks}x{tensors}"
    if not (path / ".metadata").is_file():
        subprocess.run([sys.executable, str(HERE / "make_synthetic_hp.py"), "--ranks", str(ranks), "--tensors",
                        str(tensors), str(path)], check=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["256x1000:4096", "512x1000:4096", "1024x1000:1024",
                                                         "1024x1000:4096", "1024x2000:4096"],
                        help="RANKSxTENSORS:TARGET_RANKS, one per plan to measure")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default="c1f8e00", help="commit to compare with (the planner before issue 8)")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    hpckpt = [sys.executable, "-m", "hpckpt"]
    trees = Path(tempfile.mkdtemp(prefix="hpckpt-plan-", dir=OUT))
    env = dict(os.environ, HPCKPT_NO_CACHE="1", PYTHONPATH=str(snapshot("WORKTREE", trees / "ours")))
    base_env = None
    if not args.no_baseline:
        base_env = dict(env, PYTHONPATH=str(snapshot(args.baseline, trees / "baseline")))
    rows = []
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for case in args.cases:
        shape, target = case.split(":")
        ranks, tensors = (int(x) for x in shape.split("x"))
        target = int(target)
        src = source(ranks, tensors)
        dst = OUT / "plan-target"
        shutil.rmtree(dst, ignore_errors=True)
        cmd = [*hpckpt, "reshard", str(src), "-o", str(dst), "--world-size", str(target), "--plan", "--json"]
        ours = min(run_child(cmd, env=env)[:2] for _ in range(args.repeat))
        given = min(run_child([*cmd, "--bandwidth", "2GiB,1GiB"], env=env)[:2] for _ in range(args.repeat))
        theirs = None
        if base_env is not None:  # once: it takes 10-50 s
            theirs = run_child(cmd, env=base_env, cwd=OUT)[:2]
        phases = min((json.loads(run_child([sys.executable, "-c", PROBE, str(src), str(target)], env=env)[2])
                      for _ in range(args.repeat)), key=lambda p: p["plan"] + p["stats"] + p["layout"])
        rows.append({"ranks": ranks, "tensors": tensors, "target": target, "ours": ours, "given": given,
                     "baseline": theirs, "phases": phases})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    shutil.rmtree(trees)
    print("| source ranks x tensors | chunks | target ranks | boxes | `reshard --plan` | peak RSS | no probe (`--bandwidth`) "
          "| baseline | baseline RSS | read metadata | plan | read figures | layout | planning s per M (chunks + boxes) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["phases"]
        planning = p["plan"] + p["stats"] + p["layout"]
        per_million = planning / ((p["chunks"] + p["boxes"]) / 1e6)
        base = f"{r['baseline'][0]:.1f} s" if r["baseline"] else "-"
        base_rss = f"{r['baseline'][1]:.0f} MiB" if r["baseline"] else "-"
        print(f"| {r['ranks']} x {r['tensors']} | {p['chunks']:,} | {r['target']} | {p['boxes']:,} | {r['ours'][0]:.2f} s | "
              f"{r['ours'][1]:.0f} MiB | {r['given'][0]:.2f} s | {base} | {base_rss} | {p['read']:.2f} s ({p['rss'][0]:.0f} MiB) | "
              f"{p['plan']:.2f} s | {p['stats']:.2f} s | {p['layout']:.2f} s ({p['rss'][3]:.0f} MiB) | {per_million:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
