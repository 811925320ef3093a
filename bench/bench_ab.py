"""The same hpckpt commands at two commits, interleaved: is a change faster, slower or the same?

    python bench/bench_ab.py c1f8e00 HEAD --repeat 8       # on bench_engine.py's 1.5 GiB inputs
    python bench/bench_ab.py c1f8e00 WORKTREE              # the working tree as it is now

Each side is a `git archive` snapshot (or the working tree), byte-compiled as `pip install` does,
imported through `PYTHONPATH` by `python -m hpckpt` in a fresh process; both use this venv's
dependencies. The operations run round-robin, A then B, `--repeat` times, so a burst of load from
other work hits both sides alike; the table gives best and median wall times per side. Inputs are
the checkpoints `bench/bench_engine.py` generates (`--inputs`, default `bench/out/engine/ckpt`).
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def operations(inputs: Path, out: Path, plan_source: Path | None = None,
               inspect_source: Path | None = None) -> dict[str, list[str]]:
    ops = {
        "reshard hp 4->8": ["reshard", str(inputs / "hp"), "-o", str(out / "r"), "--world-size", "8"],
        "reshard hp 4->8 --no-fsync": ["reshard", str(inputs / "hp"), "-o", str(out / "r"), "--world-size", "8",
                                       "--no-fsync"],
        "consolidate hp -> safetensors": ["consolidate", str(inputs / "hp"), "-o", str(out / "x.safetensors")],
        "consolidate hp -> pt": ["consolidate", str(inputs / "hp"), "-o", str(out / "x.pt"), "--format", "pt"],
        "consolidate torch-dcp -> safetensors": ["consolidate", str(inputs / "torch-dcp"), "-o",
                                                 str(out / "x.safetensors")],
        "consolidate torch-dcp -> pt": ["consolidate", str(inputs / "torch-dcp"), "-o", str(out / "x.pt"),
                                        "--format", "pt"],
        "convert hp -> ckpt": ["convert", str(inputs / "hp"), "-o", str(out / "x.ckpt")],
        "inspect hp": ["inspect", str(inputs / "hp")],
        "verify --deep hp": ["verify", str(inputs / "hp"), "--deep"],
        "verify --deep torch-dcp": ["verify", str(inputs / "torch-dcp"), "--deep"],
    }
    if plan_source is not None:  # planning at scale (bench_plan.py's sources)
        ops[f"reshard --plan {plan_source.name} -> 4096"] = ["reshard", str(plan_source), "-o", str(out / "p"),
                                                            "--world-size", "4096", "--plan"]
        ops[f"reshard --plan --html {plan_source.name} -> 4096"] = [
            "reshard", str(plan_source), "-o", str(out / "p"), "--world-size", "4096", "--plan",
            "--html", str(out / "plan.html")]
    if inspect_source is not None:  # a large metadata without a manifest, read cold (HPCKPT_NO_CACHE)
        ops[f"inspect --json {inspect_source.name}, cold"] = ["inspect", str(inspect_source), "--json"]
        ops[f"inspect --summary --html {inspect_source.name}, cold"] = [
            "inspect", str(inspect_source), "--summary", "--html", str(out / "map.html")]
    return ops


def snapshot(rev: str, into: Path) -> Path:
    """`into/hpckpt` holding the package at `rev` (WORKTREE: the files as they are), compiled."""
    package = into / "hpckpt"
    package.mkdir(parents=True)
    if rev == "WORKTREE":
        for name in ("api", "cli", "core", "converters", "dist", "__init__.py", "__main__.py"):
            src = ROOT / name
            shutil.copytree(src, package / name, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir() \
                else shutil.copy(src, package / name)
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True, capture_output=True)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("a", help="commit (or WORKTREE)")
    parser.add_argument("b", help="commit (or WORKTREE)")
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--inputs", type=Path, default=HERE / "out" / "engine" / "ckpt")
    parser.add_argument("--only", help="operations whose name contains this text")
    parser.add_argument("--plan-source", type=Path, help="a synthetic checkpoint of bench/make_synthetic_hp.py: "
                        "adds a `reshard --plan` onto 4,096 ranks")
    parser.add_argument("--inspect-source", type=Path, help="a checkpoint whose metadata is read cold by `inspect "
                        "--json` (bench_inspect.py's 64 x 10,000 one, without its manifest)")
    args = parser.parse_args(argv)
    engine_rows = [k for k in operations(args.inputs, Path("out")) if not args.only or args.only in k]
    if engine_rows and not (args.inputs / "hp" / ".metadata").is_file():  # (the page and scale rows need none)
        parser.error(f"no inputs in {args.inputs}: run `python bench/bench_engine.py --generate-only` first")
    with tempfile.TemporaryDirectory(prefix="hpckpt-ab-") as tmp:
        tmp = Path(tmp)
        sides = {args.a: snapshot(args.a, tmp / "a"), args.b: snapshot(args.b, tmp / "b")}
        out = tmp / "out"
        ops = {k: v for k, v in operations(args.inputs, out, args.plan_source, args.inspect_source).items() if not args.only or args.only in k}
        times: dict[tuple[str, str], list[float]] = {}
        print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
        for _ in range(args.repeat):
            for name, cmd in ops.items():
                for rev, path in sides.items():
                    shutil.rmtree(out, ignore_errors=True)
                    out.mkdir()
                    env = dict(os.environ, PYTHONPATH=str(path), HPCKPT_NO_CACHE="1")
                    start = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "hpckpt", *cmd], env=env, check=True, capture_output=True,
                                   cwd=tmp)
                    times.setdefault((name, rev), []).append(time.perf_counter() - start)
        print(f"load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print(f"| operation | {args.a} best | {args.a} median | {args.b} best | {args.b} median | {args.b} / {args.a} (median) |")
    print("|---|---|---|---|---|---|")
    for name in ops:
        a, b = times[(name, args.a)], times[(name, args.b)]
        print(f"| {name} | {min(a):.2f} s | {statistics.median(a):.2f} s | {min(b):.2f} s | {statistics.median(b):.2f} s "
              f"| {statistics.median(b) / statistics.median(a):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
