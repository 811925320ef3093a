"""What a bench phase costs this process, and the scratch directory the phases work in.

Memory: the kernel's peak RSS is reset before each phase (`/proc/self/clear_refs`) and `VmHWM`
read after it, the allocator's free pages handed back first (`malloc_trim`) so no phase runs on
memory an earlier one freed. Bytes read: the `/proc/self/io` `rchar` delta (read/pread/readv
calls: file reads; gloo's `recvmsg` traffic is not in it, measured: an HSDP load's broadcasts of
380 MiB a rank left no trace). Before a save the destination is removed and dirty pages flushed
(`os.sync`), before a load the checkpoint's files are evicted from the page cache: untimed.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable


def trim_heap() -> None:
    """Hand the allocator's free pages back to the kernel (glibc `malloc_trim`): otherwise a phase
    reuses memory an earlier phase freed and its peak RSS understates what it allocated."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so VmHWM after a phase is that phase's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def memory() -> dict[str, int]:
    """VmHWM (peak) and VmRSS (now) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def timed(ctx, call: Callable[[], Any]) -> tuple[Any, dict]:
    """Barrier, then `call()` measured on this rank: seconds, peak RSS, extra RSS, rchar."""
    trim_heap()
    ctx.comm.barrier()
    reset_peak_rss()
    before, read_before = memory(), _rchar()
    started = time.perf_counter()
    value = call()
    seconds = time.perf_counter() - started
    after = memory()
    return value, {"seconds": seconds, "peak_rss": after["VmHWM"],
                   "peak_rss_extra": max(after["VmHWM"] - before["VmRSS"], 0), "rchar": _rchar() - read_before}


# -- the scratch directory --------------------------------------------------------------------

def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in _files(path))


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def clear(ctx, path: Path) -> None:
    """Untimed, before a save: rank 0 removes the destination, each node flushes its dirty pages."""
    if ctx.rank == 0:
        _remove(path)
    if ctx.local_rank == 0:
        os.sync()
    ctx.comm.barrier()


def evict(ctx, path: Path) -> None:
    """Untimed, before a load: the checkpoint's pages out of this node's page cache (fsync first:
    dirty pages would stay, and MindSpore does not fsync its files)."""
    if ctx.local_rank == 0:
        for p in _files(path):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    ctx.comm.barrier()


def scratch_dir(spec: dict, ctx) -> tuple[Path, bool]:
    """A fresh directory of this job under `out` (rank 0 names it), and whether `out` was made
    for it: the bench never removes anything it did not create."""
    root = Path(spec.get("out") or Path(ctx.run_dir) / "bench")
    name, made_root = ctx.comm.all_gather_json([f"bench-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}",
                                                not root.exists()])[0]
    if ctx.rank == 0:
        (root / name).mkdir(parents=True)
    ctx.comm.barrier()
    return root / name, made_root


def remove_scratch(path: Path, made_root: bool) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if made_root:
        try:
            path.parent.rmdir()
        except OSError:
            pass  # not empty: someone else's files
