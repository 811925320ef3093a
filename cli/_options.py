"""Options several commands share, declared once (typer `Annotated` aliases), so their names and
help read the same everywhere; the options that travel together are grouped in
`cli._option_groups`.

An option with a fixed set of values is a `Literal`: typer makes it a choice, so `--help` lists
the values, the completion scripts offer them and a wrong one exits 2 naming the valid ones.
The output options (`--json`, `--quiet`, `--no-progress`, `--debug`) are accepted before the
command and after it; either place sets the one state `cli._output` holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Literal, Optional

import typer

from hpckpt.cli._errors import location

# Every name and alias of a format hpckpt writes (`hpckpt.converters.FORMATS`; a test checks that
# the two agree). Spelled out here: importing the registry would load every adapter at start-up.
WRITABLE_FORMATS = ("hyperparallel", "hp", "torch-dcp", "mindformers", "mf", "hf-sharded", "hf", "mindspore-ckpt", "ms", "ckpt",
                    "safetensors", "torch-save", "pt")
FormatName = Literal[WRITABLE_FORMATS]  # type: ignore[valid-type]
#: the formats that store any layout: what `reshard --to` writes
LAYOUT_FORMATS = ("hyperparallel", "hp", "torch-dcp", "mindformers", "mf")
LayoutFormatName = Literal[LAYOUT_FORMATS]  # type: ignore[valid-type]
DTypeName = Literal["bf16", "fp16", "fp32", "fp64", "bfloat16", "float16", "float32", "float64"]
SplitRule = Literal["balanced", "ceil"]
FrameworkName = Literal["torch", "mindspore"]
ShellName = Literal["bash", "zsh", "fish"]


def fold_deprecated(token: str) -> str:
    """Deprecated spellings of a choice (`--format dcp`) still match the name they stand for, but
    are not offered: click folds every token through this before comparing it with the choices."""
    if token == "dcp":
        from hpckpt.cli._output import warn

        warn("dcp is deprecated: it means hyperparallel (hp); PyTorch's DCP is torch-dcp")
        return "hyperparallel"
    return token


def _remember(key: str):
    """A callback storing a flag in the shared output state (eager: set before other options are
    checked, so a usage error in --json mode is answered in JSON too)."""

    def callback(value: bool) -> bool:
        if value:
            from hpckpt.cli import _output

            _output.configure(**{key: True})
        return value

    return callback


Json = Annotated[bool, typer.Option("--json", help="Print one JSON document (also before the command).",
                                    is_eager=True, callback=_remember("json"))]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress and no informational lines; "
                                     "warnings about lost data are still printed.", is_eager=True,
                                     callback=_remember("quiet"))]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress display on stderr.",
                                          is_eager=True, callback=_remember("no_progress"))]
Debug = Annotated[bool, typer.Option("--debug", help="Show the full traceback when the command fails.",
                                     is_eager=True, callback=_remember("debug"))]

Include = Annotated[Optional[List[str]], typer.Option(
    "--include", "-i", metavar="GLOB", help="Only entries matching (repeatable).")]
Exclude = Annotated[Optional[List[str]], typer.Option(
    "--exclude", "-x", metavar="GLOB", help="Leave out entries matching (repeatable).")]
RenamedInclude = Annotated[Optional[List[str]], typer.Option(
    "--include", "-i", metavar="GLOB", help="Only entries whose source or destination name matches (repeatable).")]
RenamedExclude = Annotated[Optional[List[str]], typer.Option(
    "--exclude", "-x", metavar="GLOB", help="Leave out entries whose source or destination name matches (repeatable).")]
DType = Annotated[Optional[DTypeName], typer.Option("--dtype", help="Cast floating tensors.")]
Jobs = Annotated[Optional[int], typer.Option(
    "--jobs", "-j", min=1, help="Files written in parallel (default: cores, at most 8).")]
MaxMemory = Annotated[str, typer.Option("--max-memory", help="Memory budget for copy buffers.")]
MaxShardSize = Annotated[str, typer.Option(
    "--max-shard-size", help="hf-sharded: largest shard (5GB = 5*10^9 bytes, 4GiB = 4*2^30).")]
NoFsync = Annotated[bool, typer.Option("--no-fsync", help="Skip fsync: faster; still safe if killed, not on power loss.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing destination.")]
Parents = Annotated[bool, typer.Option("--parents", help="Create missing parent directories of -o.")]
NoManifest = Annotated[bool, typer.Option(
    "--no-manifest", help="Write no integrity manifest (.hpckpt-manifest.jsonl, or NAME.hpckpt-manifest.jsonl beside "
    "a single file); verify --deep then reads every chunk instead.")]
SkipUnsupported = Annotated[bool, typer.Option(
    "--skip-unsupported", help="Leave out (and list) tensors of a dtype the target format cannot hold, instead of failing.")]
KeepReplicas = Annotated[bool, typer.Option(
    "--keep-replicas", help="mindformers: every rank holding a replicated box writes it (MindFormers without "
    "remove-redundancy); default: each box once.")]
Framework = Annotated[Optional[FrameworkName], typer.Option(
    "--framework", help="dtype strings as torch or mindspore writes them (default: the source's).")]

Source = Annotated[Path, typer.Argument(help="Source checkpoint (any format hpckpt reads; a path or an s3:// URL).", parser=location)]

WorldSize = Annotated[Optional[int], typer.Option(
    "--world-size", "-w", min=1, help="FSDP-style target: dim 0 split over N ranks.")]
Split = Annotated[SplitRule, typer.Option("--split", help="Uneven split rule: balanced (HyperParallel) or ceil (PyTorch).")]
MeshOption = Annotated[Optional[str], typer.Option("--mesh", help="Target device mesh, e.g. 2x4.")]
Placements = Annotated[Optional[str], typer.Option("--placements", help="Placement per mesh dim, e.g. R,S0.")]
LayoutRules = Annotated[Optional[Path], typer.Option(
    "--layout-rules", help="TOML file of per-tensor placements (docs/commands.md, layout rules).")]
LayoutFiles = Annotated[Optional[List[Path]], typer.Option(
    "--layout-file", help="HyperParallel .layout JSON (repeatable).")]
KeepLayout = Annotated[bool, typer.Option("--keep-layout", help="Keep each tensor's layout; change only the mesh size.")]
