"""What the manifest costs a write: the same writes with and without hashing, side by side.

    python bench/bench_manifest_cost.py [--size 1GiB] [--rounds 3] [--out bench/out/manifest-cost]
                                        [--cases fsynced,no-fsync,live]

Three writes, each timed with the manifest (digests taken while writing, `WriteSettings.manifest`)
and without, alternating round by round, best of `--rounds`:

1. `reshard` of a safetensors file onto 4 ranks, fsynced (the default): each box's bytes are
   written from a mapping of the source a MiB at a time, each MiB hashed first (which leaves it
   in cache for the write);
2. the same with `--no-fsync` (page cache only: the worst case for the ratio, nothing waits on
   the disk);
3. `hpckpt.dist.save` of an in-memory state dict in one process (no process group): the bytes
   go from the arrays by `pwrite` and are hashed from the same memory.

Then the peak RSS of one page-cache-only reshard with and without the manifest, each in a fresh
process (`VmHWM`): the mapped source pages the hash reads count in it.

Also prints XXH3-128, SHA-256, BLAKE2b, CRC-32 by zlib and by zlib-ng (and BLAKE3 when installed)
on one core, over one in-memory buffer, for the README's choices (`--digests-only`: that alone). The target is a manifest cost under 10 % of the write.
The CPU the manifest adds is shown as a share of the write's time too: on a disk whose speed varies
from one write to the next, the wall-clock difference of a fsynced write is mostly that noise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def make_source(path: Path, size: int) -> None:
    """A safetensors file of 8 float32 tensors of about `size` bytes in total."""
    from safetensors.numpy import save_file

    if path.exists():
        return
    rows = max(1, size // 8 // 4 // 4096)
    rng = np.random.default_rng(0)
    save_file({f"layer{i}.weight": rng.standard_normal((rows, 4096), dtype=np.float32) for i in range(8)}, str(path))


def digest_speeds(nbytes: int = 256 << 20) -> list[tuple[str, float]]:
    import xxhash

    from hpckpt.core.io.crc import crc32

    data = memoryview(np.random.default_rng(1).bytes(nbytes))
    candidates = [("XXH3-128 (xxhash)", lambda b: xxhash.xxh3_128(b).digest()),
                  ("SHA-256 (hashlib)", lambda b: hashlib.sha256(b).digest()),
                  ("BLAKE2b (hashlib)", lambda b: hashlib.blake2b(b).digest()),
                  ("CRC-32 (zlib)", lambda b: zlib.crc32(b)),
                  ("CRC-32 (zlib-ng: hpckpt's, `core/io/crc.py`)", lambda b: crc32(b))]
    try:
        import blake3

        candidates.append(("BLAKE3 (blake3, one thread)", lambda b: blake3.blake3(b).digest()))
    except ImportError:
        pass
    out = []
    for name, fn in candidates:
        fn(data[: 1 << 20])
        best = min(_timed(fn, data) for _ in range(3))
        out.append((name, nbytes / best / 1e9))
    return out


def _timed(fn, data) -> float:
    t = time.perf_counter()
    fn(data)
    return time.perf_counter() - t


def reshard_once(src: Path, dst: Path, manifest: bool, sync: bool) -> tuple[float, float]:
    from hpckpt import api
    from hpckpt.core.geometry.layout import LayoutSpec
    from hpckpt.core.io.write import WriteSettings

    shutil.rmtree(dst, ignore_errors=True)
    t, cpu = time.perf_counter(), _cpu()
    api.reshard(src, dst, LayoutSpec.for_world_size(4), settings=WriteSettings(sync=sync, manifest=manifest))
    return time.perf_counter() - t, _cpu() - cpu


def _cpu() -> float:
    """CPU seconds of this process so far, user and system, all threads."""
    times = os.times()
    return times.user + times.system


def peak_rss(src: Path, dst: Path, manifest: bool) -> float:
    """Peak RSS (MiB) of a fresh process that imports hpckpt and reshards `src` once, page cache
    only. `VmHWM`, not `ru_maxrss`, which Linux carries over `execve` from the forked parent."""
    code = f"""
import shutil
from pathlib import Path
from hpckpt import api
from hpckpt.core.geometry.layout import LayoutSpec
from hpckpt.core.io.write import WriteSettings
shutil.rmtree({str(dst)!r}, ignore_errors=True)
api.reshard(Path({str(src)!r}), Path({str(dst)!r}), LayoutSpec.for_world_size(4),
            settings=WriteSettings(sync=False, manifest={manifest}))
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(proc.stdout.strip().splitlines()[-1]) / 1024


def dist_once(dst: Path, manifest: bool, size: int) -> tuple[float, float]:
    """One in-memory save in a fresh process (its own timing of `save` only: wall, CPU as in `_cpu`)."""
    code = f"""
import functools, os, shutil, sys, time
import numpy as np, torch
import hpckpt.dist as hdist
save_module = sys.modules["hpckpt.dist.save_commit"]
save_module.WriteSettings = functools.partial(save_module.WriteSettings, manifest={manifest})
rows = max(1, {size} // 8 // 4 // 4096)
state = {{f"layer{{i}}.weight": torch.randn(rows, 4096) for i in range(8)}}
shutil.rmtree({str(dst)!r}, ignore_errors=True)
cpu, t = sum(os.times()[:2]), time.perf_counter()
hdist.save(state, {str(dst)!r})
print(time.perf_counter() - t, sum(os.times()[:2]) - cpu)
"""
    env = dict(os.environ, HPCKPT_JOB_ID=f"bench-{os.getpid()}-{time.time_ns()}")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    wall, cpu = proc.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "out" / "manifest-cost")
    parser.add_argument("--cases", default="fsynced,no-fsync,live", help="which writes to time (comma-separated)")
    parser.add_argument("--digests-only", action="store_true", help="print the digests' speeds only")
    args = parser.parse_args()
    if args.digests_only:
        print(f"load average {os.getloadavg()[0]:.2f}\n\n| digest, one core | GB/s |\n|---|---:|")
        for name, speed in digest_speeds():
            print(f"| {name} | {speed:.2f} |")
        return 0
    size = parse_size(args.size)
    args.out.mkdir(parents=True, exist_ok=True)
    src = args.out / "src.safetensors"
    make_source(src, size)
    print(f"source {src}: {src.stat().st_size / 2**30:.2f} GiB; load average {os.getloadavg()[0]:.2f}", flush=True)
    print("\n| digest, one core | GB/s |\n|---|---:|")
    for name, speed in digest_speeds():
        print(f"| {name} | {speed:.2f} |")
    cases = {"fsynced": ("reshard, fsynced", lambda m: reshard_once(src, args.out / "dst", m, True)),
             "no-fsync": ("reshard, --no-fsync", lambda m: reshard_once(src, args.out / "dst", m, False)),
             "live": ("hpckpt.dist.save, one process", lambda m: dist_once(args.out / "live", m, size))}
    print("\n| write | without manifest (s) | with manifest (s) | cost | CPU without (s) | CPU with (s) | CPU cost |"
          "\n|---|---:|---:|---:|---:|---:|---:|")
    for key in args.cases.split(","):
        label, fn = cases[key]
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(args.rounds):
            for manifest in ((False, True) if r % 2 == 0 else (True, False)):
                runs[manifest].append(fn(manifest))
        off, on = (min(wall for wall, _ in runs[m]) for m in (False, True))
        cpu_off, cpu_on = (min(cpu for _, cpu in runs[m]) for m in (False, True))
        print(f"| {label} | {off:.3f} | {on:.3f} | {100 * (on - off) / off:+.1f} % | {cpu_off:.2f} | {cpu_on:.2f} "
              f"| {100 * (cpu_on - cpu_off) / off:+.1f} % of the time |", flush=True)
    print("\n| reshard, --no-fsync, one process | peak RSS (MiB) |\n|---|---:|")
    for manifest in (False, True):
        print(f"| {'with' if manifest else 'without'} manifest | {peak_rss(src, args.out / 'dst', manifest):.0f} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    shutil.rmtree(args.out / "dst", ignore_errors=True)
    shutil.rmtree(args.out / "live", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
