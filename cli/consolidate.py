"""`hpckpt consolidate SRC -o OUT`: whole tensors in one file (or Hugging Face shards)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from hpckpt.cli._errors import handles_errors

EXAMPLES = """Examples:

  hpckpt consolidate ckpt/ -o model.safetensors --include 'model.*'
  hpckpt consolidate ckpt/ -o hf-model/ --format hf --max-shard-size 5GB --dtype bf16
  hpckpt consolidate ckpt/ -o model.pt --format pt      torch.load(..., weights_only=True)
  hpckpt consolidate ckpt/ -o one-rank/ --format dcp    HyperParallel DCP, one rank
"""


@handles_errors
def consolidate(
    src: Path = typer.Argument(..., help="Source checkpoint (any format hpckpt reads)."),
    out: Path = typer.Option(..., "--output", "-o", help="Output file (safetensors, pt) or directory (hf, dcp)."),
    fmt: str = typer.Option("safetensors", "--format", "-f", help="safetensors, hf, pt or dcp."),
    include: Optional[List[str]] = typer.Option(None, "--include", "-i", metavar="GLOB", help="Only entries matching (repeatable)."),
    exclude: Optional[List[str]] = typer.Option(None, "--exclude", "-x", metavar="GLOB", help="Leave out entries matching (repeatable)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast floating tensors: bf16, fp16, fp32, fp64."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="hf: largest shard (5GB = 5*10^9 bytes, 4GiB = 4*2^30)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Files written in parallel (hf)."),
    max_memory: str = typer.Option("64MiB", "--max-memory", help="Memory budget for copy buffers."),
    no_fsync: bool = typer.Option(False, "--no-fsync", help="Skip fsync: faster; still safe if killed, not on power loss."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
) -> None:
    """Merge a sharded checkpoint into whole tensors for release or inference."""
    from hpckpt import api
    from hpckpt.cli._output import TerminalProgress, emit_json, human_bytes

    if fmt not in api.CONSOLIDATE_FORMATS:
        raise typer.BadParameter(f"choose one of {', '.join(api.CONSOLIDATE_FORMATS)}", param_hint="--format")
    try:
        budget = api.parse_size(max_memory)
        api.parse_size(max_shard_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    with TerminalProgress("consolidate", enabled=not json_output) as progress:
        report = api.consolidate(src, out, fmt, include=include or (), exclude=exclude or (), dtype=dtype,
                                 max_shard_size=max_shard_size, force=force, jobs=jobs, max_memory=budget,
                                 progress=progress, sync=not no_fsync)
    if json_output:
        emit_json(report)
    else:
        print(f"{report['destination']} ({fmt}): {human_bytes(report['bytes_written'])} written in "
              f"{report['seconds']:.2f} s ({report['gb_per_s'] or 0:.2f} GB/s)")
