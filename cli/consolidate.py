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
) -> None:
    """Merge a sharded checkpoint into whole tensors for release or inference."""
    from hpckpt import api
    from hpckpt.cli import _output, _targets
    from hpckpt.cli._progress import TerminalProgress
    from hpckpt.core.commit.lock import reading

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
                                 index=index)
    _output.warn_skipped(report)
    if _output.json_mode():
        _output.emit_json(report.to_json())
    else:
        _output.result_line(f"{report['destination']} ({report['format']}): {_output.human_bytes(report['bytes_written'])} "
                            f"written in {report['seconds']:.2f} s ({_output.rate(report)})")
