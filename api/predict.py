"""How long a planned write will take: the bytes each target rank reads and writes (the plan)
over the source's read and the destination's write bandwidth (measured by `core.io.bandwidth`'s
probes and cached per file system, or given). A rank reads then writes its share, so its time is
`read / read bandwidth + written / write bandwidth + the fixed cost of the file it writes`; the
whole run shares both file systems among its workers, so its time is the same sum over every
rank's bytes and every file written. `bench/bench_predict.py` measures how close this comes."""

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
    """Bytes per second reading the source and writing the destination, the fixed seconds each
    file written costs beyond its bytes (its fsync; the probe measures it, `--bandwidth` leaves
    it 0), and where each figure came from ("option", "probe" or "cache")."""

    read: float
    write: float
    read_from: str = "option"
    write_from: str = "option"
    per_file: float = 0.0


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
    source_dir = bandwidth.directory_of(src)
    kind = "write" if sync else "write-nosync"
    target_dir = _existing(Path(os.path.abspath(dst)).parent)
    if not probe:
        read, write = bandwidth.cached(source_dir, "read"), bandwidth.cached(target_dir, kind)
        return Bandwidth(read.bytes_per_s, write.bytes_per_s, "cache", "cache", write.per_file_s) \
            if read and write else None
    read, read_from = bandwidth.measured(source_dir, "read", lambda: bandwidth.probe_source(index))
    write, write_from = bandwidth.measured(target_dir, kind, lambda: bandwidth.probe_write(target_dir, sync))
    if not read or not write:
        return None
    return Bandwidth(read.bytes_per_s, write.bytes_per_s, read_from, write_from, write.per_file_s)


def predict(plan: dict, speed: Bandwidth) -> dict:
    """`plan` (a report's `plan`: its `ranks` and `files`) timed: seconds per rank and for the
    whole run."""
    def seconds(read: int, written: int, files: int) -> float:
        return read / speed.read + written / speed.write + files * speed.per_file

    ranks = plan["ranks"]
    per_rank = [{"rank": r["rank"], "seconds": round(seconds(r["bytes_read"], r["bytes_written"], int(r["bytes_written"] > 0)), 4)}
                for r in ranks]
    total = seconds(sum(r["bytes_read"] for r in ranks), sum(r["bytes_written"] for r in ranks),
                    plan.get("files", len(ranks)))
    return {"seconds": round(total, 4), "ranks": per_rank, "read_bytes_per_s": round(speed.read),
            "write_bytes_per_s": round(speed.write), "write_seconds_per_file": round(speed.per_file, 6),
            "read_from": speed.read_from, "write_from": speed.write_from}
