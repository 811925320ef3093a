"""Options several commands share, declared once (typer `Annotated` aliases), so their names and
help read the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

Include = Annotated[Optional[List[str]], typer.Option(
    "--include", "-i", metavar="GLOB", help="Only entries matching (repeatable).")]
Exclude = Annotated[Optional[List[str]], typer.Option(
    "--exclude", "-x", metavar="GLOB", help="Leave out entries matching (repeatable).")]
RenamedInclude = Annotated[Optional[List[str]], typer.Option(
    "--include", "-i", metavar="GLOB", help="Only entries whose source or destination name matches (repeatable).")]
RenamedExclude = Annotated[Optional[List[str]], typer.Option(
    "--exclude", "-x", metavar="GLOB", help="Leave out entries whose source or destination name matches (repeatable).")]
DType = Annotated[Optional[str], typer.Option("--dtype", help="Cast floating tensors: bf16, fp16, fp32, fp64.")]
Jobs = Annotated[Optional[int], typer.Option(
    "--jobs", "-j", min=1, help="Files written in parallel (default: cores, at most 8).")]
MaxMemory = Annotated[str, typer.Option("--max-memory", help="Memory budget for copy buffers.")]
MaxShardSize = Annotated[str, typer.Option(
    "--max-shard-size", help="hf-sharded: largest shard (5GB = 5*10^9 bytes, 4GiB = 4*2^30).")]
NoFsync = Annotated[bool, typer.Option("--no-fsync", help="Skip fsync: faster; still safe if killed, not on power loss.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing destination.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON document.")]
SkipUnsupported = Annotated[bool, typer.Option(
    "--skip-unsupported", help="Leave out (and list) tensors of a dtype the target format cannot hold, instead of failing.")]

WorldSize = Annotated[Optional[int], typer.Option(
    "--world-size", "-w", min=1, help="FSDP-style target: dim 0 split over N ranks.")]
Split = Annotated[str, typer.Option("--split", help="Uneven split rule: balanced (HyperParallel) or ceil (PyTorch).")]
MeshOption = Annotated[Optional[str], typer.Option("--mesh", help="Target device mesh, e.g. 2x4.")]
Placements = Annotated[Optional[str], typer.Option("--placements", help="Placement per mesh dim, e.g. R,S0.")]
LayoutRules = Annotated[Optional[Path], typer.Option(
    "--layout-rules", help="TOML file of per-tensor placements (see README).")]
LayoutFiles = Annotated[Optional[List[Path]], typer.Option(
    "--layout-file", help="HyperParallel .layout JSON (repeatable).")]
