"""Profile one hpckpt command in this process: phase times, syscall-level totals and cProfile.

    python bench/profile_engine.py [--prof FILE] [--top 25] [--threads] -- reshard SRC -o OUT -w 8

cProfile only sees the thread it runs in, and the engine copies files on its thread pool (the only
one); unless `--threads` is given, `hpckpt.core.io.engine.ThreadPoolExecutor` is replaced by an
executor that runs each task at once in the calling thread, so every copy shows up in the profile
(same work, serialised: wall time is then the jobs=1 time). Wall time of the pipeline's phases is
measured by wrapping `open_index`, the plan, the per-rank figures, the engine's reads, files,
kernel copies and gathers, CRC read-backs, patches, `os.copy_file_range`, `os.pwrite`,
`os.preadv`, `os.fsync`, `start_writeback` and the commit with timers (cumulative seconds and
calls; nested phases overlap). The output directory is removed at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import functools
import io
import os
import pstats
import shutil
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

TIMES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
_LOCK = threading.Lock()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            with _LOCK:
                TIMES[name][0] += dt
                TIMES[name][1] += 1
    return wrapper


class InlineExecutor(concurrent.futures.Executor):
    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001
            future.set_exception(exc)
        return future


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prof", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", action="store_true", help="keep the thread pool (profile misses workers)")
    parser.add_argument("--keep", action="store_true", help="keep the output")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd

    started = time.perf_counter()
    from hpckpt.api import pipeline
    from hpckpt.cli import app
    from hpckpt.core.commit import staging as commit
    from hpckpt.core.io import box_filler, engine
    from hpckpt.core.io import write
    import hpckpt.converters as converters

    if not args.threads:
        engine.ThreadPoolExecutor = InlineExecutor
    converters.open_index = timed("open_index (metadata)", converters.open_index)
    for module in ("hpckpt.api.reshard", "hpckpt.api.consolidate", "hpckpt.api.convert", "hpckpt.api.inspect"):
        setattr(sys.modules[module], "open_index", converters.open_index)
    pipeline.make_target_plan = timed("make_target_plan (plan)", pipeline.make_target_plan)
    pipeline.rank_stats = timed("rank_stats (--plan figures)", pipeline.rank_stats)
    engine.source_pieces = timed("engine.source_pieces (reads of every box)", engine.source_pieces)
    engine._fill_file = timed("engine._fill_file (per file)", engine._fill_file)
    engine.BoxFiller._direct = timed("BoxFiller._direct (copy_file_range path)", engine.BoxFiller._direct)
    engine.BoxFiller._gather = timed("BoxFiller._gather (pread into tile buffer)", engine.BoxFiller._gather)
    engine._crc_at = timed("engine._crc_at (CRC read-back)", engine._crc_at)
    engine.finish = timed("engine.finish (patches, fsync)", engine.finish)
    engine.start_writeback = box_filler.start_writeback = timed("start_writeback (sync_file_range)",
                                                                engine.start_writeback)
    os.copy_file_range = timed("os.copy_file_range", os.copy_file_range)
    os.pwrite = timed("os.pwrite", os.pwrite)
    os.preadv = timed("os.preadv", os.preadv)
    os.fsync = timed("os.fsync", os.fsync)
    commit.Staging.commit = timed("Staging.commit", commit.Staging.commit)
    write.write_plan = timed("write_plan (writer, engine, commit)", write.write_plan)
    pipeline.write_plan = write.write_plan
    imported = time.perf_counter() - started

    out = None
    if "-o" in cmd:
        out = Path(cmd[cmd.index("-o") + 1])
    sys.argv = ["hpckpt", *cmd]
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    try:
        app.run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            print(f"hpckpt exited with {exc.code}", file=sys.stderr)
    finally:
        profiler.disable()
    wall = time.perf_counter() - t0
    if args.prof:
        profiler.dump_stats(args.prof)
    print(f"\nimports (hpckpt, cli): {imported:.3f} s; command: {wall:.3f} s "
          f"({'thread pool' if args.threads else 'inline executor, one thread'})")
    print(f"{'phase':55} {'seconds':>8} {'calls':>7}")
    for name, (seconds, calls) in sorted(TIMES.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:55} {seconds:8.3f} {calls:7d}")
    for sort in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).strip_dirs().sort_stats(sort).print_stats(args.top)
        text = buf.getvalue()
        print(f"\n--- top {args.top} by {sort} ---")
        print(text[text.find("   ncalls"):].rstrip())
    if out is not None and not args.keep:
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
