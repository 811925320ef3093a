"""Benchmark planning at scale: `hpckpt reshard --plan` from 256-1024 source ranks to 1024-4096 targets.

    python bench/bench_plan.py                      # the published table (docs/benchmarks.md)
    python bench/bench_plan.py --ranks 256 --targets 1024 --repeat 1 --no-baseline   # quick look

Each source is a synthetic HyperParallel checkpoint made by `bench/make_synthetic_hp.py` (1,000
tensors FSDP-split over every rank: 921,700 chunks at 1,024 ranks), kept under `bench/out/`. For
each (source, target) pair this measures, each in a fresh process, best of `--repeat`:

- `hpckpt reshard SRC -o OUT --world-size N --plan --json`, start to exit, and its peak RSS
  (`ru_maxrss` of the child, from `os.wait4`);
- the same command at the baseline commit (`--baseline`, default c1f8e00, the planner before
  issue 8), checked out with `git worktree` under `bench/out/` and run from there, side by side;
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"

PROBE = r"""
import gc, json, resource, sys, time
gc.disable()
from hpckpt.converters import format_named, open_index
from hpckpt.converters.base import WriterOptions
from hpckpt.core.layout import LayoutSpec
from hpckpt.core.plan import make_plan
from hpckpt.core.plan_stats import rank_stats
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


def baseline_tree(commit: str) -> Path:
    """The baseline commit checked out beside, importable as `hpckpt` through a link."""
    tree = OUT / f"baseline-{commit}"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
    link = OUT / f"baseline-{commit}-path"
    link.mkdir(exist_ok=True)
    if not (link / "hpckpt").exists():
        (link / "hpckpt").symlink_to(tree)
    return link


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 512, 1024], help="source world sizes")
    parser.add_argument("--targets", type=int, nargs="+", default=[1024, 4096], help="target world sizes")
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", default="c1f8e00", help="commit to compare with (the planner before issue 8)")
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    hpckpt = [sys.executable, "-m", "hpckpt"]
    env = dict(os.environ, HPCKPT_NO_CACHE="1")
    base_env = None
    if not args.no_baseline:
        base_env = dict(env, PYTHONPATH=str(baseline_tree(args.baseline)))
    rows = []
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    for ranks in args.ranks:
        src = source(ranks, args.tensors)
        for target in args.targets:
            dst = OUT / "plan-target"
            shutil.rmtree(dst, ignore_errors=True)
            cmd = [*hpckpt, "reshard", str(src), "-o", str(dst), "--world-size", str(target), "--plan", "--json"]
            ours = min(run_child(cmd, env=env)[:2] for _ in range(args.repeat))
            theirs = None
            if base_env is not None:
                theirs = min(run_child(cmd, env=base_env, cwd=OUT)[:2] for _ in range(max(1, args.repeat - 2)))
            phases = min((json.loads(run_child([sys.executable, "-c", PROBE, str(src), str(target)], env=env)[2])
                          for _ in range(args.repeat)), key=lambda p: p["plan"] + p["stats"] + p["layout"])
            rows.append({"ranks": ranks, "target": target, "ours": ours, "baseline": theirs, "phases": phases})
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print("| source ranks | chunks | target ranks | boxes | `reshard --plan` | peak RSS | baseline | baseline RSS | "
          "read metadata | plan | read figures | layout | planning s per M (chunks + boxes) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["phases"]
        planning = p["plan"] + p["stats"] + p["layout"]
        per_million = planning / ((p["chunks"] + p["boxes"]) / 1e6)
        base = f"{r['baseline'][0]:.1f} s" if r["baseline"] else "-"
        base_rss = f"{r['baseline'][1]:.0f} MiB" if r["baseline"] else "-"
        print(f"| {r['ranks']} | {p['chunks']:,} | {r['target']} | {p['boxes']:,} | {r['ours'][0]:.2f} s | "
              f"{r['ours'][1]:.0f} MiB | {base} | {base_rss} | {p['read']:.2f} s ({p['rss'][0]:.0f} MiB) | "
              f"{p['plan']:.2f} s | {p['stats']:.2f} s | {p['layout']:.2f} s ({p['rss'][3]:.0f} MiB) | {per_million:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
