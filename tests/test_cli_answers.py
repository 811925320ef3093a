"""The CLI's answers (issue 10): choices, the format an output's extension names, the output
options before or after the command, one JSON envelope (errors too), progress on a terminal in
binary units, and placements checked against the tensors they apply to."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest
from _util import REPO
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.core.geometry.layout import LayoutSpec, Mesh, Shard
from hpckpt.core.errors import PlacementFitError

TINY = REPO / "examples" / "tiny-hp"
ENVELOPE = ["schema", "hpckpt_version", "command", "ok", "written", "skipped", "warnings"]


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def help_of(command: str) -> str:
    """A command's --help, wide enough that no choice list is wrapped."""
    return " ".join(CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400"}).stdout.split())


def document(result) -> dict:
    return json.loads(result.stdout)


# --------------------------------------------------------------------------------------------
# choices


CHOICES = [  # (command, option, some valid values)
    ("consolidate", "--format", ["hyperparallel", "hp", "torch-dcp", "hf", "ms", "ckpt", "pt", "safetensors"]),
    ("convert", "--to", ["hf-sharded", "mindspore-ckpt", "torch-save"]),
    ("convert-ms-torch", "--to-format", ["hp", "torch-dcp", "pt"]),
    ("convert-ms-torch", "--to", ["torch", "mindspore"]),
    ("reshard", "--split", ["balanced", "ceil"]),
    ("reshard", "--framework", ["torch", "mindspore"]),
    ("convert", "--framework", ["torch", "mindspore"]),
    ("reshard", "--dtype", ["bf16", "fp16", "fp32", "fp64"]),
]


@pytest.mark.parametrize("command, option, values", CHOICES)
def test_fixed_values_are_listed_offered_and_checked(tmp_path, command, option, values):
    help_text = help_of(command)
    for value in values:
        assert value in help_text, (command, option, value)
    for name in ("hpckpt.bash", "_hpckpt", "hpckpt.fish"):
        script = (REPO / "completions" / name).read_text()
        assert all(value in script for value in values), (name, option)
    result = cli(command, TINY, "-o", tmp_path / "out", option, "nosuch")
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("error: ") and "'nosuch' is not one of" in lines[0], result.stderr
    assert all(f"'{value}'" in lines[0] for value in values), lines[0]
    assert not (tmp_path / "out").exists()


def test_bash_completion_offers_the_values_of_each_choice():
    script = (REPO / "completions" / "hpckpt.bash").read_text()
    for command, option, values in CHOICES:
        arm = next(line for line in script.splitlines() if f"'hpckpt {command} {option}'" in line)
        assert "_kind=choice" in arm and all(v in arm for v in values), arm
    arm = next(line for line in script.splitlines() if "'hpckpt completion'" in line and "words" in line)
    assert arm  # the shell argument is a positional choice; its help lists the shells
    assert "bash" in cli("completion", "--help").stdout and cli("completion", "tcsh").exit_code == 2


def test_format_choices_are_the_registry_names_and_aliases():
    from hpckpt.cli._options import WRITABLE_FORMATS
    from hpckpt.converters import writable

    assert set(WRITABLE_FORMATS) == {n for f in writable() for n in (f.name, *f.aliases)}
    assert "hf-torch-bin" not in WRITABLE_FORMATS  # read only: never a target


def test_the_shell_choice_is_every_shell_the_generator_renders():
    from typing import get_args

    from hpckpt.cli import completion
    from hpckpt.cli._options import ShellName

    assert get_args(ShellName) == completion.SHELLS


def test_the_output_options_are_listed_before_and_after_the_command():
    for command in (None, "inspect", "verify", "diff", "checksum", "reshard", "consolidate", "convert", "convert-ms-torch",
                    "env", "completion"):
        text = CliRunner().invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": "200"}).stdout
        assert all(o in text for o in ("--json", "--quiet", "--no-progress", "--debug")), command


@pytest.mark.parametrize("alias, name", [("hp", "hyperparallel"), ("ms", "mindspore-ckpt"), ("ckpt", "mindspore-ckpt"),
                                         ("pt", "torch-save"), ("hf", "hf-sharded"), ("torch-dcp", "torch-dcp")])
def test_aliases_are_accepted(tmp_path, alias, name):
    suffix = {"mindspore-ckpt": ".ckpt", "torch-save": ".pt"}.get(name, "")
    result = cli("consolidate", TINY, "-o", tmp_path / f"out{suffix}", "--format", alias, "--json")
    assert result.exit_code == 0, result.stderr
    assert document(result)["format"] == name


def test_deprecated_dcp_still_works_but_is_not_offered(tmp_path):
    result = cli("consolidate", TINY, "-o", tmp_path / "out", "--format", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    assert document(result)["format"] == "hyperparallel"
    assert "warning: dcp is deprecated" in result.stderr
    assert any("deprecated" in w for w in document(result)["warnings"])
    assert "|dcp|" not in help_of("consolidate") and "<dcp|" not in help_of("consolidate")


# --------------------------------------------------------------------------------------------
# the output's extension names the format


@pytest.mark.parametrize("name, fmt", [("m.pt", "torch-save"), ("m.pth", "torch-save"), ("m.bin", "torch-save"),
                                       ("m.ckpt", "mindspore-ckpt"), ("m.safetensors", "safetensors"),
                                       ("m", "safetensors")])
def test_consolidate_format_follows_the_extension(tmp_path, name, fmt):
    result = cli("consolidate", TINY, "-o", tmp_path / name, "--json")
    assert result.exit_code == 0, result.stderr
    assert document(result)["format"] == fmt
    assert api.inspect(tmp_path / name)["format"] == fmt


@pytest.mark.parametrize("command, option", [("consolidate", "--format"), ("convert", "--to")])
def test_a_format_the_extension_contradicts_is_refused(tmp_path, command, option):
    out = tmp_path / "model.safetensors"
    result = cli(command, TINY, "-o", out, option, "pt")
    assert result.exit_code == 2
    line = result.stderr.splitlines()[0]
    assert "'pt' writes torch-save" in line and ".safetensors" in line and "names safetensors" in line, line
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# --json, --debug, --quiet, --no-progress before or after the command


@pytest.mark.parametrize("args", [["--json", "inspect", TINY], ["inspect", TINY, "--json"],
                                  ["--json", "inspect", TINY, "--json"]])
def test_json_before_or_after_the_command(args):
    result = cli(*args)
    assert result.exit_code == 0, result.stderr
    assert document(result)["command"] == "inspect"


@pytest.mark.parametrize("flags", [["--quiet"], ["-q", "--no-progress"], ["--debug"], ["--json"]])
def test_completion_takes_the_output_options_after_the_shell_and_prints_the_same_script(flags):
    plain = cli("completion", "bash")
    flagged = cli("completion", "bash", *flags)
    assert plain.exit_code == flagged.exit_code == 0, flagged.stderr
    assert flagged.stdout == plain.stdout and plain.stdout.startswith("# Generated by `hpckpt completion bash`")


def test_the_state_of_one_run_does_not_leak_into_the_next():
    assert cli("inspect", TINY, "--json").exit_code == 0
    result = cli("inspect", TINY)
    assert result.stdout.startswith("Checkpoint"), result.stdout


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_before_or_after_the_command_shows_the_traceback(tmp_path, where):
    missing = tmp_path / "missing"
    args = ["--debug", "inspect", missing] if where == "before" else ["inspect", missing, "--debug"]
    proc = subprocess.run([sys.executable, "-m", "hpckpt", *map(str, args)], capture_output=True, text=True)
    assert "Traceback" in proc.stderr and "PathNotFoundError" in proc.stderr, proc.stderr
    plain = subprocess.run([sys.executable, "-m", "hpckpt", "inspect", str(missing)], capture_output=True, text=True)
    assert "Traceback" not in plain.stderr and plain.returncode == 3


@pytest.mark.parametrize("args", [["-q"], ["--quiet"], ["--no-progress"]])
def test_quiet_and_no_progress_before_or_after(tmp_path, args):
    for n, order in enumerate(("before", "after")):
        out = tmp_path / f"out{n}.safetensors"
        argv = [*args, "consolidate", TINY, "-o", out] if order == "before" else ["consolidate", TINY, "-o", out, *args]
        result = cli(*argv)
        assert result.exit_code == 0, result.stderr
        quiet = args != ["--no-progress"]
        assert (result.stdout == "") == quiet, (argv, result.stdout)
        assert out.is_file()


def test_quiet_keeps_the_warnings_about_lost_data(tmp_path):
    result = cli("-q", "reshard", TINY, "-o", tmp_path / "out", "--mesh", "2", "--placements", "S1")
    assert result.exit_code == 0 and result.stdout == ""
    assert "warning: layout: placement S1" in result.stderr


# --------------------------------------------------------------------------------------------
# one JSON envelope


def _writes(tmp_path):
    yield "reshard", ["reshard", TINY, "-o", tmp_path / "r", "--world-size", "3"]
    yield "consolidate", ["consolidate", TINY, "-o", tmp_path / "c.safetensors"]
    yield "convert", ["convert", TINY, "-o", tmp_path / "c.pt"]
    yield "convert-ms-torch", ["convert-ms-torch", TINY, "-o", tmp_path / "ms"]


def test_every_command_answers_with_the_envelope(tmp_path):
    runs = [("inspect", ["inspect", TINY]), ("verify", ["verify", TINY]), ("env", ["env"]),
            ("diff", ["diff", TINY, TINY]), *_writes(tmp_path)]
    for command, args in runs:
        result = cli(*args, "--json")
        assert result.exit_code == 0, (command, result.stderr)
        doc = document(result)
        assert list(doc)[:len(ENVELOPE)] == ENVELOPE, (command, list(doc))
        assert doc["schema"] == 3 and doc["command"] == command and doc["ok"] is True
        if command in ("inspect", "verify", "env", "diff"):
            assert doc["written"] == []
        else:
            assert doc["written"] and all(Path(p).is_file() for p in doc["written"]), (command, doc["written"])
    finalize_src = tmp_path / "fan"
    assert cli("reshard", TINY, "-o", finalize_src, "--world-size", "2", "--rank", "0-1").exit_code == 0
    doc = document(cli("reshard", "--finalize", finalize_src, "--json"))
    assert list(doc)[:len(ENVELOPE)] == ENVELOPE and doc["finalized"] is True


@pytest.mark.parametrize("where", ["missing", "missing/and/its/parents"])
def test_finalize_of_a_missing_directory_says_so_and_leaves_nothing(tmp_path, where):
    result = cli("reshard", "--finalize", tmp_path / where)
    assert result.exit_code == 3, result.stderr
    assert result.stderr.splitlines()[0] == f"error: {tmp_path / where}: no such directory (the fanned-out output to finalize)"
    assert list(tmp_path.iterdir()) == []  # no lock file beside it


def test_written_lists_every_file_of_the_output(tmp_path):
    out = tmp_path / "r"
    doc = document(cli("reshard", TINY, "-o", out, "--world-size", "3", "--json"))
    assert sorted(doc["written"]) == sorted(str(p) for p in out.iterdir())
    assert doc["gib_per_s"] is None or doc["gib_per_s"] >= 0 and "gb_per_s" not in doc


def test_an_error_in_json_mode_is_one_document_and_one_error_line(tmp_path):
    result = cli("--json", "inspect", tmp_path / "missing")
    assert result.exit_code == 3
    doc = document(result)
    assert list(doc)[:len(ENVELOPE)] == ENVELOPE and doc["ok"] is False and doc["command"] == "inspect"
    assert doc["error"] == {"kind": "path-not-found", "exit_code": 3,
                            "message": f"{tmp_path / 'missing'}: no such file or directory", "hint": None}
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {tmp_path / 'missing'}: no such file or directory"]


@pytest.mark.parametrize("args", [["consolidate", TINY, "-o", "x", "--format", "onnx", "--json"],
                                  ["--json", "consolidate", TINY, "-o", "x", "--format", "onnx"],
                                  ["reshard", TINY, "-o", "x", "--json"],  # no target: raised by the command
                                  ["inspect", "--json"],  # a missing argument
                                  ["inspect", "--json", "--bogus", TINY],  # the option that fails after --json
                                  ["inspect", "--bogus", TINY, "--json"],
                                  ["run", "save", "--bogus", "--json"],
                                  ["reshard", TINY, "-o", "x", "--mesh", "2x2", "--placements", "R", "--json"]])
def test_a_usage_error_in_json_mode_is_one_document(tmp_path, args):
    result = cli(*args)
    assert result.exit_code == 2, result.stderr
    doc = document(result)
    assert doc["ok"] is False and doc["error"]["kind"] == "usage" and doc["error"]["exit_code"] == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and doc["error"]["message"] in errors[0], result.stderr
    assert "╭" not in result.stderr  # one line, like every other error, not a box


def test_a_usage_error_without_json_prints_nothing_on_stdout(tmp_path):
    result = cli("consolidate", TINY, "-o", tmp_path / "x", "--format", "onnx")
    assert result.exit_code == 2 and result.stdout == ""


# --------------------------------------------------------------------------------------------
# progress on a terminal, binary units


def _on_a_terminal(*args) -> tuple[int, str, str]:
    """Run hpckpt with stderr on a pseudo-terminal; return the exit code, stdout and what the
    terminal showed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "hpckpt", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=slave, env={**os.environ, "COLUMNS": "160", "TERM": "xterm"})
    os.close(slave)
    shown = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    stdout = proc.communicate()[0].decode()
    proc.wait()
    os.close(master)
    return proc.returncode, stdout, shown.decode(errors="replace")


def test_progress_covers_metadata_and_planning_and_stays_on_with_json(tmp_path):
    code, stdout, shown = _on_a_terminal("reshard", TINY, "-o", tmp_path / "out", "--world-size", "3", "--json")
    assert code == 0 and json.loads(stdout)["ok"] is True
    assert "reading metadata of" in shown and "planning" in shown and "reshard" in shown, shown
    assert "KiB" in shown or " B" in shown
    assert " kB" not in shown and "MB/s" not in shown and "kB/s" not in shown, shown


@pytest.mark.parametrize("flag", ["--no-progress", "--quiet"])
def test_no_progress_on_a_terminal_when_asked(tmp_path, flag):
    code, _, shown = _on_a_terminal("reshard", TINY, "-o", tmp_path / "out", "--world-size", "3", flag)
    assert code == 0 and "reading metadata" not in shown, shown


def test_inspect_and_verify_show_a_spinner_while_reading():
    assert "reading metadata of" in _on_a_terminal("inspect", TINY, "--json")[2]
    assert "checking" in _on_a_terminal("verify", TINY)[2]


def test_text_outputs_use_binary_units(tmp_path):
    lines = [cli("reshard", TINY, "-o", tmp_path / "a", "--world-size", "2").stdout,
             cli("reshard", TINY, "-o", tmp_path / "b", "--world-size", "2", "--plan").stdout,
             cli("consolidate", TINY, "-o", tmp_path / "c.pt").stdout,
             cli("convert", TINY, "-o", tmp_path / "d.ckpt").stdout,
             cli("inspect", TINY).stdout]
    text = "\n".join(lines)
    assert "KiB/s" in text and "KiB" in text  # tiny outputs: a rate in KiB/s, never "0.00 GiB/s"
    assert "0.00 GiB/s" not in text and "GB/s" not in text and " kB" not in text and " MB" not in text, text


# --------------------------------------------------------------------------------------------
# placements checked against the tensors they apply to


def test_a_placement_that_fits_no_tensor_is_a_usage_error(tmp_path):
    out = tmp_path / "out"
    result = cli("reshard", TINY, "-o", out, "--mesh", "2", "--placements", "S9")
    assert result.exit_code == 2, result.stderr
    assert "placement S9" in result.stderr and "fits none" in result.stderr and not out.exists()
    result = cli("convert", TINY, "-o", out, "--to", "torch-dcp", "--mesh", "2", "--placements", "S9", "--json")
    assert result.exit_code == 2 and document(result)["error"]["kind"] == "usage" and not out.exists()


def test_tensors_a_placement_does_not_fit_are_one_warning(tmp_path):
    result = cli("reshard", TINY, "-o", tmp_path / "out", "--mesh", "2", "--placements", "S1", "--json")
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "placement S1" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: layout: ") and "model.norm.weight" in lines[0], lines
    assert "optimizer.state.0.step" not in lines[0]  # 0-d tensors are always replicated, as documented
    warnings = document(result)["warnings"]
    assert len(warnings) == 1 and "model.norm.weight" in warnings[0]


def test_the_library_checks_placements_too(tmp_path):
    with pytest.raises(PlacementFitError) as info:
        api.reshard(TINY, tmp_path / "out", LayoutSpec(Mesh((2,)), (Shard(9),)))
    assert isinstance(info.value, ValueError) and info.value.exit_code == 2 and not (tmp_path / "out").exists()
    report = api.reshard(TINY, tmp_path / "out", LayoutSpec(Mesh((2,)), (Shard(1),)))
    assert any(w.startswith("layout: placement S1") for w in report["warnings"])
    fsdp = api.reshard(TINY, tmp_path / "fsdp", LayoutSpec.for_world_size(2))
    assert fsdp["warnings"] == []  # S0 fits every tensor with a dim


def test_a_rule_that_fits_none_of_its_tensors_is_refused(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('mesh = "2"\ndefault = "S0"\n[[rule]]\nmatch = "*norm*"\nplacements = "S1"\n')
    result = cli("reshard", TINY, "-o", tmp_path / "out", "--layout-rules", rules)
    assert result.exit_code == 2 and "rule 1" in result.stderr, result.stderr


# --------------------------------------------------------------------------------------------
# --parents on every writing command


@pytest.mark.parametrize("command, name", [("reshard", "r"), ("consolidate", "c.safetensors"), ("convert", "c.pt"),
                                           ("convert-ms-torch", "m.ckpt")])
def test_parents_is_an_option_of_every_writing_command(tmp_path, command, name):
    assert "--parents" in cli(command, "--help").stdout
    out = tmp_path / "a" / "b" / name
    extra = ["--world-size", "2"] if command == "reshard" else []
    result = cli(command, TINY, "-o", out, "--parents", *extra)
    assert result.exit_code == 0, result.stderr
    assert out.exists()


@pytest.mark.parametrize("command, name", [("reshard", "r"), ("consolidate", "c.safetensors")])
def test_a_failed_run_takes_back_the_parents_it_made(tmp_path, command, name):
    """A run that fails after `--parents` made the destination's directories leaves none of
    them (its hint says nothing was left behind); a directory that was there stays."""
    import shutil

    source = tmp_path / "src"
    shutil.copytree(TINY, source)
    data = source / "_rank1_.safetensors"
    data.write_bytes(data.read_bytes()[:-8])  # a data file cut short: found after the parents are made
    (tmp_path / "there").mkdir()
    out = tmp_path / "there" / "a" / "b" / name
    extra = ["--world-size", "2"] if command == "reshard" else []
    result = cli(command, source, "-o", out, "--parents", "--no-manifest", *extra)
    assert result.exit_code != 0 and "Traceback" not in result.stderr, result.stderr
    assert os.listdir(tmp_path / "there") == [], os.listdir(tmp_path / "there")


def test_a_dry_run_checks_the_layout_as_the_real_run_does(tmp_path):
    unfit = cli("convert", TINY, "-o", tmp_path / "x", "--to", "hp", "--mesh", "2", "--placements", "S9", "--dry-run")
    assert unfit.exit_code == 2 and "fits none" in unfit.stderr and not (tmp_path / "x").exists()
    partly = cli("convert", TINY, "-o", tmp_path / "x", "--to", "hp", "--mesh", "2", "--placements", "S1", "--dry-run")
    assert partly.exit_code == 0 and "does not fit 1 of" in partly.stderr and not (tmp_path / "x").exists()


@pytest.mark.parametrize("setting", [("HPCKPT_PICKLE_BUDGET", "bogus=1"), ("HPCKPT_MAX_METADATA_BYTES", "²"),
                                     ("HPCKPT_MAX_METADATA_BYTES", "99999999999999999999999"),
                                     ("HPCKPT_MAX_METADATA_BYTES", "abc")])
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_wrong_setting_in_the_environment_is_a_usage_error_of_every_command(setting, command):
    result = CliRunner().invoke(app, [command, str(TINY)], env=dict([setting]))
    assert result.exit_code == 2, (setting, result.stdout, result.stderr)
    assert result.stderr.count("error:") == 1 and setting[0] in result.stderr and "internal" not in result.stderr


@pytest.mark.parametrize("argv", [["--json", "frobnicate"], ["--json"], ["--quiet", "--json", "nope", "x"],
                                  ["--json", "--bogus", "inspect", "x"]])
def test_an_unknown_or_missing_command_is_one_error_line_and_in_json_a_document(argv):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "hpckpt", *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1 and "╭" not in proc.stderr, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["error"]["kind"] == "usage" and list(doc)[:7] == ENVELOPE
