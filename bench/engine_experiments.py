"""Try engine changes without editing the product: monkeypatch hpckpt, run one CLI command, time it.

    python bench/engine_experiments.py [--keep] -- consolidate SRC -o OUT

Runs one `hpckpt` command in this process and prints its wall time (imports excluded) as JSON on
the last line; the output is removed afterwards unless `--keep` is given. To measure a proposed
change to `hpckpt/core/engine.py` (or anything else the profiles of bench/bench_engine.py point at)
without editing the product, add a `patch_*` function that monkeypatches it and a flag that calls
it in `main` before the command runs.

Its experiments have all landed in the product, so their flags and patches are gone:

--fix-contiguous   `engine._contiguous_in` true for a region covering the whole shape (d3d831b)
--cache-paths      `hpckpt.core.paths.resolve_inside` memoised (d3d831b)
--piecewise        kernel copy (`copy_file_range`) of a tile made of several contiguous pieces,
                   e.g. the row shards of a whole tensor (db0e7bd)
--reuse-buffer     one tile buffer per copier, reused for every tile (dd7f111)
--early-writeback  `sync_file_range(SYNC_FILE_RANGE_WRITE)` on each range just copied, so the
                   final `fsync` has less left to wait for: landed in e0fc238 (the engine's
                   per-range writeback, `TileCopier(writeback=...)`)

The profiles in bench/engine_profile_notes.md (hpckpt at d549b48) were measured with these flags;
the script with them is `git show cd99219:bench/engine_experiments.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", action="store_true", help="keep the output (to check it)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd

    from hpckpt.cli import app

    out = Path(cmd[cmd.index("-o") + 1]) if "-o" in cmd else None
    sys.argv = ["hpckpt", *cmd]
    t0 = time.perf_counter()
    try:
        app.main()
    except SystemExit as exc:
        if exc.code not in (0, None):
            return int(exc.code)
    wall = time.perf_counter() - t0
    if out is not None and not args.keep:
        shutil.rmtree(out) if out.is_dir() else out.unlink(missing_ok=True)
        for side in out.parent.glob(out.name.removesuffix(".safetensors") + ".values.json"):
            side.unlink()
    print(json.dumps({"seconds": wall, "flags": [k for k, v in vars(args).items() if v is True]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
