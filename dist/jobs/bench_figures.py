"""The bench's result: each measurement's figures for this rank, from every round of every rank
(the job's time of a phase is its slowest rank's)."""

from __future__ import annotations

import math
import statistics


def summary(kind: str, mine: list[dict], job: list[list[dict]], job_state_bytes: int,
             fsync: bool | None) -> dict:
    """One measurement's figures for this rank: `mine` per round, `job` per round every rank's."""
    seconds = [max(p["seconds"] for p in ranks) for ranks in job]
    best = min(seconds)
    out = {"seconds_best": round(best, 4), "seconds_median": round(statistics.median(seconds), 4),
           "gib_per_s": round(job_state_bytes / best / 2**30, 3) if best else None,
           "rounds": [round(s, 4) for s in seconds], "rank_seconds_best": round(min(m["seconds"] for m in mine), 4),
           "peak_rss": max(m["peak_rss"] for m in mine), "peak_rss_extra": max(m["peak_rss_extra"] for m in mine),
           "job_peak_rss": max(p["peak_rss"] for ranks in job for p in ranks),
           "job_peak_rss_extra": max(p["peak_rss_extra"] for ranks in job for p in ranks)}
    if fsync is not None:
        out["fsync"] = fsync
    if kind == "save":
        out["bytes_on_disk"] = mine[-1]["bytes_on_disk"]
    if "fsync_seconds" in mine[0]:
        durable = [max(p["seconds"] + p["fsync_seconds"] for p in ranks) for ranks in job]
        out["durable_seconds_best"] = round(min(durable), 4)  # with an fsync of each rank's file added
        out["durable_seconds_median"] = round(statistics.median(durable), 4)
    if kind == "async_save":
        blocked = [max(p["blocked"] for p in ranks) for ranks in job]
        out.update(blocked_best=round(min(blocked), 4), blocked_median=round(statistics.median(blocked), 4))
    if kind == "load":
        last = job[-1]
        job_rchar = sum(p["rchar"] for p in last)
        wanted = last[0].get("job_bytes_wanted") or job_state_bytes
        out.update(rchar=mine[-1]["rchar"], job_rchar=job_rchar, job_bytes_wanted=wanted,
                   rchar_amplification=round(job_rchar / wanted, 4) if wanted else None,
                   checked=any(m.get("checked") for m in mine))
        if "read_amplification" in mine[-1]:  # hpckpt's own count of the bytes it read
            out.update(bytes_read=mine[-1]["bytes_read"], job_bytes_read=last[0]["job_bytes_read"],
                       read_amplification=round(mine[-1]["read_amplification"], 4),
                       bytes_broadcast=mine[-1]["bytes_broadcast"],
                       # how the boxes several ranks want were had, and how the ranks learnt which
                       broadcast=mine[-1]["broadcast"], broadcast_reason=mine[-1]["broadcast_reason"],
                       wants_from=mine[-1]["wants_from"])
        else:
            out.update(bytes_read=mine[-1]["rchar"], job_bytes_read=job_rchar,
                       read_amplification=out["rchar_amplification"])
        if any(m.get("memfree_guard_bypassed") for m in mine):
            out["memfree_guard_bypassed"] = True
    return out


def distinct_state_bytes(pieces: list, fw) -> int:
    """The state's distinct bytes: every tensor's global size (replicas counted once)."""
    return sum(math.prod(s.shape) * fw.dtype_of(s.local, fqn).itemsize for fqn, s in pieces)
