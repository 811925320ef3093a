"""`hpckpt consolidate SRC -o OUT`: whole tensors in one file (or Hugging Face shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors

EXAMPLES = """Examples:

  hpckpt consolidate ckpt/ -o model.safetensors --include 'model.*'
  hpckpt consolidate ckpt/ -o hf-model/ --format hf --max-shard-size 5GB --dtype bf16
  hpckpt consolidate ckpt/ -o model.pt --format pt      torch.load(..., weights_only=True)
  hpckpt consolidate ckpt/ -o one-rank/ --format hp     HyperParallel DCP, one rank
"""


@handles_errors
def consolidate(
    src: Annotated[Path, typer.Argument(help="Source checkpoint (any format hpckpt reads).")],
    out: Annotated[Path, typer.Option("--output", "-o", help="Output file (safetensors, pt, ms) or directory (hf, hp, torch-dcp).")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="Any format hpckpt writes: safetensors, hf, pt, ms, hp, torch-dcp.")] = "safetensors",
    include: opt.Include = None,
    exclude: opt.Exclude = None,
    dtype: opt.DType = None,
    max_shard_size: opt.MaxShardSize = "5GB",
    jobs: opt.Jobs = None,
    max_memory: opt.MaxMemory = "64MiB",
    no_fsync: opt.NoFsync = False,
    force: opt.Force = False,
    skip_unsupported: opt.SkipUnsupported = False,
    json_output: opt.Json = False,
) -> None:
    """Merge a sharded checkpoint into whole tensors for release or inference."""
    from hpckpt import api
    from hpckpt.cli import _targets
    from hpckpt.cli._output import TerminalProgress, emit_json, human_bytes, warn, warn_skipped
    from hpckpt.converters import DEPRECATED_ALIASES, format_named

    try:
        target = format_named(fmt)
        api.parse_size(max_shard_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--format") from None
    if fmt in DEPRECATED_ALIASES:
        warn(f"--format {fmt} is deprecated: it means {target.name} (hp); PyTorch's DCP is torch-dcp")
    with TerminalProgress("consolidate", enabled=not json_output) as progress:
        try:
            settings = _targets.settings(jobs, max_memory, no_fsync, force, progress)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        report = api.consolidate(src, out, target.name, select=_targets.selection(include, exclude), dtype=dtype,
                                 max_shard_size=max_shard_size, settings=settings, skip_unsupported=skip_unsupported)
    warn_skipped(report)
    if json_output:
        emit_json(report.to_json())
    else:
        print(f"{report['destination']} ({report['format']}): {human_bytes(report['bytes_written'])} written in "
              f"{report['seconds']:.2f} s ({report['gb_per_s'] or 0:.2f} GB/s)")
