"""A job from its spec to its report: checked, planned, launched (or its command line printed),
followed to its end, and reported."""

from __future__ import annotations

from pathlib import Path

import typer


def start(ctx: typer.Context, spec: dict) -> None:
    """Run the job `spec` describes with the launcher options on `ctx` (the `run` group's).

    Raises:
        JobFailedError: a rank failed, or one ended without reporting success (the first cause named).
        LauncherNotFoundError: no torchrun or msrun in this environment.
    """
    from hpckpt.cli import _output
    from hpckpt.cli.run import checks, launch_plan, report, supervise
    from hpckpt.cli.run.progress import JobProgress
    from hpckpt.cli.run.render import render
    from hpckpt.core.commit.interrupts import critical
    from hpckpt.core.errors import InterruptedRunError, JobFailedError, LauncherNotFoundError
    from hpckpt.core.storage.urls import lexists

    o = ctx.obj
    if not o["dry_run"]:
        checks.paths(spec)
    run_dir = Path(o["log_dir"]).expanduser().absolute() if o["log_dir"] else launch_plan.default_run_dir(spec["job"])
    port = o["master_port"]
    if port is None and o["launcher"] == "msrun":
        port = launch_plan.free_port()  # msrun has no standalone mode: a local scheduler on a free port
    plan = launch_plan.LaunchPlan(o["launcher"], o["nproc_per_node"], spec, run_dir, o["nnodes"], o["node_rank"],
                                  o["master_addr"], port)
    if o["dry_run"]:
        try:
            plan.launcher_path = launch_plan.find_launcher(plan.launcher)
        except LauncherNotFoundError as exc:
            _output.warn(exc.message)
        print(plan.display())
        return
    plan.launcher_path = launch_plan.find_launcher(plan.launcher)
    if not o["log_dir"]:  # (where the user did not choose it: say where)
        _output.note(f"logs: {run_dir}")
    dest = _destination(spec)
    existed = dest is not None and lexists(dest)
    try:
        with JobProgress(f"{spec['job']} ({plan.world_size} ranks)") as progress:
            outcome = supervise.launch(plan, progress.show)
        if not outcome.ok:
            raise JobFailedError(outcome.message, hint=f"logs of every rank: {run_dir}")
    except (JobFailedError, InterruptedRunError):
        _remove_abandoned(dest, existed)  # every process of the job is gone: what it staged goes too
        raise
    # done: a signal now is too late to undo anything (it is said, and the run succeeds)
    with critical("while the job's report was made"):
        if outcome.message:  # a rank died in teardown, or a signal came, after every rank reported success
            _output.warn(outcome.message)
        report.check_complete(plan, outcome.run)
        document = report.report(plan, outcome.run)
        _output.warn_skipped(document)  # what the output leaves out, as the one-process command says it
        if _output.json_mode():
            _output.emit_json(document)
        else:
            render(document, outcome.seconds)


def _destination(spec: dict):
    """What a save or reshard job writes (None for the others)."""
    from hpckpt.core.storage.urls import as_path

    return as_path(spec["out"]) if spec["job"] in ("save", "reshard") and spec.get("out") else None


def _remove_abandoned(dest, existed: bool) -> None:
    """Remove what a stopped job staged for `dest`, and say what was removed."""
    from hpckpt.cli import _output
    from hpckpt.core.commit.abandoned import remove_abandoned

    if dest is None:
        return
    try:
        removed = remove_abandoned(dest, existed)
    except OSError as exc:  # the job's error is the one to report; this is said beside it
        _output.warn(f"could not remove what the job left for {dest}: {exc}")
        return
    if removed:
        _output.note(f"removed what the stopped job left: {', '.join(str(p) for p in removed)}")
