"""`hpckpt convert SRC -o DST --to FORMAT` and `hpckpt convert-ms-torch SRC -o DST`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from hpckpt.cli._errors import handles_errors

EXAMPLES = """Examples:

  hpckpt convert ckpt/ -o model.pt                      a torch.save file (target from the extension)
  hpckpt convert model.ckpt -o model.safetensors        MindSpore .ckpt -> safetensors
  hpckpt convert ckpt/ -o model.ckpt --to ms --crc      a MindSpore .ckpt with its CRC trailer
  hpckpt convert torch-dcp/ -o hp/ --to hp --world-size 8 --framework mindspore
  hpckpt convert hp/ -o torch-dcp/ --to torch-dcp       read back by torch.distributed.checkpoint.load
  hpckpt convert ckpt/ -o hf/ --to hf --dtype bf16 --include 'model.*'
"""

MS_TORCH_EXAMPLES = """Examples:

  hpckpt convert-ms-torch net.ckpt -o net.pt                  MindSpore -> torch, names mapped
  hpckpt convert-ms-torch model.pt -o model.ckpt              torch -> MindSpore
  hpckpt convert-ms-torch hp-ms/ -o hp-torch/                 a HyperParallel DCP stays one
  hpckpt convert-ms-torch net.ckpt -o net.pt --dry-run        the name table, nothing written
  hpckpt convert-ms-torch net.ckpt -o net.pt --name-rules rules.toml   see docs/name-rules.md
"""

_LAYOUT_HELP = "hp/torch-dcp target layout (default: the source's)."


def _layout(src, world_size, split, mesh, placements, rules, layout_files):
    """A layout spec when one is asked for; None keeps the source's layout."""
    from hpckpt.cli.reshard import layout_spec

    if world_size is None and mesh is None and not layout_files and rules is None:
        if placements:
            raise typer.BadParameter("--placements goes with --mesh")
        return None
    return layout_spec(src, world_size, split, mesh, placements, rules, layout_files, False)


def _rules(name_rules: Optional[Path], preset: Optional[str], direction: Optional[str]):
    """A rules file (its preset, or the direction's, after its rules), or a preset alone."""
    from dataclasses import replace

    from hpckpt.core import names

    if name_rules is not None:
        rules = names.load_rules(name_rules, direction=direction)
        return replace(rules, preset=None) if preset == "none" else rules
    if preset == "none":
        return None
    if preset is not None and preset not in names.PRESETS:
        raise typer.BadParameter(f"no preset or rules file {preset!r}: presets are {', '.join(names.PRESETS)}")
    return preset or direction


def _run(src, out, to, *, spec, framework, dtype, include, exclude, rules, max_shard_size, crc, jobs,
         max_memory, no_fsync, force, dry_run, json_output, command, index=None):
    from hpckpt import api
    from hpckpt.cli._output import TerminalProgress, emit_json

    try:
        budget = api.parse_size(max_memory)
        api.parse_size(max_shard_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    with TerminalProgress(command, enabled=not json_output and not dry_run) as progress:
        report = api.convert(src, out, to, spec=spec, framework=framework, dtype=dtype, include=include or (),
                             exclude=exclude or (), rules=rules, max_shard_size=max_shard_size, force=force,
                             jobs=jobs, max_memory=budget, progress=progress, sync=not no_fsync,
                             dry_run=dry_run, crc=crc, command=command, index=index)
    skipped = report.get("skipped") or []
    if skipped:  # on stderr in --json mode too: what was lost must not go unnoticed
        typer.echo(f"warning: not written (the {report['format']} format cannot hold them): {', '.join(skipped)}",
                   err=True)
    if json_output:
        emit_json(report)
    else:
        render(report)


def render(report: dict) -> None:
    from hpckpt.cli._output import human_bytes

    names = report.get("names")
    if names is not None and report.get("dry_run"):
        for line in names.get("table", []):
            print(line)
    if report.get("dry_run"):
        would = report["would_write"]
        print(f"dry run: {report['source']} ({report['source_format']}) -> {report['destination']} "
              f"({report['format']}): would write {would['tensors']} tensors ({human_bytes(would['bytes'])}) and "
              f"{would['values']} values; nothing written")
        return
    print(f"{report['destination']} ({report['format']}): {human_bytes(report['bytes_written'])} written in "
          f"{report['seconds']:.2f} s ({report['gb_per_s'] or 0:.2f} GB/s)")
    if names is not None and names.get("table"):
        print(names["table"][-1])  # the summary: renamed, unmapped, ambiguous, derived


@handles_errors
def convert(
    src: Path = typer.Argument(..., help="Source checkpoint: any format hpckpt reads, .ckpt and torch.save files too."),
    out: Path = typer.Option(..., "--output", "-o", help="Output file (pt, ms, safetensors) or directory (hf, hp, torch-dcp)."),
    to: Optional[str] = typer.Option(None, "--to", "-t", help="pt, ms, safetensors, hf, hp or torch-dcp (default: from -o's extension)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", "-w", min=1, help=_LAYOUT_HELP),
    split: str = typer.Option("balanced", "--split", help="Uneven split rule: balanced (HyperParallel) or ceil (PyTorch)."),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="Target device mesh, e.g. 2x4 (hp, torch-dcp)."),
    placements: Optional[str] = typer.Option(None, "--placements", help="Placement per mesh dim, e.g. R,S0."),
    layout_rules: Optional[Path] = typer.Option(None, "--layout-rules", help="TOML file of per-tensor placements."),
    layout_files: Optional[List[Path]] = typer.Option(None, "--layout-file", help="HyperParallel .layout JSON (repeatable)."),
    framework: Optional[str] = typer.Option(None, "--framework", help="hp: dtype strings as torch or mindspore writes them (default: the source's)."),
    names: Optional[str] = typer.Option(None, "--names", help="Rename entries: a preset (ms-to-torch, torch-to-ms, torch-to-ms-adamw) or a TOML rules file."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast floating tensors: bf16, fp16, fp32, fp64."),
    include: Optional[List[str]] = typer.Option(None, "--include", "-i", metavar="GLOB", help="Only entries whose source or destination name matches (repeatable)."),
    exclude: Optional[List[str]] = typer.Option(None, "--exclude", "-x", metavar="GLOB", help="Leave out entries whose source or destination name matches (repeatable)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="hf: largest shard."),
    crc: bool = typer.Option(False, "--crc", help="ms: end the .ckpt with MindSpore's CRC trailer."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Files written in parallel."),
    max_memory: str = typer.Option("64MiB", "--max-memory", help="Memory budget for copy buffers."),
    no_fsync: bool = typer.Option(False, "--no-fsync", help="Skip fsync: faster; still safe if killed, not on power loss."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be written (and the name table); write nothing."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Convert a checkpoint to another format: pt, ms, safetensors, hf, hp or torch-dcp."""
    from hpckpt import api

    to = to or api.target_from_extension(out)
    if to not in api.CONVERT_TARGETS:
        raise typer.BadParameter(f"choose one of {', '.join(api.CONVERT_TARGETS)} (or name -o with .pt, .ckpt, "
                                 ".safetensors)", param_hint="--to")
    if framework not in (None, "torch", "mindspore"):
        raise typer.BadParameter("torch or mindspore", param_hint="--framework")
    spec = _layout(src, world_size, split, mesh, placements, layout_rules, layout_files)
    if spec is not None and to not in ("hp", "torch-dcp"):
        raise typer.BadParameter(f"layout options apply to hp and torch-dcp targets, not {to}")
    rules = None
    if names is not None:
        rules = _rules(Path(names), None, None) if names.endswith(".toml") or Path(names).is_file() else _rules(None, names, None)
    _run(src, out, to, spec=spec, framework=framework, dtype=dtype, include=include, exclude=exclude, rules=rules,
         max_shard_size=max_shard_size, crc=crc, jobs=jobs, max_memory=max_memory, no_fsync=no_fsync, force=force,
         dry_run=dry_run, json_output=json_output, command="convert")


@handles_errors
def convert_ms_torch(
    src: Path = typer.Argument(..., help="A MindSpore or PyTorch checkpoint (.ckpt, .pt, safetensors, DCP)."),
    out: Path = typer.Option(..., "--output", "-o", help="Output file or directory; a file's extension picks the container."),
    to: Optional[str] = typer.Option(None, "--to", help="torch or mindspore (default: the other side of the source)."),
    to_format: Optional[str] = typer.Option(None, "--to-format", help="Container: pt, ms, safetensors, hf, hp, torch-dcp (default: the source's kind)."),
    name_rules: Optional[Path] = typer.Option(None, "--name-rules", help="TOML rules (docs/name-rules.md); the preset applies after them."),
    no_preset: bool = typer.Option(False, "--no-preset", help="Keep names as they are (only --name-rules rename)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast floating tensors: bf16, fp16, fp32, fp64."),
    include: Optional[List[str]] = typer.Option(None, "--include", "-i", metavar="GLOB", help="Only entries whose source or destination name matches (repeatable)."),
    exclude: Optional[List[str]] = typer.Option(None, "--exclude", "-x", metavar="GLOB", help="Leave out entries whose source or destination name matches (repeatable)."),
    crc: bool = typer.Option(False, "--crc", help="A .ckpt output ends with MindSpore's CRC trailer."),
    max_memory: str = typer.Option("64MiB", "--max-memory", help="Memory budget for copy buffers."),
    no_fsync: bool = typer.Option(False, "--no-fsync", help="Skip fsync: faster; still safe if killed, not on power loss."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the source -> destination name table; write nothing."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Convert between MindSpore and PyTorch: names, dtype strings and container."""
    from hpckpt import api

    if to not in (None, "torch", "mindspore"):
        raise typer.BadParameter("torch or mindspore", param_hint="--to")
    if to_format is not None and to_format not in api.CONVERT_TARGETS:
        raise typer.BadParameter(f"choose one of {', '.join(api.CONVERT_TARGETS)}", param_hint="--to-format")
    from hpckpt.converters import open_index

    index = open_index(src)  # once: the plan and the conversion share it
    plan = api.ms_torch_plan(src, out, to=to, to_format=to_format, index=index)
    direction = "ms-to-torch" if plan["to"] == "torch" else "torch-to-ms"
    rules = _rules(name_rules, "none" if no_preset else None, direction)
    _run(src, out, plan["format"], spec=None, framework=plan["to"], dtype=dtype, include=include, exclude=exclude,
         rules=rules, max_shard_size="5GB", crc=crc, jobs=None, max_memory=max_memory, no_fsync=no_fsync,
         force=force, dry_run=dry_run, json_output=json_output, command="convert-ms-torch", index=index)
