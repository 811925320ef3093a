"""`hpckpt reshard SRC -o DST`: a new world size or parallel layout, streamed in bounded memory."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from hpckpt.cli._errors import handles_errors

EXAMPLES = """Examples:

  hpckpt reshard ckpt/ -o ckpt-64/ --world-size 64           FSDP-style: dim 0 over 64 ranks
  hpckpt reshard ckpt/ -o out/ --mesh 2x4 --placements R,S0  HSDP: replicate x shard
  hpckpt reshard ckpt/ -o out/ --mesh 2x4 --layout-rules tp.toml   per-tensor placements
  hpckpt reshard ckpt/ -o out/ --layout-file rank0.layout --layout-file rank1.layout
  hpckpt reshard ckpt/ -o out/ --mesh 2x8 --keep-layout      same layouts, new mesh size
  hpckpt reshard ckpt/ -o out/ --world-size 64 --plan        what each rank reads and writes
  hpckpt reshard ckpt/ -o out/ --world-size 64 --rank 0-15   this machine's share (fan-out)
  hpckpt reshard --finalize out/                             metadata, once every share is done
"""


def layout_spec(src, world_size, split, mesh, placements, rules, layout_files, keep_layout):
    """The target layout the options name (shared by reshard and convert), checked for conflicts."""
    from hpckpt import api
    from hpckpt.core.layout import LayoutSpec, Mesh, load_rules, parse_mesh, parse_placements

    if keep_layout:
        if placements or rules or layout_files or (world_size is None) == (mesh is None):
            raise typer.BadParameter("--keep-layout goes with exactly one of --world-size or --mesh, and nothing else")
        return api.keep_layout_spec(src, Mesh((world_size,)) if world_size is not None else parse_mesh(mesh))
    chosen = sum(x is not None and x != [] for x in (world_size, mesh, layout_files))
    if chosen != 1 and not (rules and chosen == 0):
        raise typer.BadParameter("give exactly one target: --world-size, --mesh (with --placements or "
                                 "--layout-rules), --layout-rules with a mesh inside, or --layout-file")
    if world_size is not None:
        return LayoutSpec.for_world_size(world_size, split)
    if layout_files:
        return LayoutSpec.from_layout_files(layout_files)
    target_mesh = parse_mesh(mesh) if mesh else None
    if rules is not None:
        spec = LayoutSpec.from_toml(rules, mesh=target_mesh)
        if placements:
            spec.default = parse_placements(placements, split)
        return spec
    if not placements:
        raise typer.BadParameter("--mesh needs --placements (or --layout-rules)")
    return LayoutSpec(target_mesh, parse_placements(placements, split), load_rules(rules) if rules else ())


@handles_errors
def reshard(
    src: Optional[Path] = typer.Argument(None, help="Source checkpoint (any format hpckpt reads); with --finalize, the destination."),
    out: Optional[Path] = typer.Option(None, "--output", "-o", help="Destination directory (HyperParallel DCP)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", "-w", min=1, help="FSDP-style target: dim 0 split over N ranks."),
    split: str = typer.Option("balanced", "--split", help="Uneven split rule: balanced (HyperParallel) or ceil (PyTorch)."),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="Target device mesh, e.g. 2x4."),
    placements: Optional[str] = typer.Option(None, "--placements", help="Placement per mesh dim, e.g. R,S0."),
    rules: Optional[Path] = typer.Option(None, "--layout-rules", help="TOML file of per-tensor placements (see README)."),
    layout_files: Optional[List[Path]] = typer.Option(None, "--layout-file", help="HyperParallel .layout JSON (repeatable)."),
    keep_layout: bool = typer.Option(False, "--keep-layout", help="Keep each tensor's layout; change only the mesh size."),
    rank: Optional[List[str]] = typer.Option(None, "--rank", "-r", metavar="R", help="Write only these target ranks (e.g. 3, 0-7); repeatable."),
    finalize: bool = typer.Option(False, "--finalize", help="Write the metadata of a fanned-out reshard."),
    include: Optional[List[str]] = typer.Option(None, "--include", "-i", metavar="GLOB", help="Only entries matching (repeatable)."),
    exclude: Optional[List[str]] = typer.Option(None, "--exclude", "-x", metavar="GLOB", help="Leave out entries matching (repeatable)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast floating tensors: bf16, fp16, fp32, fp64."),
    framework: Optional[str] = typer.Option(None, "--framework", help="dtype strings as torch or mindspore writes them (default: the source's)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Files written in parallel (default: cores, at most 8)."),
    max_memory: str = typer.Option("64MiB", "--max-memory", help="Memory budget for copy buffers."),
    no_fsync: bool = typer.Option(False, "--no-fsync", help="Skip fsync: faster; still safe if killed, not on power loss."),
    force: bool = typer.Option(False, "--force", help="Replace an existing destination."),
    dry_run: bool = typer.Option(False, "--plan", "--dry-run", help="Print what each target rank reads and writes; copy nothing."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Reshard a checkpoint to a new world size or layout (output: HyperParallel DCP)."""
    from hpckpt import api
    from hpckpt.cli._output import TerminalProgress, emit_json, parse_ranks

    if finalize:
        if src is None:
            raise typer.BadParameter("--finalize needs the destination directory")
        report = api.finalize(src)
    else:
        if src is None or out is None:
            raise typer.BadParameter("give SRC and -o DST")
        try:
            spec = layout_spec(src, world_size, split, mesh, placements, rules, layout_files, keep_layout)
            ranks = parse_ranks(rank)
            budget = api.parse_size(max_memory)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        with TerminalProgress("reshard", enabled=not json_output) as progress:
            report = api.reshard(src, out, spec, include=include or (), exclude=exclude or (), ranks=ranks,
                                 force=force, jobs=jobs, max_memory=budget, framework=framework, dtype=dtype,
                                 dry_run=dry_run, progress=progress, sync=not no_fsync)
    if json_output:
        emit_json(report)
    else:
        render(report)


def render(report: dict) -> None:
    from hpckpt.cli._output import human_bytes, write_table

    if report.get("finalized") and "plan" not in report:
        print(f"Finalized {report['destination']}: {report['files']} files, metadata written")
        return
    plan = report["plan"]
    if report["dry_run"]:
        write_table(
            f"Plan: {report['source']} -> {report['destination']} ({plan['world_size']} ranks)",
            [("rank", "right"), ("writes", "right"), ("reads", "right"), ("source files", "right")],
            [(str(r["rank"]), human_bytes(r["bytes_written"]), human_bytes(r["bytes_read"]), str(r["source_files"]))
             for r in plan["ranks"]],
        )
        amplification = plan["bytes_read"] / plan["bytes"] if plan["bytes"] else 0
        print(f"\nTotal: writes {human_bytes(plan['bytes'])} in {plan['files']} files, reads "
              f"{human_bytes(plan['bytes_read'])} (read amplification {amplification:.2f}); "
              f"at 1 GB/s about {plan['bytes'] / 1e9:.1f} s")
        return
    state = "written" if report["finalized"] else "written (fan-out share; run `hpckpt reshard --finalize` when all are done)"
    print(f"{report['destination']}: {plan['world_size']} ranks, {plan['files']} files, "
          f"{human_bytes(report['bytes_written'])} {state} in {report['seconds']:.2f} s "
          f"({report['gb_per_s'] or 0:.2f} GB/s)")
