"""How fast a file system reads and writes, measured by a short probe and remembered per file
system, so that `reshard --plan` can say how long the copy it plans will take.

The read probe reads up to `PROBE_BYTES` of the source's own data files (as the copy will: what
the page cache holds reads at its speed); the write probe writes `PROBE_BYTES` and a quarter of
it, twice each, beside the destination as the engine writes (`probe_write`), fsynced as the copy
is (unless asked not to), and removes what it wrote; the two sizes separate the rate from the
fixed cost of each file. Each figure is cached under the file system's device number for `CACHE_SECONDS`
(`~/.cache/hpckpt/bandwidth.json`, `HPCKPT_CACHE_DIR` moves it, `HPCKPT_NO_CACHE` turns it off).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hpckpt.core.commit.durable import start_writeback
from hpckpt.core.commit.replace import replace_file
from hpckpt.core.paths import cache_directory

PROBE_BYTES = 128 * 1024 * 1024
REPEATS = 2
BLOCK = 8 * 1024 * 1024
WRITERS = 4
MIN_READ = 1024 * 1024  # fewer bytes than this read say nothing of a speed
MIN_PROBE_SECONDS = 0.02  # a read probe shorter than this is timer noise
CACHE_SECONDS = 24 * 3600
_MIN_SECONDS = 1e-4  # below this a measurement says nothing


def _cache_file() -> Path | None:
    directory = cache_directory()
    return None if directory is None else directory / "bandwidth.json"


def _load() -> dict:
    path = _cache_file()
    try:
        doc = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _key(directory: Path, kind: str) -> str:
    return f"{os.stat(directory).st_dev}:{kind}"


def cached(directory: Path, kind: str) -> Speed | None:
    """The remembered speed of `kind` ("read", "write", "write-nosync") on the file system of
    `directory`, or None (never measured, or too long ago)."""
    try:
        entry = _load().get(_key(directory, kind))
    except OSError:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes_per_s"), (int, float)):
        return None
    if time.time() - float(entry.get("time", 0)) > CACHE_SECONDS or entry["bytes_per_s"] <= 0:
        return None
    per_file = entry.get("per_file_s", 0.0)
    return Speed(float(entry["bytes_per_s"]), float(per_file) if isinstance(per_file, (int, float)) and per_file >= 0 else 0.0)


def _remember(directory: Path, kind: str, speed: Speed) -> None:
    path = _cache_file()
    if path is None:
        return
    doc = _load()
    doc[_key(directory, kind)] = {"bytes_per_s": speed.bytes_per_s, "per_file_s": speed.per_file_s, "time": time.time(),
                                  "path": str(directory)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, (json.dumps(doc, indent=1) + "\n").encode(), fsync=False)
    except OSError:
        pass  # a cache that cannot be written only costs the next probe


def probe_read(files: Iterable[Path], limit: int = PROBE_BYTES) -> Speed | None:
    """Bytes per second reading `files` from their start, `limit` bytes at most. A source that
    reads whole in less than `MIN_PROBE_SECONDS` is read again (from the page cache, as its copy
    will read it) until that long has passed and `MIN_READ` bytes are read (ten times that long
    at most), so that a small checkpoint on a fast machine is still timed; None when the files
    hold too little to tell or cannot be read."""
    files = list(files)
    buffer = bytearray(BLOCK)
    view, done, started = memoryview(buffer), 0, time.perf_counter()
    while True:
        pass_bytes = 0
        for path in files:
            if done >= limit:
                break
            try:
                with open(path, "rb", buffering=0) as f:
                    while done < limit:
                        n = f.readinto(view[:min(BLOCK, limit - done)])
                        if not n:
                            break
                        done += n
                        pass_bytes += n
            except OSError:
                continue
        seconds = time.perf_counter() - started
        timed = seconds >= MIN_PROBE_SECONDS and done >= MIN_READ  # (a pass cut short by a busy machine: read on)
        if done >= limit or not pass_bytes or timed or seconds >= 10 * MIN_PROBE_SECONDS:
            break
    return Speed(done / seconds) if done >= MIN_READ and seconds > _MIN_SECONDS else None


def _write_seconds(directory: Path, sync: bool, nbytes: int, writers: int) -> float:
    """Seconds to write (and, with `sync`, fsync) `nbytes` in `directory` as the engine writes:
    `writers` files at once, the kernel asked to start writing each block back as soon as it is
    written (`start_writeback`), through hidden files removed at once."""
    from concurrent.futures import ThreadPoolExecutor

    share = max(1, nbytes // writers)
    block = os.urandom(min(BLOCK, share))  # (incompressible, in case the file system compresses)
    paths = [directory / f".hpckpt-tmp-{os.getpid()}-probe{i}" for i in range(writers)]  # (staging names)

    def write(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written = 0
            while written < share:
                n = os.write(fd, block[:share - written])
                if sync:
                    start_writeback(fd, written, n)
                written += n
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(write, paths))
    finally:
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass
    return time.perf_counter() - started


@dataclass(frozen=True)
class Speed:
    """A file system's speed: `bytes_per_s` once data flows, and `per_file_s`, the fixed cost of
    one file (for a write: its creation and its fsync, which dominate small files)."""

    bytes_per_s: float
    per_file_s: float = 0.0


def probe_write(directory: Path, sync: bool = True, nbytes: int = PROBE_BYTES) -> Speed | None:
    """The write speed in `directory`, separated into rate and fixed cost: `nbytes` and a quarter
    of it are each written `REPEATS` times (in turn, one file per core, at most `WRITERS`); the
    fastest time of each size is kept (what slows a probe down, a busy disk or a neighbour, is
    not the disk's speed), and the line through the two gives the rate (its slope) and the fixed
    cost per file (what is left at size zero). None when `directory` cannot be written."""
    writers = max(1, min(WRITERS, os.cpu_count() or 1))
    small, large = nbytes // 4, nbytes
    try:
        best = {small: float("inf"), large: float("inf")}
        for _ in range(REPEATS):
            for size in best:
                best[size] = min(best[size], _write_seconds(directory, sync, size, writers))
    except OSError:
        return None
    if best[large] <= _MIN_SECONDS:
        return None
    slope = (best[large] - best[small]) / (large - small)
    if slope <= 0:  # (the small write was no faster than the large one: noise; keep the plain rate)
        return Speed(large / best[large])
    return Speed(1 / slope, max(0.0, best[small] - small * slope) / writers)


def probe_source(index) -> Speed | None:
    """The read speed of a checkpoint (a `CheckpointIndex`): `probe_read` of its largest data
    files, as a copy from it reads them."""
    largest = sorted(index.data_files, key=lambda f: -_size(index.data_path(f)))[:8]
    return probe_read(index.data_path(f) for f in largest)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def directory_of(path: Path) -> Path:
    """The directory whose file system `path` (a checkpoint directory or file) is on, absolute."""
    return Path(os.path.abspath(path if path.is_dir() else path.parent))


def measured(directory: Path, kind: str, probe) -> tuple[Speed | None, str]:
    """`(speed, "cache" | "probe")` of `kind` on `directory`'s file system: the cached figure,
    else `probe()` (then remembered)."""
    found = cached(directory, kind)
    if found is not None:
        return found, "cache"
    value = probe()
    if value is not None:
        _remember(directory, kind, value)
    return value, "probe"
