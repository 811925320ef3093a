"""`hpckpt checksum CKPT`: add a manifest to a checkpoint hpckpt did not write."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import expand_options

EXAMPLES = """Examples:

  hpckpt checksum ckpt/                  then `hpckpt verify --deep ckpt/` proves every byte
  hpckpt checksum model.safetensors      writes model.safetensors.hpckpt-manifest.jsonl
  hpckpt checksum ckpt/ --force          replace the manifest (after verify --deep without it)
"""


@handles_errors
@expand_options
def checksum(
    path: Path = typer.Argument(..., parser=location, help="Checkpoint directory or file (any format hpckpt reads)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing manifest."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="Threads reading (default: cores, at most 8)."),
) -> None:
    """Hash every data file and write the checkpoint's manifest (refused when verify finds errors).

    Exits 14 when a manifest exists (without --force), else as verify would for the checkpoint's
    first error; 0 when written.
    """
    from hpckpt.api.checksum import checksum as write_manifest
    from hpckpt.cli import _output
    from hpckpt.cli._progress import TerminalProgress

    with TerminalProgress("checksum") as progress:
        progress.phase(f"checking {path}")
        report = write_manifest(path, force=force, jobs=jobs, progress=progress).to_json()
    if _output.json_mode():
        _output.emit_json(report)
        return
    only = report["digest_only"]
    for item in only[:8]:
        _output.warn(f"{item['file']}: {item['name']}: covered by the file digest only ({item['reason']})")
    if len(only) > 8:
        _output.warn(f"{len(only) - 8} more chunks are covered by their file digest only (--json lists them)")
    seconds = report["seconds"]
    speed = f", {_output.human_bytes(int(report['bytes_read'] / seconds))}/s" if seconds > 0 else ""
    _output.result_line(f"{report['manifest']}: {report['files']} data files, {report['boxes']} boxes, "
                        f"{_output.human_bytes(report['bytes_read'])} hashed in {seconds:.2f} s{speed}")
