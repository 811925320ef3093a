"""`hpckpt run bench`'s table: a row per measurement of the job's result
(`hpckpt.dist.jobs.bench_job` writes it; the CLI renders it and never imports the job)."""

from __future__ import annotations

# the measurements, as the bench job names them in its result: `{contender}_{kind}`
KINDS = ("save", "async_save", "load")
NATIVE = {"torch": "torch_dcp", "mindspore": "mindspore"}
LABELS = {"hpckpt": "hpckpt.dist", "torch_dcp": "torch DCP", "mindspore": "MindSpore"}


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) of a bench report: one row per measurement, the job's figures (times are the
    slowest rank's; peak RSS the largest rank's, and what the phase added over its start). The
    last column is the framework's figure over hpckpt's (time; blocked time for async saves). A
    framework save that does not fsync (MindSpore's) gets a second row, "+ fsync": the same save
    with each rank's file fsynced after it, what a durable save costs, beside hpckpt's fsynced one."""
    first = results[0]
    native = NATIVE[first["framework"]]
    columns = ["measurement", "fsync", "best s", "median s", "GiB/s", "blocked s", "read x", "job read",
               "peak RSS", "RSS added", "vs hpckpt"]
    rows = []
    for kind in KINDS:
        for who in ("hpckpt", native):
            m = first.get(f"{who}_{kind}")
            if not m:
                continue
            ref = first[f"hpckpt_{kind}"]
            by = "blocked_best" if kind == "async_save" else "seconds_best"
            ratio = f"{m[by] / ref[by]:.2f}x" if who != "hpckpt" and ref.get(by) else ""
            rows.append([f"{LABELS[who]} {kind.replace('_', ' ')}",
                         "" if "fsync" not in m else ("yes" if m["fsync"] else "no"),
                         f"{m['seconds_best']:.3f}", f"{m['seconds_median']:.3f}",
                         "" if m.get("gib_per_s") is None else f"{m['gib_per_s']:.2f}",
                         f"{m['blocked_best']:.3f}" if "blocked_best" in m else "",
                         f"{m['read_amplification']:.2f}" if "read_amplification" in m else "",
                         _gib(m.get("job_bytes_read")), _gib(m["job_peak_rss"]), _gib(m["job_peak_rss_extra"]), ratio])
            if who != "hpckpt" and "durable_seconds_best" in m:
                durable = m["durable_seconds_best"]
                median = m.get("durable_seconds_median")
                rows.append([f"{LABELS[who]} {kind} + fsync", "yes", f"{durable:.3f}",
                             "" if median is None else f"{median:.3f}",
                             f"{first['job_state_bytes'] / durable / 2**30:.2f}" if durable else "", "", "", "", "", "",
                             f"{durable / ref['seconds_best']:.2f}x" if ref.get("seconds_best") else ""])
    return columns, rows
