"""The report of a finished job: this node's ranks' results, and their totals (the `--json`
document)."""

from __future__ import annotations

from typing import Any

from hpckpt.cli.run.launch_plan import LaunchPlan
from hpckpt.core import job_files
from hpckpt.core.errors import JobFailedError

IDENTITY_FIELDS = {"rank", "world_size", "local_rank", "node_rank", "pid"}
NOTES = job_files.RESULT_NOTES  # (each writing rank's result carries its share's lists)


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def totals(results: list[dict]) -> dict[str, float]:
    """The ranks' numeric figures summed, but `seconds`/`*_seconds` (the slowest rank's: the
    job's wall time) and `job_*` (a figure of the whole job that every rank reports: its largest)."""
    out: dict[str, float] = {}
    for result in results:
        for key, value in result.items():
            if key in IDENTITY_FIELDS or not _numeric(value):
                continue
            if key == "seconds" or key.endswith("_seconds") or key.startswith("job_"):
                out[key] = max(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0) + value
    return out


def report(plan: LaunchPlan, run: job_files.RunFiles) -> dict:
    """The `--json` document of a job that succeeded: the fields every document starts with
    (`written`: what a save or reshard wrote), this node's ranks, and their totals."""
    from hpckpt.api.reports import envelope

    results, notes = [], {}
    for rank, files in run.ranks.items():
        result = files.result if isinstance(files.result, dict) else {"value": files.result}
        for name in (n for n in NOTES if n in result):  # each writing rank's share says them again: once here
            said = notes.setdefault(name, [])
            said += [entry for entry in result[name] if entry not in said]
        results.append({"rank": rank, **{k: v for k, v in result.items() if k != "rank" and k not in NOTES}})
    written = [str(plan.spec["out"])] if plan.spec["job"] in ("save", "reshard") and plan.spec.get("out") else []
    converted = {"converted": notes["converted"]} if "converted" in notes else {}
    return {**envelope("run", written=written, skipped=notes.get("skipped", ()), warnings=notes.get("warnings", ())),
            **converted, "job": plan.spec["job"], "launcher": plan.launcher,
            "world_size": plan.world_size, "nodes": plan.nnodes, "ranks": results, "totals": totals(results),
            "log_dir": str(plan.run_dir)}


def unreported(plan: LaunchPlan, run: job_files.RunFiles) -> list[int]:
    """This node's ranks that have not reported success with a result."""
    expected = range(plan.node_rank * plan.nproc_per_node, (plan.node_rank + 1) * plan.nproc_per_node)
    return [r for r in expected if run.ranks.get(r) is None or run.ranks[r].state != job_files.OK
            or run.ranks[r].result is None]


def check_complete(plan: LaunchPlan, run: job_files.RunFiles) -> None:
    """A launcher that exited 0 while this node's ranks did not all report ok is a failure too."""
    missing = unreported(plan, run)
    if missing:
        r = missing[0]
        raise JobFailedError(f"rank {r} ended without reporting success (log: {job_files.log_path(plan.run_dir, r)})",
                             hint=f"logs of every rank: {plan.run_dir}")
