"""`hpckpt consolidate SRC -o OUT`: whole tensors in one file (or Hugging Face shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import ParallelWrite, Select, expand_options

EXAMPLES = """Examples:

  hpckpt consolidate ckpt/ -o model.safetensors --include 'model.*'
  hpckpt consolidate ckpt/ -o hf-model/ --format hf --max-shard-size 5GB --dtype bf16
  hpckpt consolidate ckpt/ -o model.pt                  torch.load(..., weights_only=True)
  hpckpt consolidate ckpt/ -o one-rank/ --format hp     HyperParallel DCP, one rank
"""


@handles_errors
@expand_options
def consolidate(
    src: opt.Source,
    out: Annotated[Path, typer.Option("--output", "-o", parser=location, help="Output file (safetensors, pt, ms) or directory (hf, hp, torch-dcp).")],
    fmt: Annotated[Optional[opt.FormatName], typer.Option(
        "--format", "-f", help="Any format hpckpt writes (default: from -o's extension, else safetensors).")] = None,
    select: Select = Select(),
    dtype: opt.DType = None,
    max_shard_size: opt.MaxShardSize = "5GB",
    write: ParallelWrite = ParallelWrite(),
    skip_unsupported: opt.SkipUnsupported = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be written; write nothing.")] = False,
    html: Annotated[Optional[Path], typer.Option(
        "--html", metavar="FILE", help="With --dry-run: also write the plan as a self-contained page (the source's "
        "boxes beside the whole tensors, what is read).")] = None,
) -> None:
    """Merge a sharded checkpoint into whole tensors for release or inference."""
    from hpckpt import api
    from hpckpt.cli import _output, _targets
    from hpckpt.cli._progress import TerminalProgress
    from hpckpt.core.commit.lock import reading

    if html is not None and not dry_run:
        raise typer.BadParameter("--html goes with --dry-run (the plan's page)", param_hint="--html")
    with TerminalProgress("consolidate") as progress, reading(src):  # before its metadata is read
        try:
            target = _targets.output_format(fmt, out, "--format", default="safetensors")
            api.parse_size(max_shard_size)
            settings = write.settings(progress)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        index = _targets.open_source(src, progress)
        report = api.consolidate(src, out, target.name, select=select.selection(), dtype=dtype,
                                 max_shard_size=max_shard_size, settings=settings, skip_unsupported=skip_unsupported,
                                 index=index, dry_run=dry_run)
        page = None
        if html is not None:
            from hpckpt.api.consolidate import consolidate_target
            from hpckpt.api.plan_view import plan_view
            from hpckpt.cli.html import write_plan_page

            selection = select.selection()
            names = None if selection.everything else selection.names([*index.tensors, *index.values])
            view = plan_view(index, consolidate_target(target.name, dtype=dtype), names, planned=report.planned)
            page = {"path": str(html), "bytes": write_plan_page(html, src, out, index.format, target.name, view)}
    _output.warn_skipped(report)
    if _output.json_mode():
        _output.emit_json({**report.to_json(), **({"html": page} if page else {})})
    elif dry_run:
        _output.result_line(f"dry run: {report['source']} ({report['source_format']}) -> {report['destination']} "
                            f"({report['format']}): would write {report['files']} file(s); nothing written")
        if page:
            _output.result_line(f"wrote {html} ({_output.human_bytes(page['bytes'])})")
    else:
        _output.result_line(f"{report['destination']} ({report['format']}): {_output.human_bytes(report['bytes_written'])} "
                            f"written in {report['seconds']:.2f} s ({_output.rate(report)})")
