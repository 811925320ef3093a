"""The root `hpckpt` app: global options, command registration and `main()`.

Commands live one per module and import their heavy dependencies (numpy, the adapters) inside
the function body, so `hpckpt --help` and shell completion stay fast.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Optional

from hpckpt.cli import _signals

_signals.install_early()  # before the imports below: a signal during them exits cleanly too

import typer  # noqa: E402

from hpckpt import __version__
from hpckpt.cli import checksum as checksum_cmd
from hpckpt.cli import consolidate as consolidate_cmd
from hpckpt.cli import convert as convert_cmd
from hpckpt.cli import convert_ms_torch as convert_ms_torch_cmd
from hpckpt.cli import env as env_cmd
from hpckpt.cli import inspect as inspect_cmd
from hpckpt.cli import reshard as reshard_cmd
from hpckpt.cli import run as run_cmd
from hpckpt.cli import diff as diff_cmd
from hpckpt.cli import verify as verify_cmd
from hpckpt.cli import _output
from hpckpt.cli._errors import UsageErrors, handles_errors
from hpckpt.cli._option_groups import expand_options
from hpckpt.cli._options import ShellName, fold_deprecated


class _RootGroup(typer.core.TyperGroup):
    """The root group, keeping the command line it parsed (`_json_after` reads it)."""

    def parse_args(self, ctx, args):
        ctx.meta["hpckpt.args"] = list(args)
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=_RootGroup,
    name="hpckpt",
    help="Inspect, verify, reshard, convert and consolidate distributed training checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # fold_deprecated: `--format dcp` still means hyperparallel, but is no longer offered
    context_settings={"help_option_names": ["-h", "--help"], "token_normalize_func": fold_deprecated},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hpckpt {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback when a command fails."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document (also after the command)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no informational lines; "
                               "warnings about lost data are still printed."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress display on stderr."),
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """hpckpt: one engine for HyperParallel DCP, PyTorch DCP, MindSpore and safetensors checkpoints."""
    # `--json` anywhere on the line asks for JSON, also when the command's own options fail to parse
    json_output = json_output or _json_after(ctx)
    _output.reset(ctx.invoked_subcommand, json=json_output, quiet=quiet, no_progress=no_progress, debug=debug)
    ctx.with_resource(UsageErrors())


app.command("inspect", epilog=inspect_cmd.EXAMPLES)(inspect_cmd.inspect)
app.command("verify")(verify_cmd.verify)
app.command("diff", epilog=diff_cmd.EXAMPLES)(diff_cmd.diff)
app.command("checksum", epilog=checksum_cmd.EXAMPLES)(checksum_cmd.checksum)
app.command("reshard", epilog=reshard_cmd.EXAMPLES)(reshard_cmd.reshard)
app.command("consolidate", epilog=consolidate_cmd.EXAMPLES)(consolidate_cmd.consolidate)
app.command("convert", epilog=convert_cmd.EXAMPLES)(convert_cmd.convert)
app.command("convert-ms-torch", epilog=convert_ms_torch_cmd.EXAMPLES)(convert_ms_torch_cmd.convert_ms_torch)
app.command("env")(env_cmd.env)
app.add_typer(run_cmd.app, name="run")


@app.command("completion")
@handles_errors
@expand_options
def completion(shell: ShellName = typer.Argument(..., help="The shell to complete in.")) -> None:
    """Print the shell completion script (the files in completions/ are this output)."""
    from hpckpt.cli import completion as render

    typer.echo(render.render(shell, typer.main.get_command(app)), nl=False)


_ROOT_FLAGS = {"--debug", "--json", "--quiet", "-q", "--no-progress"}


def _json_after(ctx: typer.Context) -> bool:
    """`--json` among the arguments after the command name (not after a `--`)."""
    line = ctx.meta.get("hpckpt.args", [])
    return "--json" in (line[:line.index("--")] if "--" in line else line)


def _command_problem(argv: list[str]) -> str | None:
    """What is wrong with the command named on the line (none given, or no such command), or
    None. click reports these before any hpckpt code runs (so `--json` could not answer them):
    they are found here first and said like every other usage error."""
    names = [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]
    for arg in argv:
        if arg in ("-h", "--help", "--version"):
            return None
        if arg.startswith("-") and arg not in _ROOT_FLAGS:  # (the options before the command are flags)
            return f"no such option {arg!r} before the command (there: {', '.join(sorted(_ROOT_FLAGS))})"
        if not arg.startswith("-"):
            return None if arg in names else f"no such command {arg!r} (commands: {', '.join(names)})"
    return f"missing command (commands: {', '.join(names)})" if argv else None


def run() -> int:
    """Run the command line in this process and return its exit code (benchmarks use this)."""
    # A short-lived process that may build millions of small objects (one per stored chunk) and
    # no reference cycles worth collecting: the cyclic collector only rescans them (most of the
    # time of a large listing: docs/design-figures.md). Memory is still freed by reference counting.
    gc.disable()
    from hpckpt.cli._errors import print_error
    from hpckpt.core.errors import InterruptedRunError

    from hpckpt.core import process

    process.single_job = True  # e.g. a large pickle's load may be given an address-space bound
    from hpckpt.core.commit import manifest

    manifest.COMMAND = ["hpckpt", *sys.argv[1:]]  # what every manifest written by this run records
    problem = _command_problem(sys.argv[1:])
    if problem is not None:
        _output.reset(None, json="--json" in sys.argv[1:])
        print_error(problem, "hpckpt --help lists the commands", kind="usage", exit_code=2)
        return 2
    try:
        with _signals.raising():  # Ctrl-C, SIGTERM, SIGHUP: InterruptedRunError, staging removed
            app(prog_name="hpckpt")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    except InterruptedRunError as exc:  # outside a command's own handling (parsing the options)
        print_error(exc.message, kind=exc.kind, exit_code=exc.exit_code)
        return exc.exit_code
    return 0


def main() -> None:
    """The `hpckpt` console script: run, then exit as any interpreter exits (threads joined, exit
    handlers run, objects freed). Every output file is closed, synced and renamed by the time a
    command returns. A reader that went away (`| head`) gets nothing more, and no complaint about
    it at exit: the stream is pointed at /dev/null, as Python's documentation advises."""
    code = run()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (OSError, ValueError):
                pass  # (a closed stream has no descriptor left to point anywhere)
    sys.exit(code)
