"""`cli._option_groups.expand_options`: a command declares a group once and typer sees its options.

The `--help` output of every command is pinned elsewhere (test_cli_answers, the completions); here
the mechanism itself: order, nesting, defaults, the object the command receives, name clashes.
"""

from __future__ import annotations

import inspect

import pytest
import typer
from typer.testing import CliRunner

from hpckpt.cli._option_groups import Output, ParallelWrite, Select, Write, expand_options
from hpckpt.cli._options import Jobs


def test_groups_expand_in_place_nested_ones_too_and_output_options_come_last():
    def command(src: str, select: Select = Select(), write: ParallelWrite = ParallelWrite(), dry: bool = False):
        return src, select, write, dry

    names = list(inspect.signature(expand_options(command)).parameters)
    assert names == ["src", "include", "exclude", "jobs", "max_memory", "no_fsync", "force", "parents", "no_manifest", "dry",
                     *Output._fields]
    defaults = {p.name: p.default for p in inspect.signature(expand_options(command)).parameters.values()}
    assert defaults["max_memory"] == "64MiB" and defaults["jobs"] is None and defaults["force"] is False


def test_the_command_receives_each_group_as_one_object_from_the_command_line():
    app = typer.Typer()
    seen = {}

    @app.command()
    @expand_options
    def command(select: Select = Select(), write: ParallelWrite = ParallelWrite()):
        seen.update(select=select, write=write)

    result = CliRunner().invoke(app, ["--include", "a.*", "--jobs", "3", "--no-fsync", "--max-memory", "8MiB"])
    assert result.exit_code == 0, result.output
    assert seen["select"] == Select(include=["a.*"], exclude=None)
    assert seen["write"] == ParallelWrite(jobs=3, write=Write(max_memory="8MiB", no_fsync=True))
    settings = seen["write"].settings()
    assert (settings.jobs, settings.max_memory, settings.sync) == (3, 8 * 2**20, False)


def test_an_option_named_twice_is_refused_when_the_command_is_declared():
    def command(jobs: Jobs = None, write: ParallelWrite = ParallelWrite()):
        return jobs

    with pytest.raises(TypeError, match=r"options named twice: \['jobs'\]"):
        expand_options(command)
