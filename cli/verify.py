"""`hpckpt verify PATH`: structural checks, every finding reported, one exit code per class."""

from __future__ import annotations

from pathlib import Path

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors


@handles_errors
def verify(
    path: Path = typer.Argument(..., help="Checkpoint directory or file (format is detected)."),
    strict: bool = typer.Option(False, "--strict", help="Treat warnings (e.g. leftover plan files) as errors."),
    json_output: opt.Json = False,
    quiet: opt.Quiet = False,
    no_progress: opt.NoProgress = False,
    debug: opt.Debug = False,
) -> None:
    """Check files, safetensors headers, keys, dtypes, shapes, chunk coverage and values.

    Exits 0 when the checkpoint is sound, else with the lowest exit code among the problems found
    (the codes are listed in the README).
    """
    from hpckpt import api
    from hpckpt.cli import _output

    with _output.TerminalProgress("verify") as progress:
        progress.phase(f"checking {path}")
        report = api.verify(path, strict=strict).to_json()
    if _output.json_mode():
        _output.emit_json(report)
    else:
        render(report)
    raise typer.Exit(report["exit_code"])


def render(report: dict) -> None:
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
    for finding in report["findings"]:
        style = "red" if finding["severity"] == "error" else "yellow"
        console.print(f"[{style}]{finding['severity']}[/{style}] {escape('[' + finding['kind'] + ']')} {escape(printable(finding['message']))}",
                      soft_wrap=True)
    errors = sum(1 for f in report["findings"] if f["severity"] == "error")
    warnings = len(report["findings"]) - errors
    if report["ok"]:
        console.print("[green]OK[/green]" + (f" ({warnings} warning(s))" if warnings else ""))
    else:
        sys.stderr.write(f"error: verify found {errors} error(s) and {warnings} warning(s); exit code {report['exit_code']}\n")
