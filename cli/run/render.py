"""A finished job's report on the terminal: a row per rank and their total (bench: a row per
measurement, `bench_table`), then one line."""

from __future__ import annotations

from hpckpt.cli._output import human_bytes, result_line
from hpckpt.cli._tables import write_table
from hpckpt.cli.run.report import IDENTITY_FIELDS

COLUMNS = {  # the figures a job's table shows, in order (every figure is in --json)
    "save": ["bytes_written", "seconds", "blocked_seconds", "planning_seconds", "plan_cache", "job_gib_per_s", "peak_rss"],
    "load": ["bytes_read", "bytes_broadcast", "seconds", "job_read_amplification", "job_gib_per_s", "checked_boxes",
             "peak_rss"],
    "reshard": ["target_ranks", "bytes_written", "bytes_read", "files", "seconds"],
}


def render(document: dict, seconds: float) -> None:
    ranks = document["ranks"]
    if document["job"] == "bench":  # one row per measurement, not per rank
        from hpckpt.cli.run.bench_table import table

        columns, rows = table(ranks)
        write_table(f"bench: {document['world_size']} ranks ({document['launcher']}), times of the slowest rank",
                    [(c, "left" if i == 0 else "right") for i, c in enumerate(columns)], rows)
        result_line(f"bench done on {len(ranks)} ranks in {seconds:.1f} s (logs: {document['log_dir']})")
        return
    keys: list[str] = []
    for result in ranks:
        for key, value in result.items():
            if key not in keys and key != "rank" and _shown(key, value):
                keys.append(key)
    chosen = COLUMNS.get(document["job"])
    keys = [k for k in chosen if k in keys] if chosen else keys[:7]
    rows = [(str(r["rank"]), *(_cell(k, r.get(k)) for k in keys)) for r in ranks]
    totals = document["totals"]
    rows.append(("total", *(_cell(k, totals.get(k)) for k in keys)))
    write_table(f"{document['job']}: {document['world_size']} ranks ({document['launcher']}, "
                f"{document['nodes']} node{'s' if document['nodes'] > 1 else ''})",
                [("rank", "right"), *((k, "right") for k in keys)], rows)
    result_line(f"{document['job']} done on {len(ranks)} ranks in {seconds:.1f} s (logs: {document['log_dir']})")


def _cell(key: str, value) -> str:
    if value is None:
        return ""
    if ("bytes" in key or "rss" in key) and isinstance(value, (int, float)):
        return human_bytes(int(value))
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _shown(key: str, value) -> bool:
    """A figure worth a column: a number or short text, not a rank's identity or a list."""
    if key in IDENTITY_FIELDS - {"node_rank"}:
        return False
    return isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) <= 40)
