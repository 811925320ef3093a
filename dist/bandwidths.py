"""The two figures `dist.load` weighs before broadcasting a shared box (`dist.read_or_broadcast`):
the storage's read rate and the rate of a broadcast over the job's process group, each given
(a keyword argument, else `HPCKPT_STORAGE_BANDWIDTH` / `HPCKPT_NETWORK_BANDWIDTH`: bytes per
second as a size, `2GiB` or `800MB/s`) or measured.

Measured: the storage by `core.io.bandwidth` (its read probe of the checkpoint's own files,
remembered per file system); the network by a few timed broadcasts of `PROBE_BYTES` over the
load's group, through the same `Comm.broadcast` the load's own broadcasts use (host copies
included for an accelerator backend), remembered in this process per framework, backend and set
of ranks. Every figure carries where it came from: "argument", "environment", "cache", "probe",
or "unknown" (an object store, or a probe that could not tell).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.core.io import bandwidth
from hpckpt.core.sizes import parse_rate
from hpckpt.core.storage.object_path import is_object

STORAGE_VARIABLE = "HPCKPT_STORAGE_BANDWIDTH"
NETWORK_VARIABLE = "HPCKPT_NETWORK_BANDWIDTH"
PROBE_BYTES = 4 * 1024 * 1024  # one timed broadcast
PROBE_REPEATS = 3  # timed broadcasts, after one small one that lines the ranks up

_networks: dict[tuple, float] = {}  # (framework, backend, global ranks) -> bytes per second, this process
_memory: list[float] = []  # this process's copy rate, once measured
MEMORY_PROBE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Figure:
    """A rate in bytes per second (None: unknown) and where it came from."""

    bytes_per_s: float | None
    source: str

    def to_json(self) -> list:
        return [self.bytes_per_s, self.source]

    @classmethod
    def from_json(cls, doc: list | None) -> Figure | None:
        return None if doc is None else cls(doc[0], doc[1])


def parse_bandwidth(value: str | int | float, what: str) -> float:
    """Bytes per second from a number, or a size with an optional `/s` (`2GiB`, `800MB/s`).

    Raises:
        ValueError: not a rate, or not positive.
    """
    try:
        return parse_rate(value)
    except ValueError:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError(f"{what}: a bandwidth must be positive, not {value!r}") from None
        raise ValueError(f"{what}: not a bandwidth: {value!r} (examples: 2GiB, 800MB/s, 1e9)") from None


def configured(argument: str | int | float | None, variable: str) -> Figure | None:
    """The figure given as a keyword argument, else in the environment variable; None if neither."""
    if argument is not None:
        return Figure(parse_bandwidth(argument, variable.lower().removeprefix("hpckpt_")), "argument")
    text = os.environ.get(variable, "").strip()
    return Figure(parse_bandwidth(text, variable), "environment") if text else None


def storage_known(argument: Any, path: Path) -> Figure | None:
    """The storage figure without measuring: configured, else remembered for the file system;
    "unknown" for an object store (nothing to probe); None: to be probed (`probe_storage`)."""
    given = configured(argument, STORAGE_VARIABLE)
    if given is not None:
        return given
    if is_object(path):
        return Figure(None, "unknown")
    found = bandwidth.cached(bandwidth.directory_of(path), "read")
    return Figure(found.bytes_per_s, "cache") if found is not None else None


def probe_storage(path: Path, index) -> Figure:
    """The read rate of the checkpoint's file system, by `core.io.bandwidth`'s probe of its largest
    data files (then remembered per file system, for every later load and `reshard --plan`)."""
    speed, source = bandwidth.measured(bandwidth.directory_of(path), "read", lambda: bandwidth.probe_source(index))
    return Figure(speed.bytes_per_s, source) if speed is not None else Figure(None, "unknown")


def network_key(framework: str, comm: Any) -> tuple:
    return (framework, getattr(comm, "backend", "?"), tuple(comm.global_rank(r) for r in range(comm.world_size)))


def network_known(argument: Any, key: tuple) -> Figure | None:
    """The network figure without measuring: configured, else measured before in this process over
    the same ranks and backend; None: to be probed (`probe_network`, on every rank)."""
    given = configured(argument, NETWORK_VARIABLE)
    if given is not None:
        return given
    return Figure(_networks[key], "cache") if key in _networks else None


def probe_network(comm: Any) -> float:
    """Every rank calls it: one small broadcast from rank 0 (which lines the ranks up), then
    `PROBE_REPEATS` of `PROBE_BYTES`. Returns this rank's seconds for the timed ones."""
    world = tuple(range(comm.world_size))
    handles = comm.groups([world])
    try:
        comm.broadcast(np.zeros(4096, np.uint8), 0, handles[world])
        buffer = np.zeros(PROBE_BYTES, np.uint8)
        started = time.perf_counter()
        for _ in range(PROBE_REPEATS):
            comm.broadcast(buffer, 0, handles[world])
        return time.perf_counter() - started
    finally:
        comm.release(handles)


def network_from_probes(seconds: list[float], key: tuple) -> Figure:
    """The job's broadcast rate from every rank's `probe_network` seconds: the bytes over the
    slowest rank's time (a broadcast is done when its last receiver has it); remembered for `key`."""
    slowest = max(seconds) if seconds else 0.0
    if slowest <= 0:
        return Figure(None, "unknown")
    rate = PROBE_REPEATS * PROBE_BYTES / slowest
    _networks[key] = rate
    return Figure(rate, "probe")


def machine() -> str:
    """What tells machines apart for the page cache: the running kernel's boot id (ranks in
    containers on one machine share it, and its page cache), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            found = f.read().strip()
        if found:
            return found
    except OSError:
        pass
    return socket.gethostname()


def memory_rate() -> float:
    """Bytes per second of a copy in memory (what a second reader of a box that is in the page
    cache pays): the best of three copies of `MEMORY_PROBE_BYTES`, measured once per process."""
    if not _memory:
        source, target = np.ones(MEMORY_PROBE_BYTES, np.uint8), np.empty(MEMORY_PROBE_BYTES, np.uint8)
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            np.copyto(target, source)
            best = min(best, time.perf_counter() - started)
        _memory.append(MEMORY_PROBE_BYTES / max(best, 1e-9))
    return _memory[0]
