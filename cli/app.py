"""The root `hpckpt` app: global options, command registration and `main()`.

Commands live one per module and import their heavy dependencies (numpy, the adapters) inside
the function body, so `hpckpt --help` and shell completion stay fast.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Optional

import typer

from hpckpt import __version__
from hpckpt.cli import consolidate as consolidate_cmd
from hpckpt.cli import convert as convert_cmd
from hpckpt.cli import convert_ms_torch as convert_ms_torch_cmd
from hpckpt.cli import env as env_cmd
from hpckpt.cli import inspect as inspect_cmd
from hpckpt.cli import reshard as reshard_cmd
from hpckpt.cli import verify as verify_cmd
from hpckpt.cli._errors import set_debug

app = typer.Typer(
    name="hpckpt",
    help="Inspect, verify, reshard, convert and consolidate distributed training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hpckpt {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback when a command fails."),
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """hpckpt: one engine for HyperParallel DCP, PyTorch DCP, MindSpore and safetensors checkpoints."""
    set_debug(debug)


app.command("inspect", epilog=inspect_cmd.EXAMPLES)(inspect_cmd.inspect)
app.command("verify")(verify_cmd.verify)
app.command("reshard", epilog=reshard_cmd.EXAMPLES)(reshard_cmd.reshard)
app.command("consolidate", epilog=consolidate_cmd.EXAMPLES)(consolidate_cmd.consolidate)
app.command("convert", epilog=convert_cmd.EXAMPLES)(convert_cmd.convert)
app.command("convert-ms-torch", epilog=convert_ms_torch_cmd.EXAMPLES)(convert_ms_torch_cmd.convert_ms_torch)
app.command("env")(env_cmd.env)


@app.command("completion")
def completion(shell: str = typer.Argument(..., help="bash, zsh or fish.")) -> None:
    """Print the shell completion script (the files in completions/ are this output)."""
    from hpckpt.cli import completion as render

    if shell not in render.SHELLS:
        raise typer.BadParameter(f"choose one of {', '.join(render.SHELLS)}", param_hint="SHELL")
    typer.echo(render.render(shell, typer.main.get_command(app)), nl=False)


def run() -> int:
    """Run the command line in this process and return its exit code (benchmarks use this)."""
    # A short-lived process that may build millions of small objects (one per stored chunk) and
    # no reference cycles worth collecting: the cyclic collector only rescans them (measured:
    # 3 s of 5 when listing 640,000 chunks). Memory is still freed by reference counting.
    gc.disable()
    try:
        app(prog_name="hpckpt")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    return 0


def main() -> None:
    """The `hpckpt` console script: run, then leave without tearing the interpreter down.

    Every output file is closed, synced and renamed by the time a command returns; freeing a
    large index object by object and unloading modules would only add 0.07-0.14 s to every
    command (measured on the 1.5 GiB benchmark), as much as a tenth of a whole reshard.
    """
    code = run()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # the reader went away (`| head`), or the stream was closed for that reason
    os._exit(code)
