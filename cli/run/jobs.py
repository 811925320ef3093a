"""The jobs `hpckpt run` launches, a subcommand each: their options checked and turned into the
job's spec (`{"job": name, ...}`, absent or null = not given), which `start` launches."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import RankLayout, Select, TargetLayout, Write, expand_options
from hpckpt.cli.run import checks
from hpckpt.cli.run.start import start

Coordination = Literal["collectives", "storage", "none"]
Broadcast = Literal["auto", "always", "never"]
BROADCAST_SHARED = {"auto": "auto", "always": True, "never": False}  # hpckpt.dist.load's broadcast_shared


@handles_errors
@expand_options
def selftest(
    ctx: typer.Context,
    fail_rank: Annotated[Optional[int], typer.Option("--fail-rank", min=0, help="Make this rank fail (tests failure propagation).")] = None,
    nbytes: Annotated[Optional[str], typer.Option("--bytes", help="Report progress over this many bytes per rank (e.g. 64MiB).")] = None,
    crash_rank: Annotated[Optional[int], typer.Option("--crash-rank", min=0, help="Make this rank die by SIGKILL (no report).")] = None,
    step_seconds: Annotated[float, typer.Option("--step-seconds", min=0, hidden=True)] = 0.0,
) -> None:
    """Check the launcher set-up: every rank gathers every rank's host and pid, and reports."""
    world = checks.world_size(ctx)
    for option, rank in (("--fail-rank", fail_rank), ("--crash-rank", crash_rank)):
        if rank is not None and rank >= world:
            raise typer.BadParameter(f"{option} {rank} is not a rank of the job (0..{world - 1})")
    start(ctx, {"job": "selftest", "fail_rank": fail_rank, "crash_rank": crash_rank,
                "bytes": checks.size(nbytes, "--bytes"), "step_seconds": step_seconds})


@handles_errors
@expand_options
def save(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--output", "-o", parser=location, help="The checkpoint to write (HyperParallel DCP; a path or an s3:// URL).")],
    size: Annotated[Optional[str], typer.Option("--size", help="Synthetic tensors of this total size (e.g. 1.5GiB).")] = None,
    dtype: Annotated[Optional[opt.DTypeName], typer.Option(
        "--dtype", help="The weights' dtype (--size; default bf16, moments stay fp32), or a cast of --from's floating tensors.")] = None,
    src: Annotated[Optional[Path], typer.Option("--from", parser=location, help="Save the tensors of this checkpoint (any format hpckpt reads).")] = None,
    layout: RankLayout = RankLayout(),
    coordination: Annotated[Coordination, typer.Option("--coordination", help="How the ranks agree on the plan.")] = "collectives",
    async_save: Annotated[bool, typer.Option("--async", help="Save in the background (async_save) and wait for it.")] = False,
    force: opt.Force = False,
    fail_rank: Annotated[Optional[int], typer.Option("--fail-rank", min=0, hidden=True,
                                                     help="Make this rank fail while writing (tests).")] = None,
) -> None:
    """Save a checkpoint from every rank (synthetic tensors, or those of SRC laid out over the ranks)."""
    checks.one_source(size, src)
    nbytes = checks.size(size, "--size")
    checks.rank_layout(checks.world_size(ctx), layout)
    start(ctx, {"job": "save", "out": checks.absolute(out), "size": nbytes, "dtype": dtype,
                "from": checks.absolute(src), **checks.layout_part(layout), "coordination": coordination,
                "async": async_save, "force": force, "fail_rank": fail_rank})


@handles_errors
@expand_options
def load(
    ctx: typer.Context,
    ckpt: Annotated[Path, typer.Argument(parser=location, help="The checkpoint to load (any format hpckpt reads; a path or an s3:// URL).")],
    layout: RankLayout = RankLayout(),
    check: Annotated[bool, typer.Option("--check", help="Compare every loaded box with the checkpoint's bytes.")] = False,
    strict: Annotated[bool, typer.Option("--strict/--no-strict", help="Fail on a tensor missing from the checkpoint.")] = True,
    broadcast: Annotated[Broadcast, typer.Option(
        "--broadcast", help="Boxes several ranks want: read once and broadcast (always), read by each (never), "
                            "or whichever costs less (auto).")] = "auto",
    storage_bandwidth: Annotated[Optional[str], typer.Option(
        "--storage-bandwidth", help="The storage's read rate for --broadcast auto (e.g. 2GiB/s; default: measured).")] = None,
    network_bandwidth: Annotated[Optional[str], typer.Option(
        "--network-bandwidth", help="A broadcast's rate over the job for --broadcast auto (e.g. 10GB/s; default: measured).")] = None,
) -> None:
    """Load a checkpoint on every rank, each its own boxes of the layout given (default: dim 0 over every rank)."""
    checks.rank_layout(checks.world_size(ctx), layout)
    start(ctx, {"job": "load", "ckpt": checks.absolute(ckpt), **checks.layout_part(layout), "check": check,
                "strict": strict, "broadcast_shared": BROADCAST_SHARED[broadcast],
                "storage_bandwidth": checks.rate(storage_bandwidth, "--storage-bandwidth"),
                "network_bandwidth": checks.rate(network_bandwidth, "--network-bandwidth")})


@handles_errors
@expand_options
def reshard(
    ctx: typer.Context,
    src: opt.Source,
    out: Annotated[Path, typer.Option("--output", "-o", parser=location, help="Destination directory (a path or an s3:// URL).")],
    to: Annotated[opt.LayoutFormatName, typer.Option(
        "--to", "-t", help="The destination's format: hyperparallel (hp), torch-dcp or mindformers (mf).")] = "hyperparallel",
    layout: TargetLayout = TargetLayout(),
    select: Select = Select(),
    dtype: opt.DType = None,
    framework: opt.Framework = None,
    keep_replicas: opt.KeepReplicas = False,
    write: Write = Write(),
) -> None:
    """The offline reshard spread over the workers: each writes its share of the target ranks."""
    layout.check()
    checks.size(write.max_memory, "--max-memory")
    start(ctx, {"job": "reshard", "src": checks.absolute(src), "out": checks.absolute(out), "to": to,
                "keep_replicas": keep_replicas, "world_size": layout.world_size, **checks.layout_part(layout),
                "keep_layout": layout.keep_layout,
                "include": select.include or None, "exclude": select.exclude or None, "dtype": dtype,
                "framework": framework, "max_memory": write.max_memory, "no_fsync": write.no_fsync,
                "force": write.force, "parents": write.parents, "no_manifest": write.no_manifest})


@handles_errors
@expand_options
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
) -> None:
    """Measure live save and load throughput over the ranks."""
    checks.one_source(size, src)
    nbytes = checks.size(size, "--size")
    checks.rank_layout(checks.world_size(ctx), RankLayout(mesh=mesh, placements=placements, rules=rules, split=split))
    start(ctx, {"job": "bench", "size": nbytes, "from": checks.absolute(src), "dtype": dtype, "mesh": mesh,
                "placements": placements, "rules": checks.absolute(rules), "split": split, "rounds": rounds,
                "out": checks.absolute(out)})
