"""`hpckpt convert SRC -o DST --to FORMAT`: any source hpckpt reads into any format it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import ParallelWrite, RenamedSelect, expand_options

EXAMPLES = """Examples:

  hpckpt convert ckpt/ -o model.pt                      a torch.save file (target from the extension)
  hpckpt convert model.ckpt -o model.safetensors        MindSpore .ckpt -> safetensors
  hpckpt convert ckpt/ -o model.ckpt --to ms --crc      a MindSpore .ckpt with its CRC trailer
  hpckpt convert torch-dcp/ -o hp/ --to hp --world-size 8 --framework mindspore
  hpckpt convert hp/ -o torch-dcp/ --to torch-dcp       read back by torch.distributed.checkpoint.load
  hpckpt convert ckpt/ -o hf/ --to hf --dtype bf16 --include 'model.*'
"""

_LAYOUT_HELP = "hp/torch-dcp/mindformers target layout (default: the source's)."


def name_rules(rules_file: Optional[Path], preset: Optional[str], direction: Optional[str]):
    """A rules file (its preset, or the direction's, after its rules), or a preset alone."""
    from dataclasses import replace

    from hpckpt.converters import naming

    if rules_file is not None:
        rules = naming.load_rules(rules_file, direction=direction)
        return replace(rules, preset=None) if preset == "none" else rules
    if preset == "none":
        return None
    if preset is not None and preset not in naming.PRESETS:
        raise typer.BadParameter(f"no preset or rules file {preset!r}: presets are {', '.join(naming.PRESETS)}")
    return preset or direction


def run(src, out, to, *, layout, framework, dtype, select, rules, max_shard_size, crc, write, dry_run, command,
        index=None, skip_unsupported=False, progress=None, keep_replicas=False, html=None) -> None:
    """Run `api.convert` with the options both convert commands share, and render its report.
    `write` is the command's Write or ParallelWrite options."""
    from hpckpt import api
    from hpckpt.cli import _output, _targets

    try:
        settings = write.settings(None if dry_run else progress)
        api.parse_size(max_shard_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if index is None:
        index = _targets.open_source(src, progress)
    report = api.convert(src, out, to, layout=layout, framework=framework, dtype=dtype,
                         select=select.selection(), rules=rules, max_shard_size=max_shard_size,
                         crc=crc, settings=settings, dry_run=dry_run, command=command, index=index,
                         skip_unsupported=skip_unsupported, keep_replicas=keep_replicas)
    page = None
    if html is not None:  # (a dry run: checked by the command)
        from hpckpt.api.plan_view import convert_view
        from hpckpt.cli.html import write_plan_page

        view, fmt = convert_view(index, out, to, layout=layout, rules=rules, select=select.selection(), dtype=dtype,
                                 keep_replicas=keep_replicas, planned=report.planned)
        page = {"path": str(html), "bytes": write_plan_page(html, src, out, index.format, fmt, view)}
    progress.stop()
    _output.warn_skipped(report)
    if _output.json_mode():
        _output.emit_json({**report.to_json(), **({"html": page} if page else {})})
        return
    if page:
        _output.result_line(f"wrote {html} ({_output.human_bytes(page['bytes'])})")
    names = report.get("names")
    if report["dry_run"]:
        for line in (names or {}).get("table", []):
            print(_output.printable(line))
        would = report["would_write"]
        print(_output.printable(f"dry run: {report['source']} ({report['source_format']}) -> {report['destination']} "
              f"({report['format']}): would write {would['tensors']} tensors ({_output.human_bytes(would['bytes'])}) "
              f"and {would['values']} values; nothing written"))
        return
    _output.result_line(f"{report['destination']} ({report['format']}): {_output.human_bytes(report['bytes_written'])} "
                        f"written in {report['seconds']:.2f} s ({_output.rate(report)})")
    if names and names.get("table"):
        _output.result_line(names["table"][-1])  # the summary: renamed, unmapped, ambiguous, derived
    for name, why in ((names or {}).get("ambiguous") or {}).items():  # named in every mode, not only --dry-run
        _output.warn(f"ambiguous name {name}: {why}")


@handles_errors
@expand_options
def convert(
    src: Annotated[Path, typer.Argument(parser=location, help="Source checkpoint: any format hpckpt reads, .ckpt and torch.save files too.")],
    out: Annotated[Path, typer.Option("--output", "-o", parser=location, help="Output file (pt, ms, safetensors) or directory (hf, hp, torch-dcp).")],
    to: Annotated[Optional[opt.FormatName], typer.Option(
        "--to", "-t", help="Any format hpckpt writes (default: from -o's extension).")] = None,
    world_size: Annotated[Optional[int], typer.Option("--world-size", "-w", min=1, help=_LAYOUT_HELP)] = None,
    split: opt.Split = "balanced",
    mesh: Annotated[Optional[str], typer.Option("--mesh", help="Target device mesh, e.g. 2x4 (hp, torch-dcp, mindformers).")] = None,
    placements: opt.Placements = None,
    layout_rules: opt.LayoutRules = None,
    layout_files: opt.LayoutFiles = None,
    framework: Annotated[Optional[opt.FrameworkName], typer.Option("--framework", help="dtype strings and file flavour as torch or mindspore writes them (hp default: the source's).")] = None,
    names: Annotated[Optional[str], typer.Option("--names", help="Rename entries: a preset (ms-to-torch, torch-to-ms, torch-to-ms-adamw) or a TOML rules file.")] = None,
    dtype: opt.DType = None,
    select: RenamedSelect = RenamedSelect(),
    max_shard_size: opt.MaxShardSize = "5GB",
    crc: Annotated[bool, typer.Option("--crc", help="ms: end the .ckpt with MindSpore's CRC trailer.")] = False,
    write: ParallelWrite = ParallelWrite(),
    skip_unsupported: opt.SkipUnsupported = False,
    keep_replicas: opt.KeepReplicas = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be written (and the name table); write nothing.")] = False,
    html: Annotated[Optional[Path], typer.Option(
        "--html", metavar="FILE", help="With --dry-run: also write the plan as a self-contained page (source and "
        "target shard maps side by side, what each target rank writes and reads).")] = None,
) -> None:
    """Convert a checkpoint to another format: pt, ms, safetensors, hf, hp, torch-dcp or mindformers."""
    from hpckpt.cli import _targets
    from hpckpt.cli._progress import TerminalProgress

    if html is not None and not dry_run:
        raise typer.BadParameter("--html goes with --dry-run (the plan's page)", param_hint="--html")

    try:
        fmt = _targets.output_format(to, out, "--to")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--to") from None
    layouts_given = world_size is not None or mesh is not None or layout_files or layout_rules is not None
    if layouts_given:
        _targets.check_layout_options(world_size, mesh, placements, layout_rules, layout_files)
    elif placements:
        raise typer.BadParameter("--placements goes with --mesh")
    if layouts_given and fmt.whole_tensors:
        raise typer.BadParameter(f"layout options apply to hp, torch-dcp and mindformers targets, not {fmt.name}")
    rules = None
    if names is not None:
        is_file = names.endswith(".toml") or Path(names).is_file()
        rules = name_rules(Path(names), None, None) if is_file else name_rules(None, names, None)
    from hpckpt.core.commit.lock import reading

    with TerminalProgress("convert") as progress, reading(src):  # before its metadata is read
        index = _targets.open_source(src, progress)
        layout = None
        if layouts_given:
            try:
                layout = _targets.layout_spec(index, world_size, split, mesh, placements, layout_rules, layout_files)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
        run(src, out, fmt.name, layout=layout, framework=framework, dtype=dtype, select=select, rules=rules,
            max_shard_size=max_shard_size, crc=crc, write=write, dry_run=dry_run, command="convert",
            skip_unsupported=skip_unsupported, index=index, progress=progress, keep_replicas=keep_replicas,
            html=html)
