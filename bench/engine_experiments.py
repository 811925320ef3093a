"""Try engine changes without editing the product: monkeypatch hpckpt, run one CLI command, time it.

    python bench/engine_experiments.py [--fix-contiguous] [--reuse-buffer] [--piecewise] [--cache-paths] [--early-writeback] -- consolidate SRC -o OUT

Each flag patches one thing the profiles of bench/bench_engine.py point at (see
docs/benchmarks-engine.md, "Profiles"):

--piecewise        `TileCopier.write`: when every piece of a tile is one contiguous byte run both in
                   its source chunk and in the output, copy each piece with `copy_file_range`
                   (today only a tile made of exactly one piece is copied in the kernel; a tile that
                   spans several source chunks, e.g. any whole tensor of a Shard(0) checkpoint when
                   consolidating, goes through a fresh numpy buffer, `preadv` and `pwrite`).
--cache-paths      `hpckpt.core.paths.resolve_inside`: memoised per (root, relative) (the PyTorch
                   DCP locator calls it for every chunk lookup, two `Path.resolve()` each).
--fix-contiguous   `engine._contiguous_in`: return True when the region covers the whole shape. As
                   written, the loop runs off the front (d == -1) and then tests `sizes[:-1]`
                   (all dims but the last) instead of no dims, so a region equal to the whole chunk
                   counts as non-contiguous and never takes the `copy_file_range` path.
--reuse-buffer     `TileCopier._gather`: gather into one buffer per copier, allocated once and reused
                   for every tile, instead of a fresh `np.empty` per tile (the `--format pt` path
                   and any tile that cannot be copied in the kernel).
--early-writeback  after each direct copy, `sync_file_range(SYNC_FILE_RANGE_WRITE)` on the range
                   just written, so the disk write starts while copying goes on and the final
                   `fsync` has less left to wait for.

At commit d549b48 the product already does what --fix-contiguous (d3d831b), --piecewise (db0e7bd),
--cache-paths (d3d831b) and --reuse-buffer (dd7f111) patch in; those flags are for measuring older
commits (--piecewise is skipped when the engine's `_direct` already takes all the parts of a tile).
--early-writeback still applies.

Prints the wall time of the command (this process, imports excluded) as JSON on the last line.
The output is removed afterwards.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path


def _sync_file_range():
    """`sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)` through libc (the os module
    does not expose it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.sync_file_range
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: fn(fd, offset, nbytes, 2)


def patch_piecewise() -> None:
    import inspect

    from hpckpt.core import engine

    if "parts" in inspect.signature(engine.TileCopier._direct).parameters:
        print("--piecewise: the engine already copies multi-piece tiles in the kernel; not patched", file=sys.stderr)
        return
    from hpckpt.core.engine import _copy_range, _linear

    original = engine.TileCopier.write
    early = _sync_file_range() if getattr(engine, "_EARLY_WRITEBACK", False) else None

    def write(self, target, base):
        source = target.source_dtype or target.dtype
        itemsize = target.dtype.itemsize
        for tile, dest, parts in self._tiles(target, base):
            plan = []
            if source == target.dtype and tile.ndim:
                for piece, region in parts:
                    loc = self._location(piece, target)
                    local = region.relative_to(piece.chunk.box)
                    in_tile = region.relative_to(tile)
                    if (loc.strides is not None or not engine._contiguous_in(local, piece.chunk.box.sizes)
                            or not engine._contiguous_in(in_tile, tile.sizes)):
                        plan = None
                        break
                    plan.append((loc, local, in_tile, piece))
            if plan:
                for loc, local, in_tile, piece in plan:
                    count = local.volume * itemsize
                    start = loc.offset + _linear(local.offsets, piece.chunk.box.sizes) * itemsize
                    at = dest + _linear(in_tile.offsets, tile.sizes) * itemsize
                    _copy_range(self.files.fd(loc.path), self.out_fd, count, start, at)
                    if early is not None:
                        early(self.out_fd, at, count)
                    self.progress(count)
                continue
            _write_tile(self, target, tile, dest, parts)  # anything else: the engine's own path

    def _write_tile(self, target, tile, dest, parts):
        source = target.source_dtype or target.dtype
        if (source == target.dtype and len(parts) == 1 and parts[0][1] == tile
                and self._direct(parts[0][0], tile, target, dest)):
            return
        data = self._gather(target, tile, parts)
        written = 0
        while written < len(data):
            written += os.pwrite(self.out_fd, data[written:], dest + written)
        self.progress(len(data))

    engine.TileCopier.write = write
    engine.TileCopier._original_write = original


def patch_fix_contiguous() -> None:
    from hpckpt.core import engine

    def _contiguous_in(region, shape):
        d = region.ndim - 1
        while d >= 0 and region.offsets[d] == 0 and region.sizes[d] == shape[d]:
            d -= 1
        return d < 0 or all(s == 1 for s in region.sizes[:d])

    engine._contiguous_in = _contiguous_in


def patch_reuse_buffer() -> None:
    import math

    import numpy as np

    from hpckpt.core import engine
    from hpckpt.core.cast import cast
    from hpckpt.core.read import read_region

    def _gather(self, target, tile, parts):
        source = target.source_dtype or target.dtype
        nbytes = math.prod(tile.sizes) * source.itemsize
        pool = getattr(self, "_pool", None)
        if pool is None or len(pool) < nbytes:
            pool = self._pool = np.empty(max(nbytes, 1), dtype=np.uint8)
        buffer = pool[:nbytes].view(source.np).reshape(tile.sizes)
        for piece, region in parts:
            loc = self._location(piece, target)
            view = buffer[region.relative_to(tile).slices()] if region.ndim else buffer
            read_region(self.files, loc, region.relative_to(piece.chunk.box), view)
        if source != target.dtype:
            buffer = np.require(cast(buffer, source, target.dtype), requirements="C")
        return memoryview(buffer.reshape(-1).view(np.uint8))

    engine.TileCopier._gather = _gather


def patch_early_writeback() -> None:
    from hpckpt.core import engine

    engine._EARLY_WRITEBACK = True
    original = engine.TileCopier._direct
    writeback = _sync_file_range()

    def _direct(self, piece, tile, target, dest):
        done = original(self, piece, tile, target, dest)
        if done:
            writeback(self.out_fd, dest, tile.volume * target.dtype.itemsize)
        return done

    engine.TileCopier._direct = _direct


def patch_cache_paths() -> None:
    from hpckpt.converters import torch_dcp
    from hpckpt.core import paths

    cached = functools.lru_cache(maxsize=None)(paths.resolve_inside)
    paths.resolve_inside = cached
    torch_dcp.resolve_inside = cached
    for name, module in list(sys.modules.items()):
        if name.startswith("hpckpt") and getattr(module, "resolve_inside", None) is not None:
            module.resolve_inside = cached


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--piecewise", action="store_true")
    parser.add_argument("--cache-paths", action="store_true")
    parser.add_argument("--early-writeback", action="store_true")
    parser.add_argument("--fix-contiguous", action="store_true")
    parser.add_argument("--reuse-buffer", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the output (to check it)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd

    from hpckpt.cli import app
    import hpckpt.converters.torch_dcp  # noqa: F401  (patched below)

    if args.fix_contiguous:
        patch_fix_contiguous()
    if args.reuse_buffer:
        patch_reuse_buffer()
    if args.early_writeback:
        patch_early_writeback()
    if args.piecewise:
        patch_piecewise()
    if args.cache_paths:
        patch_cache_paths()
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
