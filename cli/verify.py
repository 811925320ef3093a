"""`hpckpt verify PATH`: structural checks, every finding reported, one exit code per class."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import expand_options


@handles_errors
@expand_options
def verify(
    path: Path = typer.Argument(..., parser=location, help="Checkpoint directory or file (format is detected)."),
    strict: bool = typer.Option(False, "--strict", help="Treat warnings (e.g. leftover plan files) as errors."),
    deep: bool = typer.Option(False, "--deep", help="Read every byte: against the manifest's digests when there "
                              "is one, else every chunk through its format's reader."),
    nan: bool = typer.Option(False, "--nan", help="Count NaN and Inf per floating tensor (reads the data; a tensor "
                             "with any is a warning)."),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1,
                                       help="--deep/--nan: threads reading (default: cores, at most 8)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Every problem of a damaged file, not only its "
                                 "first (--json lists them always, as `details`)."),
) -> None:
    """Check files, safetensors headers, keys, dtypes, shapes, chunk coverage and values.

    One line per damaged file (what, where, expected vs found). Exits 0 when the checkpoint is
    sound, else with the lowest exit code among the problems found (docs/safety.md lists them).
    --deep: bytes that differ from the manifest's digests, or chunks that cannot be read, are
    corrupt data (9).
    """
    from hpckpt import api
    from hpckpt.cli import _output
    from hpckpt.cli._progress import TerminalProgress

    with TerminalProgress("verify") as progress:
        progress.phase(f"checking {path}")
        report = api.verify(path, strict=strict, deep=deep, nan=nan, jobs=jobs, progress=progress).to_json()
    if _output.json_mode():
        _output.emit_json(report)
    else:
        render(report, verbose)
    raise typer.Exit(report["exit_code"])


def render(report: dict, verbose: bool = False) -> None:
    import sys

    from rich.markup import escape

    from hpckpt.cli._output import printable, stdout_console

    console = stdout_console()
    checked = report["checked"]
    console.print(
        f"Checked {escape(printable(report['path']))} ({report['format']}): {checked['tensors']} tensors in "
        f"{checked['chunks']} chunks, {checked['values']} values, {checked['files']} data files",
        soft_wrap=True,
    )
    table = report.get("nonfinite")
    if report.get("deep") is not None:
        _render_deep(report["deep"], table)
    for finding in report["findings"]:
        if table is not None and finding["kind"] == "non-finite":
            continue  # in the table
        style = "red" if finding["severity"] == "error" else "yellow"
        console.print(f"[{style}]{finding['severity']}[/{style}] {escape('[' + finding['kind'] + ']')} {escape(printable(finding['message']))}",
                      soft_wrap=True)
        for detail in (finding.get("details") or ()) if verbose else ():
            console.print(f"  {escape(printable(detail))}", soft_wrap=True)
    errors = sum(1 for f in report["findings"] if f["severity"] == "error")
    warnings = len(report["findings"]) - errors
    if report["ok"]:
        console.print("[green]OK[/green]" + (f" ({warnings} warning(s))" if warnings else ""))
    else:
        sys.stderr.write(f"error: verify found {errors} error(s) and {warnings} warning(s); exit code {report['exit_code']}\n")


def _render_deep(deep: dict, table: list[dict] | None) -> None:
    from hpckpt.cli._output import human_bytes, stdout_console
    from hpckpt.cli._tables import write_table

    console = stdout_console()
    if deep["manifest_used"]:
        how = f"{deep['files_scanned']} data files against the manifest's digests ({deep['boxes_checked']} boxes)"
    else:
        how = f"{deep['chunks_read']} chunks through the format's reader" + (
            " (the manifest does not describe this checkpoint)" if deep["manifest"] else " (no manifest)")
    if deep["manifest_used"] and deep["chunks_read"]:
        how += f", {deep['chunks_read']} chunks for NaN/Inf"
    seconds = deep["seconds"]
    speed = f", {human_bytes(int(deep['bytes_read'] / seconds))}/s" if seconds > 0 else ""
    console.print(f"Read {human_bytes(deep['bytes_read'])} in {seconds:.2f} s{speed}: {how}", soft_wrap=True)
    if table is None:
        return
    bad = [t for t in table if t["nan"] or t["posinf"] or t["neginf"]]
    console.print(f"NaN/Inf: {len(bad)} of {len(table)} floating tensors hold some", soft_wrap=True)
    if bad:
        write_table("Tensors with NaN or Inf", [("name", "left"), ("dtype", "left"), ("elements", "right"),
                    ("NaN", "right"), ("+Inf", "right"), ("-Inf", "right")],
                    [(t["name"], t["dtype"], str(t["elements"]), str(t["nan"]), str(t["posinf"]), str(t["neginf"]))
                     for t in bad])
