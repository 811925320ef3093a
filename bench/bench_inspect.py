"""Benchmark `hpckpt inspect` / `verify` / `--help` on a 64-rank, 10,000-tensor HyperParallel checkpoint.

    python bench/bench_inspect.py [--ranks 64] [--tensors 10000] [--repeat 5] [--warmup 1]
                                  [--ckpt DIR] [--regenerate] [--no-profile]

Generates the checkpoint with `bench/make_synthetic_hp.py` into `bench/out/` (git-ignored) when it
is absent, then times each command as a child process, start to exit, with its stdout sent to
/dev/null: `--warmup` unmeasured runs, then the best (and median) of `--repeat` runs. Peak RSS is
the child's own `ru_maxrss` (from `os.wait4`), so it is per command, not cumulative. `inspect` is
measured from the checkpoint's manifest (written by the writer; its listing needs no unpickling),
and without it (a twin of hard links without the manifest), both cold: `HPCKPT_NO_CACHE=1` and
the checkpoint's files dropped from the page cache before each run; and warm (a private `HPCKPT_CACHE_DIR` under `bench/out/`,
filled by the warm-up run), since hpckpt caches the index of large HyperParallel checkpoints.
`python -c pass` and `python -c "import torch"` are timed as peers for context. Prints a Markdown
table, then profiles `hpckpt inspect OUT --json` in this process with cProfile, cold (imports of
hpckpt included: nothing of hpckpt is imported before) and then warm, and prints the top functions
by cumulative time (all, then hpckpt's own) and by own time. The profiles are saved under
`bench/out/` (`inspect-json-{cold,warm}.prof`) for snakeviz & co. The load average is printed at
the start and the end: on a shared machine, other work shows up in the medians.
Target: `hpckpt inspect` under 1 s.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import hashlib
import io
import json
import os
import platform
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_SECONDS = 1.0
MANIFEST = ".hpckpt-manifest.jsonl"


def without_manifest(ckpt: Path) -> Path:
    """A twin of `ckpt` of hard links to its files, without the manifest: what inspect reads when
    a checkpoint has none (the metadata pickle), on the same bytes."""
    twin = ckpt.parent / (ckpt.name + "-no-manifest")
    shutil.rmtree(twin, ignore_errors=True)
    twin.mkdir()
    for p in ckpt.iterdir():
        if p.is_file() and p.name != MANIFEST:
            os.link(p, twin / p.name)
    return twin


def evict(paths: list[Path]) -> None:
    """Drop the files from the page cache (`posix_fadvise(DONTNEED)`): a cold run reads the disk."""
    for directory in paths:
        for p in directory.iterdir():
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def source_fingerprint() -> str:
    """Short hash and newest mtime of the package sources, to tell which code a run measured."""
    root = HERE.parent
    files = sorted(p for d in (root, root / "cli", root / "core", root / "converters") for p in d.glob("*.py"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    newest = max((p.stat().st_mtime for p in files), default=0)
    return f"{digest.hexdigest()[:12]} (newest source {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(newest))})"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def hpckpt_executable() -> str:
    local = Path(sys.executable).parent / "hpckpt"
    if local.is_file():
        return str(local)
    found = shutil.which("hpckpt")
    if not found:
        sys.exit("error: no `hpckpt` console script next to this Python or on PATH (pip install -e .)")
    return found


def ensure_checkpoint(out: Path, ranks: int, tensors: int, regenerate: bool) -> None:
    if (out / ".metadata").is_file() and (out / MANIFEST).is_file() and not regenerate:
        print(f"using existing {out}")
        return
    print(f"generating {out} ({ranks} ranks, {tensors} tensors) ...", flush=True)
    cmd = [sys.executable, str(HERE / "make_synthetic_hp.py"), "--ranks", str(ranks), "--tensors", str(tensors), str(out)]
    subprocess.run(cmd, check=True)


def run_once(cmd: list[str], stdout_path: str = os.devnull, env: dict | None = None) -> tuple[float, int, int, str]:
    """Run `cmd` (with `env` added to the environment); return (wall s, peak RSS KiB, exit code, stderr tail)."""
    full_env = {**os.environ, **(env or {})}
    with open(stdout_path, "wb") as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=full_env)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4, not by Popen
        err.seek(0)
        tail = err.read()[-2000:].decode("utf-8", "replace")
    return wall, usage.ru_maxrss, proc.returncode, tail


def measure(label: str, cmd: list[str], repeat: int, warmup: int, env: dict | None = None,
            cold: list[Path] | None = None) -> dict:
    """`cold`: directories whose files are evicted from the page cache before every run."""
    for _ in range(warmup):
        run_once(cmd, env=env)
    walls, rss, codes, tail = [], [], set(), ""
    for _ in range(repeat):
        if cold:
            evict(cold)
        wall, peak, code, tail = run_once(cmd, env=env)
        walls.append(wall)
        rss.append(peak)
        codes.add(code)
    row = {"label": label, "best": min(walls), "median": statistics.median(walls), "worst": max(walls),
           "rss_mib": max(rss) / 1024, "exit": ",".join(map(str, sorted(codes)))}
    print(f"  {label}: best {row['best']:.3f} s, median {row['median']:.3f} s, peak RSS {row['rss_mib']:.0f} MiB, "
          f"exit {row['exit']}", flush=True)
    if codes != {0} and tail:
        print("    stderr: " + tail.strip().replace("\n", "\n    "))
    return row


def markdown_table(rows: list[dict]) -> str:
    lines = ["| command | best wall (s) | median (s) | worst (s) | peak RSS (MiB) | exit |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['label']}` | {r['best']:.3f} | {r['median']:.3f} | {r['worst']:.3f} | "
                     f"{r['rss_mib']:.0f} | {r['exit']} |")
    return "\n".join(lines)


def profile_inspect(ckpt: Path, prof_path: Path, top: int, env: dict, title: str, own_time: bool = True) -> float:
    """cProfile `hpckpt inspect CKPT --json` in this process (stdout discarded); return its wall time.

    Prints the top `top` functions by cumulative time, then the same restricted to hpckpt's own
    sources (the cumulative list starts with a dozen typer/click wrappers), and by own time.
    """
    argv = sys.argv
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    profiler = cProfile.Profile()
    sink = io.StringIO()
    start = time.perf_counter()
    profiler.enable()
    try:
        sys.argv = ["hpckpt", "inspect", str(ckpt), "--json"]
        with contextlib.redirect_stdout(sink):
            from hpckpt.cli.app import run

            run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            print(f"  (inspect exited with {exc.code})")
    finally:
        profiler.disable()
        sys.argv = argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wall = time.perf_counter() - start
    profiler.dump_stats(prof_path)
    own_sources = re.escape(str(HERE.parent)) + r"/(?!\.venv/)"
    listings = [("cumulative", "cumulative time", ()), ("cumulative", "cumulative time, hpckpt's own functions", (own_sources,))]
    if own_time:
        listings.append(("tottime", "own time (tottime)", ()))
    for key, what, restrictions in listings:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats(key).print_stats(*restrictions, top)
        body = text.getvalue()
        body = body[body.find("   ncalls"):] if "   ncalls" in body else body
        print(f"\nTop {top} by {what}: `hpckpt inspect OUT --json` {title}, in-process, profiled wall {wall:.2f} s\n")
        print("```")
        print(body.rstrip())
        print("```")
    print(f"\n(JSON document: {len(sink.getvalue()) / 2**20:.1f} MiB; profile saved to {prof_path})")
    return wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5, help="measured runs per command (best is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured runs per command first")
    parser.add_argument("--ckpt", type=Path, help="checkpoint directory (default bench/out/hp-{ranks}r-{tensors}t)")
    parser.add_argument("--regenerate", action="store_true", help="rewrite the checkpoint even if present")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    parser.add_argument("--top", type=int, default=15, help="profile rows to print (default 15)")
    args = parser.parse_args(argv)

    ckpt = args.ckpt or HERE / "out" / f"hp-{args.ranks}r-{args.tensors}t"
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    ensure_checkpoint(ckpt, args.ranks, args.tensors, args.regenerate)
    exe = hpckpt_executable()

    # Describe what is measured (one unmeasured inspect run; it is also a warm-up of the page cache).
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        _wall, _rss, code, tail = run_once([exe, "inspect", str(ckpt), "--json"], tmp.name, {"HPCKPT_NO_CACHE": "1"})
        if code != 0:
            print(f"error: hpckpt inspect failed with exit code {code}:\n{tail}")
            return 1
        doc = json.loads(Path(tmp.name).read_text())
    files = [p for p in ckpt.iterdir() if p.is_file()]
    meta_mib = (ckpt / ".metadata").stat().st_size / 2**20
    print(f"\ncheckpoint: {ckpt}\n  {doc['counts']['tensors']} tensors, {doc['counts']['chunks']} chunks, "
          f"{doc['counts']['values']} values, world size {doc['world_size']}, {len(files)} files, "
          f"{sum(p.stat().st_size for p in files) / 2**20:.1f} MiB (.metadata {meta_mib:.1f} MiB)")
    print(f"  python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; "
          f"best of {args.repeat} after {args.warmup} warm-up")
    print(f"  hpckpt sources {source_fingerprint()}; load average {_load()}\n", flush=True)

    out = str(ckpt)
    # hpckpt caches large HyperParallel indexes (converters/index_cache.py): "cold" runs turn the
    # cache off, "warm" runs use a private cache directory that the warm-up run fills.
    cold = {"HPCKPT_NO_CACHE": "1"}
    cache = ckpt.parent / "index-cache"
    shutil.rmtree(cache, ignore_errors=True)
    warm = {"HPCKPT_CACHE_DIR": str(cache)}
    bare = str(without_manifest(ckpt))
    commands = [
        ("python -c pass", [sys.executable, "-c", "pass"], None),
        ('python -c "import torch"', [sys.executable, "-c", "import torch"], None),
        ("hpckpt inspect OUT --json (from its manifest; no cache, page cache dropped)", [exe, "inspect", out, "--json"],
         cold),
        ("hpckpt inspect OUT (from its manifest; no cache, page cache dropped)", [exe, "inspect", out], cold),
        ("hpckpt inspect OUT --json (no manifest, no cache, page cache dropped)", [exe, "inspect", bare, "--json"],
         cold),
        ("hpckpt --help", [exe, "--help"], None),
        ("hpckpt inspect OUT --json (cold: no cache)", [exe, "inspect", out, "--json"], cold),
        ("hpckpt inspect OUT --json (warm cache)", [exe, "inspect", out, "--json"], warm),
        ("hpckpt inspect OUT (cold: no cache)", [exe, "inspect", out], cold),
        ("hpckpt inspect OUT (warm cache)", [exe, "inspect", out], warm),
        ("hpckpt verify OUT --json", [exe, "verify", out, "--json"], None),
    ]
    rows = [measure(label, cmd, args.repeat, max(args.warmup, 1 if env is warm else 0), env,
                    [ckpt, Path(bare)] if "page cache dropped" in label else None)
            for label, cmd, env in commands]

    print("\n" + markdown_table(rows))
    for row in rows:
        if row["label"].startswith("hpckpt inspect"):
            verdict = "meets" if row["best"] < TARGET_SECONDS else "misses"
            print(f"- `{row['label']}` {verdict} the {TARGET_SECONDS:.0f} s target ({row['best']:.2f} s)")

    if not args.no_profile:
        profile_inspect(ckpt, ckpt.parent / "inspect-json-cold.prof", args.top, cold, "cold (no cache)")
        profile_inspect(ckpt, ckpt.parent / "inspect-json-warm.prof", args.top, warm,
                        "warm (cache filled; modules already imported by the cold run)", own_time=False)
    print(f"\nhpckpt sources at the end: {source_fingerprint()}; load average {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
