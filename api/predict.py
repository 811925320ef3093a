"""How long a planned write will take: the bytes each target rank reads and writes (the plan)
over the source's read and the destination's write bandwidth (measured by `core.io.bandwidth`'s
probes and cached per file system, or given). A rank reads then writes its share, so its time is
`read / read bandwidth + written / write bandwidth`; the whole run shares both file systems among
its workers, so its time is the same sum over every rank's bytes. `bench/bench_predict.py`
measures how close this comes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io import bandwidth
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import as_path


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second reading the source and writing the destination, and where each figure
    came from ("option", "probe" or "cache")."""

    read: float
    write: float
    read_from: str = "option"
    write_from: str = "option"


def _existing(path: Path) -> Path:
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def measure(src: str | Path, dst: str | Path, index: CheckpointIndex, *, sync: bool = True,
            probe: bool = True) -> Bandwidth | None:
    """The source's read and the destination's write bandwidth: cached figures, else (with
    `probe`) a short probe of each; None where one cannot be had (an object store, nothing
    cached and no probe, a file system that refuses the probe)."""
    src, dst = as_path(src), as_path(dst)
    if is_object(src) or is_object(dst):
        return None
    source_dir = Path(os.path.abspath(src if src.is_dir() else src.parent))
    kind = "write" if sync else "write-nosync"
    target_dir = _existing(Path(os.path.abspath(dst)).parent)
    if not probe:
        read, write = bandwidth.cached(source_dir, "read"), bandwidth.cached(target_dir, kind)
        return Bandwidth(read, write, "cache", "cache") if read and write else None
    largest = sorted(index.data_files, key=lambda f: -(_size(index.data_path(f))))[:8]
    read, read_from = bandwidth.measured(source_dir, "read",
                                         lambda: bandwidth.probe_read(index.data_path(f) for f in largest))
    write, write_from = bandwidth.measured(target_dir, kind, lambda: bandwidth.probe_write(target_dir, sync))
    if not read or not write:
        return None
    return Bandwidth(read, write, read_from, write_from)


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def predict(plan: dict, speed: Bandwidth) -> dict:
    """`plan` (a report's `plan`: its `ranks`) timed: seconds per rank and for the whole run."""
    per_rank = [{"rank": r["rank"], "seconds": round(r["bytes_read"] / speed.read + r["bytes_written"] / speed.write, 4)}
                for r in plan["ranks"]]
    total = sum(r["bytes_read"] for r in plan["ranks"]) / speed.read + \
        sum(r["bytes_written"] for r in plan["ranks"]) / speed.write
    return {"seconds": round(total, 4), "ranks": per_rank, "read_bytes_per_s": round(speed.read),
            "write_bytes_per_s": round(speed.write), "read_from": speed.read_from, "write_from": speed.write_from}
