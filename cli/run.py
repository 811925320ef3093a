"""`hpckpt run [launcher options] JOB ...`: a distributed job under torchrun or msrun.

The launcher options go on the group, each job is a subcommand with its own options (the same
names as `hpckpt reshard`'s). The CLI checks the options, turns the job into a JSON spec
(`{"job": name, ...}`, absent or null = not given), launches the workers
(`hpckpt.dist.jobs.worker`), follows them through their files and prints the report. No
framework is imported here: the workers import theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors

EXAMPLES = """Examples:

  hpckpt run --nproc-per-node 2 selftest                         check the launcher set-up
  hpckpt run --nproc-per-node 8 save -o ckpt/ --size 1.5GiB --dtype bf16
  hpckpt run --nproc-per-node 8 save -o ckpt/ --from model.safetensors --mesh 2x4 --placements R,S0
  hpckpt run --nproc-per-node 8 load ckpt/ --check
  hpckpt run --nproc-per-node 4 reshard ckpt/ -o ckpt-64/ --world-size 64
  hpckpt run --launcher msrun --nproc-per-node 4 bench --size 1GiB
  hpckpt run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --nproc-per-node 8 load ckpt/
  hpckpt run --dry-run --launcher msrun --nproc-per-node 4 selftest   print the launcher's command line
"""

app = typer.Typer(name="run", help="Run a distributed job (save, load, reshard, bench, selftest) under torchrun or msrun.",
                  no_args_is_help=True, epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]})

LauncherName = Literal["torchrun", "msrun"]
Coordination = Literal["collectives", "storage", "none"]


@app.callback()
def run(
    ctx: typer.Context,
    launcher: Annotated[LauncherName, typer.Option("--launcher", help="The launcher (found in the active environment).")] = "torchrun",
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", min=1, help="Worker processes on this node.")] = 1,
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="Nodes in the job (one `hpckpt run` on each).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", min=0, help="This node's rank, 0..nnodes-1.")] = 0,
    master_addr: Annotated[Optional[str], typer.Option("--master-addr", help="Address of node 0 (multi-node).")] = None,
    master_port: Annotated[Optional[int], typer.Option("--master-port", min=1, max=65535,
                                                       help="A free port on node 0 (multi-node).")] = None,
    log_dir: Annotated[Optional[Path], typer.Option(
        "--log-dir", help="Where the ranks' logs and reports go (default: a new directory under the temp dir).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the launcher's command line; launch nothing.")] = False,
) -> None:
    """Run a distributed job under torchrun or msrun; a failure on any rank stops the job."""
    if node_rank >= nnodes:
        raise typer.BadParameter(f"--node-rank {node_rank} is not a node of --nnodes {nnodes} (0..{nnodes - 1})")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise typer.BadParameter("--nnodes > 1 needs --master-addr and --master-port (node 0's address)")
    ctx.obj = {"launcher": launcher, "nproc_per_node": nproc_per_node, "nnodes": nnodes, "node_rank": node_rank,
               "master_addr": master_addr, "master_port": master_port, "log_dir": log_dir, "dry_run": dry_run}


# -- option checks ------------------------------------------------------------------------------

def _absolute(path: Path | None) -> str | None:
    """Paths reach the workers absolute: a launcher may start them elsewhere."""
    return str(Path(path).expanduser().absolute()) if path is not None else None


def _size(text: str | None, option: str) -> int | None:
    if text is None:
        return None
    from hpckpt.api.options import parse_size

    try:
        size = parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{option}: {exc}") from None
    if size <= 0:
        raise typer.BadParameter(f"{option} must be more than 0 bytes")
    return size


def _layout(mesh, placements, rules, layout_files, split) -> dict:
    """The layout options' part of a job's spec (paths absolute)."""
    return {"mesh": mesh, "placements": placements, "rules": _absolute(rules),
            "layout_files": [_absolute(p) for p in layout_files] if layout_files else None, "split": split}


def _one_source(size: str | None, src: Path | None) -> None:
    if (size is None) == (src is None):
        raise typer.BadParameter("give exactly one of --size (synthetic tensors) or --from SRC")


def _check_rank_layout(world_size: int, mesh: str | None, placements: str | None, rules: Path | None,
                       layout_files: list[Path] | None, split: str) -> None:
    """The layout of the job's own ranks: a mesh of exactly the job's world size, with
    placements or rules; placements only with a mesh; layout files alone."""
    from hpckpt.core.geometry.layout import parse_mesh, parse_placements

    if layout_files and (mesh or placements or rules):
        raise typer.BadParameter("--layout-file goes alone (without --mesh, --placements or --layout-rules)")
    if placements and not mesh:
        raise typer.BadParameter("--placements needs --mesh")
    try:
        if mesh:
            sizes = parse_mesh(mesh).shape
            product = parse_mesh(mesh).size
            if product != world_size:
                raise typer.BadParameter(f"--mesh {mesh} holds {product} ranks, the job has {world_size} "
                                         "(--nnodes x --nproc-per-node)")
            if not placements and rules is None:
                raise typer.BadParameter("--mesh needs --placements (or --layout-rules)")
            if placements and len(parse_placements(placements, split)) != len(sizes):
                raise typer.BadParameter(f"--placements {placements} needs one placement per mesh dim ({len(sizes)})")
        elif placements:
            parse_placements(placements, split)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _world_size(ctx: typer.Context) -> int:
    return ctx.obj["nnodes"] * ctx.obj["nproc_per_node"]


# -- launching and reporting --------------------------------------------------------------------

def _check_paths(spec: dict) -> None:
    """What this node can tell before a launcher starts (10-25 s): a source that is not there,
    a destination that exists without --force or that would overwrite the source. One line and
    the error's own exit code, as every command gives; the workers check again (other nodes may
    see other storage).

    Raises:
        PathNotFoundError, DestinationExistsError, UnsafeDestinationError.
    """
    import os

    from hpckpt.core.commit.destination import refuse_existing, refuse_unsafe
    from hpckpt.core.errors import PathNotFoundError

    source = spec.get("ckpt") or spec.get("src") or spec.get("from")
    if source and not os.path.lexists(source):
        raise PathNotFoundError(f"{source}: no such file or directory")
    if spec["job"] in ("save", "reshard") and spec.get("out"):
        out = Path(spec["out"])
        refuse_unsafe(out, Path(source) if source else None)
        refuse_existing(out, bool(spec.get("force")))


def _launch(ctx: typer.Context, spec: dict) -> None:
    from hpckpt.cli import _launch as launching
    from hpckpt.cli import _output

    o = ctx.obj
    if not o["dry_run"]:
        _check_paths(spec)
    run_dir = Path(o["log_dir"]).expanduser().absolute() if o["log_dir"] else launching.default_run_dir()
    port = o["master_port"]
    if port is None and o["launcher"] == "msrun":
        port = launching.free_port()  # msrun has no standalone mode: a local scheduler on a free port
    plan = launching.LaunchPlan(o["launcher"], o["nproc_per_node"], spec, run_dir, o["nnodes"], o["node_rank"],
                                o["master_addr"], port)
    if o["dry_run"]:
        try:
            plan.launcher_path = launching.find_launcher(plan.launcher)
        except launching.LauncherNotFoundError as exc:
            _output.warn(exc.message)
        print(plan.display())
        return
    plan.launcher_path = launching.find_launcher(plan.launcher)
    with _JobProgress(f"{spec['job']} ({plan.world_size} ranks)") as progress:
        outcome = launching.launch(plan, progress.show)
    if not outcome.ok:
        raise launching.JobFailedError(outcome.message, hint=f"logs of every rank: {run_dir}")
    if outcome.message:  # a rank died in teardown after every rank reported success
        _output.warn(outcome.message)
    launching.check_complete(plan, outcome.run)
    document = launching.report(plan, outcome.run)
    if _output.json_mode():
        _output.emit_json(document)
    else:
        _render(document, outcome.seconds)


COLUMNS = {  # the figures a job's table shows, in order (every figure is in --json)
    "save": ["bytes_written", "seconds", "blocked_seconds", "planning_seconds", "plan_cache", "job_gb_per_s", "peak_rss"],
    "load": ["bytes_read", "bytes_broadcast", "seconds", "job_read_amplification", "job_gb_per_s", "checked_boxes",
             "peak_rss"],
    "reshard": ["target_ranks", "bytes_written", "bytes_read", "files", "seconds"],
}


def _render(document: dict, seconds: float) -> None:
    from hpckpt.cli._output import human_bytes, result_line, write_table

    ranks = document["ranks"]
    if document["job"] == "bench":  # one row per measurement, not per rank
        from hpckpt.dist.jobs.bench_job import table

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

    def cell(key: str, value) -> str:
        if value is None:
            return ""
        if ("bytes" in key or "rss" in key) and isinstance(value, (int, float)):
            return human_bytes(int(value))
        if isinstance(value, float):
            return f"{value:.2f}"
        return str(value)

    rows = [(str(r["rank"]), *(cell(k, r.get(k)) for k in keys)) for r in ranks]
    totals = document["totals"]
    rows.append(("total", *(cell(k, totals.get(k)) for k in keys)))
    write_table(f"{document['job']}: {document['world_size']} ranks ({document['launcher']}, "
                f"{document['nodes']} node{'s' if document['nodes'] > 1 else ''})",
                [("rank", "right"), *((k, "right") for k in keys)], rows)
    result_line(f"{document['job']} done on {len(ranks)} ranks in {seconds:.1f} s (logs: {document['log_dir']})")


def _shown(key: str, value) -> bool:
    """A figure worth a column: a number or short text, not a rank's identity or a list."""
    from hpckpt.cli._launch import IDENTITY_FIELDS

    if key in IDENTITY_FIELDS - {"node_rank"}:
        return False
    return isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) <= 40)


class _JobProgress:
    """The job's progress on the terminal: bytes summed over the ranks, rank 0's phase."""

    def __init__(self, description: str):
        from hpckpt.cli._output import TerminalProgress, json_mode

        self._terminal = TerminalProgress(description, enabled=not json_mode())  # a job's --json is for scripts
        self._total = 0
        self._phase = ""

    def __enter__(self) -> "_JobProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self._terminal.stop()

    def show(self, run) -> None:
        terminal = self._terminal
        if not terminal.enabled:
            return
        done, total = run.progress()
        phase = run.phase(0)
        if total == 0:
            if phase and phase != self._phase:
                terminal.phase(f"rank 0: {phase}")
            self._phase = phase
            return
        if terminal._task is None:
            terminal.start(total)
        description = f"{terminal.description}: {phase}" if phase else terminal.description
        terminal._progress.update(terminal._task, total=total, completed=done, description=description)


# -- the jobs -----------------------------------------------------------------------------------

@app.command("selftest")
@handles_errors
def selftest(
    ctx: typer.Context,
    fail_rank: Annotated[Optional[int], typer.Option("--fail-rank", min=0, help="Make this rank fail (tests failure propagation).")] = None,
    nbytes: Annotated[Optional[str], typer.Option("--bytes", help="Report progress over this many bytes per rank (e.g. 64MiB).")] = None,
    crash_rank: Annotated[Optional[int], typer.Option("--crash-rank", min=0, help="Make this rank die by SIGKILL (no report).")] = None,
    step_seconds: Annotated[float, typer.Option("--step-seconds", min=0, hidden=True)] = 0.0,
    json_output: opt.Json = False,
    quiet: opt.Quiet = False,
    no_progress: opt.NoProgress = False,
    debug: opt.Debug = False,
) -> None:
    """Check the launcher set-up: every rank gathers every rank's host and pid, and reports."""
    for option, rank in (("--fail-rank", fail_rank), ("--crash-rank", crash_rank)):
        if rank is not None and rank >= _world_size(ctx):
            raise typer.BadParameter(f"{option} {rank} is not a rank of the job (0..{_world_size(ctx) - 1})")
    _launch(ctx, {"job": "selftest", "fail_rank": fail_rank, "crash_rank": crash_rank, "bytes": _size(nbytes, "--bytes"),
                  "step_seconds": step_seconds})


@app.command("save")
@handles_errors
def save(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--output", "-o", help="The checkpoint to write (HyperParallel DCP).")],
    size: Annotated[Optional[str], typer.Option("--size", help="Synthetic tensors of this total size (e.g. 1.5GiB).")] = None,
    dtype: Annotated[Optional[opt.DTypeName], typer.Option(
        "--dtype", help="The weights' dtype (--size; default bf16, moments stay fp32), or a cast of --from's floating tensors.")] = None,
    src: Annotated[Optional[Path], typer.Option("--from", help="Save the tensors of this checkpoint (any format hpckpt reads).")] = None,
    mesh: opt.MeshOption = None,
    placements: opt.Placements = None,
    rules: opt.LayoutRules = None,
    layout_files: opt.LayoutFiles = None,
    split: opt.Split = "balanced",
    coordination: Annotated[Coordination, typer.Option("--coordination", help="How the ranks agree on the plan.")] = "collectives",
    async_save: Annotated[bool, typer.Option("--async", help="Save in the background (async_save) and wait for it.")] = False,
    force: opt.Force = False,
    fail_rank: Annotated[Optional[int], typer.Option("--fail-rank", min=0, hidden=True,
                                                     help="Make this rank fail while writing (tests).")] = None,
    json_output: opt.Json = False,
    quiet: opt.Quiet = False,
    no_progress: opt.NoProgress = False,
    debug: opt.Debug = False,
) -> None:
    """Save a checkpoint from every rank (synthetic tensors, or those of SRC laid out over the ranks)."""
    _one_source(size, src)
    nbytes = _size(size, "--size")
    _check_rank_layout(_world_size(ctx), mesh, placements, rules, layout_files, split)
    _launch(ctx, {"job": "save", "out": _absolute(out), "size": nbytes, "dtype": dtype, "from": _absolute(src),
                  **_layout(mesh, placements, rules, layout_files, split), "coordination": coordination, "async": async_save, "force": force, "fail_rank": fail_rank})


@app.command("load")
@handles_errors
def load(
    ctx: typer.Context,
    ckpt: Annotated[Path, typer.Argument(help="The checkpoint to load (any format hpckpt reads).")],
    mesh: opt.MeshOption = None,
    placements: opt.Placements = None,
    rules: opt.LayoutRules = None,
    layout_files: opt.LayoutFiles = None,
    split: opt.Split = "balanced",
    check: Annotated[bool, typer.Option("--check", help="Compare every loaded box with the checkpoint's bytes.")] = False,
    strict: Annotated[bool, typer.Option("--strict/--no-strict", help="Fail on a tensor missing from the checkpoint.")] = True,
    json_output: opt.Json = False,
    quiet: opt.Quiet = False,
    no_progress: opt.NoProgress = False,
    debug: opt.Debug = False,
) -> None:
    """Load a checkpoint on every rank, each its own boxes of the layout given (default: dim 0 over every rank)."""
    _check_rank_layout(_world_size(ctx), mesh, placements, rules, layout_files, split)
    _launch(ctx, {"job": "load", "ckpt": _absolute(ckpt), **_layout(mesh, placements, rules, layout_files, split),
                  "check": check, "strict": strict})


@app.command("reshard")
@handles_errors
def reshard(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="Source checkpoint (any format hpckpt reads).")],
    out: Annotated[Path, typer.Option("--output", "-o", help="Destination directory (HyperParallel DCP).")],
    world_size: opt.WorldSize = None,
    split: opt.Split = "balanced",
    mesh: opt.MeshOption = None,
    placements: opt.Placements = None,
    rules: opt.LayoutRules = None,
    layout_files: opt.LayoutFiles = None,
    keep_layout: Annotated[bool, typer.Option("--keep-layout", help="Keep each tensor's layout; change only the mesh size.")] = False,
    include: opt.Include = None,
    exclude: opt.Exclude = None,
    dtype: opt.DType = None,
    framework: opt.Framework = None,
    max_memory: opt.MaxMemory = "64MiB",
    no_fsync: opt.NoFsync = False,
    force: opt.Force = False,
    parents: opt.Parents = False,
    json_output: opt.Json = False,
    quiet: opt.Quiet = False,
    no_progress: opt.NoProgress = False,
    debug: opt.Debug = False,
) -> None:
    """The offline reshard spread over the workers: each writes its share of the target ranks."""
    from hpckpt.cli import _targets

    _targets.check_layout_options(world_size, mesh, placements, rules, layout_files, keep_layout)
    _size(max_memory, "--max-memory")
    _launch(ctx, {"job": "reshard", "src": _absolute(src), "out": _absolute(out), "world_size": world_size,
                  **_layout(mesh, placements, rules, layout_files, split), "keep_layout": keep_layout, "include": include or None, "exclude": exclude or None, "dtype": dtype,
                  "framework": framework, "max_memory": max_memory, "no_fsync": no_fsync, "force": force,
                  "parents": parents})


@app.command("bench")
@handles_errors
def bench(
    ctx: typer.Context,
    size: Annotated[Optional[str], typer.Option("--size", help="Synthetic tensors of this total size (e.g. 1GiB).")] = None,
    src: Annotated[Optional[Path], typer.Option("--from", help="Use the tensors of this checkpoint.")] = None,
    dtype: opt.DType = None,
    mesh: opt.MeshOption = None,
    placements: opt.Placements = None,
    rules: opt.LayoutRules = None,
    split: opt.Split = "balanced",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Save and load rounds.")] = 3,
    out: Annotated[Optional[Path], typer.Option("--output", "-o", help="Scratch directory (default: under the log dir).")] = None,
    json_output: opt.Json = False,
    quiet: opt.Quiet = False,
    no_progress: opt.NoProgress = False,
    debug: opt.Debug = False,
) -> None:
    """Measure live save and load throughput over the ranks."""
    _one_source(size, src)
    nbytes = _size(size, "--size")
    _check_rank_layout(_world_size(ctx), mesh, placements, rules, None, split)
    _launch(ctx, {"job": "bench", "size": nbytes, "from": _absolute(src), "dtype": dtype, "mesh": mesh,
                  "placements": placements, "rules": _absolute(rules), "split": split, "rounds": rounds,
                  "out": _absolute(out)})
