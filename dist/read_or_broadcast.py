"""Whether the ranks that all want the same boxes each read them from storage, or one reads them
and broadcasts them to the others: a pure decision from two bandwidths (`dist.bandwidths` finds
them: configured or measured), so that it can be tested without processes. `dist.load` calls it
once per set of ranks sharing boxes, with figures every rank agreed on, so every rank decides alike.
"""

from __future__ import annotations

from collections.abc import Iterable

READ, BROADCAST = "read", "broadcast"


def choose(holders: int, nbytes: int, storage_bps: float | None, network_bps: float | None,
           hosts: int | None = None, memory_bps: float | None = None) -> tuple[str, float | None, float | None]:
    """Read or broadcast the `nbytes` of boxes that each of `holders` ranks, on `hosts` machines
    (default: each on its own), wants; `memory_bps` is a copy's rate in memory.

    Returns `(choice, read_seconds, broadcast_seconds)`: `choice` is `"read"` or `"broadcast"`,
    the seconds are the two estimates compared (None when a figure is unknown).

    - reading: every holder reads the bytes; the holders read at once but share the storage's
      bandwidth (one file system's servers), and holders on one machine share its page cache: the
      first read there fills it and the others copy from memory at once, so the storage is read
      once per machine, `hosts * nbytes / storage_bps`, plus `nbytes / memory_bps` where a
      machine has several holders;
    - broadcasting: one holder reads them, then one broadcast over the holders carries them:
      `nbytes / storage_bps + nbytes / network_bps`, `network_bps` being a broadcast's rate over
      the job's group (what the backend gives: slow for gloo on CPU, fast for nccl on GPUs).

    The size cancels out: across machines broadcasting wins when the other machines' reads cost
    more than the broadcast; on one machine, when the network is faster than a copy in memory
    (nccl over NVLink, not gloo). A tie, or fewer than 2 holders, reads (no
    collective). An unknown figure (None, or not positive) broadcasts: each box is then read once,
    as it always was, which is also what a store billed per byte read wants.
    """
    if holders < 2:
        return READ, None, None
    if not storage_bps or not network_bps or storage_bps <= 0 or network_bps <= 0:
        return BROADCAST, None, None
    machines = min(hosts or holders, holders)
    read_seconds = machines * nbytes / storage_bps
    if machines < holders and memory_bps:
        read_seconds += nbytes / memory_bps
    broadcast_seconds = nbytes / storage_bps + nbytes / network_bps
    return (BROADCAST if broadcast_seconds < read_seconds else READ), read_seconds, broadcast_seconds


def overall(choices: Iterable[str]) -> str:
    """One word for a load's choices: `"broadcast"` or `"read"` when every group made the same
    one, `"mixed"` otherwise; `"read"` when nothing was shared (every rank read its own boxes)."""
    found = set(choices)
    return "mixed" if len(found) > 1 else found.pop() if found else READ
