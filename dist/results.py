"""What `save`, `async_save` and `load` return."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """One rank's view of a save.

    `committed` is True on the coordinator once the checkpoint is in place; on the other ranks
    it says every rank's data was durable when they last heard (the coordinator then renames).
    `plan_cache` is "hit", "miss" or "off"; `plan_from` how the plan was made: "layouts" (every
    rank's tensors had the same layouts: the ranks sent a digest, not their boxes), "boxes",
    "cache" (a hit), "" (rank-local, no global plan). Byte counts are this rank's; `job_bytes_written`
    all ranks'. Times in seconds: `planning` (gather + global plan), `writing` (this rank's
    files, fsynced), `blocked` (what the caller waited: all of it for `save`, the staging copy
    for `async_save`).
    """

    path: Path
    rank: int
    world_size: int
    coordinator: int
    coordination: str
    plan_cache: str
    files: tuple[str, ...]
    bytes_written: int
    job_bytes_written: int
    committed: bool
    planning: float = 0.0
    writing: float = 0.0
    blocked: float = 0.0
    plan_from: str = ""


@dataclass(frozen=True)
class SharedGroup:
    """Boxes that every rank of `ranks` (ranks of the load's group) wants, and how they got them.

    `boxes` and `nbytes` count each box once; `choice` is "broadcast" (one holder read them and
    broadcast them to the others) or "read" (every holder read them from storage);
    `read_seconds` / `broadcast_seconds` are the two estimates the automatic choice compared
    (None when `broadcast_shared` forced it, or a figure was unknown); `machines` how many
    machines (page caches) the ranks are on (0: not looked at)."""

    ranks: tuple[int, ...]
    boxes: int
    nbytes: int
    choice: str
    read_seconds: float | None = None
    broadcast_seconds: float | None = None
    machines: int = 0


@dataclass(frozen=True, kw_only=True)
class LoadResult:
    """One rank's view of a load, with the job's totals.

    `bytes_read` is what this rank read from storage; `bytes_broadcast` what it received from
    peers; `job_bytes_read` / `job_bytes_wanted` are over every rank, `wanted` counting each
    distinct box once; `read_amplification` = job_bytes_read / job_bytes_wanted (1.0: nothing
    read twice). `missing`: target entries the checkpoint lacks (only with strict=False);
    `unused`: checkpoint entries the target does not ask for; `converted`: tensors whose dtype
    was converted on the copy, as `(fqn, "from -> to")`.

    Boxes several ranks want: `broadcast` says how they were had, "broadcast" (read once, sent
    to the other holders: read amplification 1.0 for them), "read" (every holder read them; also
    when no box is shared) or "mixed" (some groups one way, some the other); `broadcast_reason`
    why: "auto" (the estimates compared), "forced" (`broadcast_shared=True/False`) or "nothing
    shared"; `shared_groups` the choice per set of ranks (`SharedGroup`). The figures the
    automatic choice used, in bytes per second (None: not needed, or unknown), and where each
    came from ("argument", "environment", "cache", "probe", "unknown"; "" when not used):
    `storage_bandwidth` / `storage_bandwidth_from`, `network_bandwidth` / `network_bandwidth_from`,
    and `memory_bandwidth` (a copy in memory: what a second holder on one machine pays).
    `wants_from`: how the ranks learnt which boxes the others want: "layouts" (every rank's
    tensors had the same layouts: the ranks sent a digest), "boxes" (they sent their boxes), ""
    (a job of one).
    """

    path: Path
    rank: int
    world_size: int
    format: str
    tensors: int
    values: int
    bytes_read: int
    bytes_broadcast: int
    job_bytes_read: int
    job_bytes_wanted: int
    read_amplification: float
    missing: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    converted: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    broadcast: str = "read"
    broadcast_reason: str = "nothing shared"
    shared_groups: tuple[SharedGroup, ...] = ()
    storage_bandwidth: float | None = None
    storage_bandwidth_from: str = ""
    network_bandwidth: float | None = None
    network_bandwidth_from: str = ""
    memory_bandwidth: float | None = None
    wants_from: str = ""


@dataclass
class AsyncSaveHandle:
    """A save persisting in the background, used as torch's `async_save` future is:
    `result(timeout)` waits and returns its SaveResult or raises its error (and then no
    checkpoint was committed); `done()` and `running()` do not wait; `exception(timeout)`
    waits and returns the error or None; `add_done_callback(fn)` calls `fn(handle)` once it is
    done. A save cannot be cancelled once begun (`cancel()` returns False, as for a running
    future)."""

    _future: Future = field(repr=False)
    blocked: float = 0.0

    def done(self) -> bool:
        return self._future.done()

    def running(self) -> bool:
        return not self._future.done()

    def cancel(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> SaveResult:
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[AsyncSaveHandle], Any]) -> None:
        self._future.add_done_callback(lambda _future: fn(self))
