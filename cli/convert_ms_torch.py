"""`hpckpt convert-ms-torch SRC -o DST`: MindSpore <-> PyTorch in one step (names, dtypes, container)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import RenamedSelect, Write, expand_options

EXAMPLES = """Examples:

  hpckpt convert-ms-torch net.ckpt -o net.pt                  MindSpore -> torch, names mapped
  hpckpt convert-ms-torch model.pt -o model.ckpt              torch -> MindSpore
  hpckpt convert-ms-torch hp-ms/ -o hp-torch/                 a HyperParallel DCP stays one
  hpckpt convert-ms-torch net.ckpt -o net.pt --dry-run        the name table, nothing written
  hpckpt convert-ms-torch net.ckpt -o net.pt --name-rules rules.toml   see docs/name-rules.md
"""


@handles_errors
@expand_options
def convert_ms_torch(
    src: Annotated[Path, typer.Argument(parser=location, help="A MindSpore or PyTorch checkpoint (.ckpt, .pt, safetensors, DCP).")],
    out: Annotated[Path, typer.Option("--output", "-o", parser=location, help="Output file or directory; a file's extension picks the container.")],
    to: Annotated[Optional[opt.FrameworkName], typer.Option("--to", help="The framework to convert to (default: the other side of the source).")] = None,
    to_format: Annotated[Optional[opt.FormatName], typer.Option("--to-format", help="Container (default: the source's kind, or -o's extension).")] = None,
    name_rules: Annotated[Optional[Path], typer.Option("--name-rules", help="TOML rules (docs/name-rules.md); the preset applies after them.")] = None,
    no_preset: Annotated[bool, typer.Option("--no-preset", help="Keep names as they are (only --name-rules rename).")] = False,
    dtype: opt.DType = None,
    select: RenamedSelect = RenamedSelect(),
    crc: Annotated[bool, typer.Option("--crc", help="A .ckpt output ends with MindSpore's CRC trailer.")] = False,
    write: Write = Write(),
    skip_unsupported: opt.SkipUnsupported = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the source -> destination name table; write nothing.")] = False,
) -> None:
    """Convert between MindSpore and PyTorch: names, dtype strings and container."""
    from hpckpt import api
    from hpckpt.cli import _targets
    from hpckpt.cli._progress import TerminalProgress
    from hpckpt.cli.convert import name_rules as rules_from, run

    if to_format is not None:
        _targets.output_format(to_format, out, "--to-format")  # refuses one the extension contradicts
    from hpckpt.core.commit.lock import reading

    with TerminalProgress("convert-ms-torch") as progress, reading(src):  # before its metadata is read
        index = _targets.open_source(src, progress)  # once: the plan and the conversion share it
        target = api.ms_torch_target(src, out, to=to, to_format=to_format, index=index)
        direction = "ms-to-torch" if target["to"] == "torch" else "torch-to-ms"
        rules = rules_from(name_rules, "none" if no_preset else None, direction)
        run(src, out, target["format"], layout=None, framework=target["to"], dtype=dtype, select=select,
            rules=rules, max_shard_size="5GB", crc=crc, write=write, dry_run=dry_run, command="convert-ms-torch",
            index=index, skip_unsupported=skip_unsupported, progress=progress)
