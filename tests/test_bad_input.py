"""Bad input never crashes: one `error:` line (and maybe one `hint:`), the documented exit code.

Every case is a real damaged checkpoint on disk: a copy of a real HyperParallel fixture
(`tests/fixtures/hyperparallel`, copied before corrupting) or a small checkpoint written
here by the independent writer in `hp_reference` (stand-in classes with HyperParallel's module
paths, pickled by the stock pickler, data files by the `safetensors` library), so that these
tests do not depend on hpckpt's own writer. Most cases run through typer's CliRunner
(in-process, same code path as the console script); a representative set runs the real
`python -m hpckpt` in subprocesses, which is where "no traceback unless --debug" is visible.
"""

from __future__ import annotations

import json
import os
import pickle
import shlex
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hp_reference import Metadata, copy_fixture, dump_hp, hp_modules, write_hp
from typer.testing import CliRunner

from hpckpt.cli.app import app
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    EntryMismatchError,
    GeometryError,
    HpckptError,
    MissingFileError,
    NotACheckpointError,
    PathNotFoundError,
    UnknownFormatError,
    UnsafePathError,
    UnsafePickleError,
)

# --------------------------------------------------------------------------------------------
# Small checkpoints and payloads, written by the independent writer in `hp_reference`.


def small_checkpoint(root: Path, values: dict | None = None) -> Path:
    """A sound 2-rank checkpoint: w [4, 4] float32 split by rows, one value."""
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    write_hp(
        root,
        {"w": ("torch.float32", (4, 4), [("_rank0_.safetensors", "w", (0, 0), w[:2]),
                                          ("_rank1_.safetensors", "w", (2, 0), w[2:])])},
        values if values is not None else {"step": ("_rank0_.bytes", pickle.dumps(7, protocol=4))},
    )
    return root


class SystemCall:
    """Pickles as `os.system(command)` (`posix.system` on Linux): a real code-execution payload."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def touch_payload(marker: Path) -> SystemCall:
    return SystemCall(f"touch {shlex.quote(str(marker))}")


SYSTEM_GLOBAL = f"{os.system.__module__}.system"  # what the pickle names: 'posix.system'


def rewrite_header(path: Path, transform) -> None:
    """Apply `transform(header_bytes) -> header_bytes` (same length) to a safetensors file."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = transform(data[8 : 8 + n])
    assert len(header) == n
    path.write_bytes(data[:8] + header + data[8 + n :])


# --------------------------------------------------------------------------------------------
# The cases


@dataclass
class Case:
    path: Path
    error: type[HpckptError]
    needles: tuple[str, ...] = ()  # must appear in the error line (or the verify finding)
    data: bool = False  # a data problem: found by verify; inspect reads metadata only
    marker: Path | None = None  # must not exist afterwards (a payload would have created it)

    @property
    def code(self) -> int:
        return self.error.exit_code


def build_cases(tmp: Path) -> dict[str, Case]:
    cases: dict[str, Case] = {}

    missing = tmp / "no-such-checkpoint"
    cases["path-missing"] = Case(missing, PathNotFoundError, (str(missing),))

    empty = tmp / "empty-dir"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a checkpoint\n")
    cases["dir-not-checkpoint"] = Case(empty, NotACheckpointError, (str(empty), "not a checkpoint"))

    text = tmp / "random.txt"
    text.write_text("hello, this is just some text\n" * 20)
    cases["text-file"] = Case(text, NotACheckpointError, (str(text), "not a checkpoint"))

    no_meta = copy_fixture("m0-torch-4rank", tmp / "no-metadata")
    (no_meta / ".metadata").unlink()
    cases["data-without-metadata"] = Case(no_meta, NotACheckpointError, (str(no_meta), "no metadata"))

    foreign = tmp / "foreign-metadata"
    foreign.mkdir()
    # A pickle naming another library's classes (GLOBAL otherlib.checkpoint.Metadata; NEWOBJ).
    (foreign / ".metadata").write_bytes(b"\x80\x04cotherlib.checkpoint\nMetadata\n)\x81}(X\x01\x00\x00\x00aK\x01ub.")
    cases["unknown-format"] = Case(foreign, UnknownFormatError, (".metadata",))

    truncated = copy_fixture("m0-torch-4rank", tmp / "truncated-metadata")
    data = (truncated / ".metadata").read_bytes()
    (truncated / ".metadata").write_bytes(data[: len(data) // 2])
    cases["truncated-metadata"] = Case(truncated, CorruptMetadataError, (".metadata",))

    truncated_rank = copy_fixture("legacy-torch-4rank-rankLocal", tmp / "truncated-rank-metadata")
    data = (truncated_rank / ".rank1_metadata").read_bytes()
    (truncated_rank / ".rank1_metadata").write_bytes(data[: len(data) - 40])
    cases["truncated-rank-metadata"] = Case(truncated_rank, CorruptMetadataError, (".rank1_metadata",))

    emptied = copy_fixture("m0-mindspore-1rank", tmp / "empty-metadata")
    (emptied / ".metadata").write_bytes(b"")  # e.g. the disk filled up while rank 0 wrote it
    cases["empty-metadata"] = Case(emptied, CorruptMetadataError, (".metadata",))

    evil = small_checkpoint(tmp / "evil-metadata")
    marker = tmp / "MARKER-evil-metadata"
    metadata = Metadata({}, planner_data={"x": touch_payload(marker)}, storage_data={})
    (evil / ".metadata").write_bytes(dump_hp(metadata))
    cases["forbidden-global-metadata"] = Case(evil, UnsafePickleError, (SYSTEM_GLOBAL,), marker=marker)

    evil_value = tmp / "evil-value"
    value_marker = tmp / "MARKER-evil-value"
    small_checkpoint(evil_value, {"step": ("_rank0_.bytes", pickle.dumps(touch_payload(value_marker), protocol=4))})
    cases["forbidden-global-value"] = Case(evil_value, UnsafePickleError, (SYSTEM_GLOBAL, "step"), data=True,
                                           marker=value_marker)

    cut = copy_fixture("m0-torch-4rank", tmp / "truncated-safetensors")
    data = (cut / "_rank0_.safetensors").read_bytes()
    (cut / "_rank0_.safetensors").write_bytes(data[:-7])
    cases["truncated-safetensors"] = Case(cut, CorruptDataError, ("_rank0_.safetensors", "truncated"), data=True)

    big = copy_fixture("m0-torch-4rank", tmp / "header-too-long")
    data = (big / "_rank0_.safetensors").read_bytes()
    (big / "_rank0_.safetensors").write_bytes(struct.pack("<Q", len(data)) + data[8:])
    cases["header-longer-than-file"] = Case(big, CorruptDataError, ("_rank0_.safetensors", "larger than the file"),
                                            data=True)

    bad_json = copy_fixture("m0-torch-4rank", tmp / "header-bad-json")
    rewrite_header(bad_json / "_rank0_.safetensors", lambda h: b"{" + b"!" * (len(h) - 1))
    cases["header-invalid-json"] = Case(bad_json, CorruptDataError, ("_rank0_.safetensors", "JSON"), data=True)

    gone = copy_fixture("m0-torch-4rank", tmp / "missing-rank-file")
    (gone / "_rank2_.safetensors").unlink()
    cases["missing-rank-file"] = Case(gone, MissingFileError, ("_rank2_.safetensors",), data=True)

    renamed = copy_fixture("m0-torch-4rank", tmp / "missing-key")
    rewrite_header(renamed / "_rank0_.safetensors",
                   lambda h: h.replace(b'"model.embed_tokens.weight"', b'"model.embed_tokens.weighX"'))
    cases["missing-key"] = Case(renamed, EntryMismatchError, ("_rank0_.safetensors", "model.embed_tokens.weight"),
                                data=True)

    oob = tmp / "chunk-out-of-bounds"
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    write_hp(oob, {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), w[:2]),
        ("_rank1_.safetensors", "w", (3, 0), np.zeros((2, 4), np.float32)),  # rows 3:5 of a 4-row tensor
    ])})
    cases["chunk-out-of-bounds"] = Case(oob, GeometryError, ("w", "[3:5, 0:4]"), data=True)

    outside = tmp / "path-outside"
    write_hp(outside, {"w": ("torch.float32", (4, 4), [("../outside.safetensors", "w", (0, 0), w)])})
    assert (tmp / "outside.safetensors").is_file()  # the target exists: only the path is wrong
    cases["path-leaves-checkpoint"] = Case(outside, UnsafePathError, ("../outside.safetensors",), data=True)
    return cases


# Console-script runs (case, command, --debug?): a representative few; CliRunner covers every case.
SUBPROCESS_RUNS = [
    ("path-missing", "inspect", False), ("path-missing", "inspect", True),
    ("truncated-metadata", "inspect", False), ("truncated-metadata", "inspect", True),
    ("forbidden-global-metadata", "inspect", False), ("forbidden-global-metadata", "inspect", True),
    ("missing-key", "verify", False),
]
_running: dict[tuple[str, bool], subprocess.Popen] = {}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    built = build_cases(tmp_path_factory.mktemp("bad-input"))
    # Start the console-script runs now, so they overlap with the in-process tests below.
    env = {**os.environ, "COLUMNS": "200", "PYTHONDONTWRITEBYTECODE": "1"}
    for name, command, debug in SUBPROCESS_RUNS:
        argv = [sys.executable, "-m", "hpckpt", *(["--debug"] if debug else []), command, str(built[name].path)]
        _running[(name, debug)] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                   env=env)
    yield built
    for proc in _running.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_error_line(stderr: str, needles: tuple[str, ...] = ()) -> str:
    """stderr is `error: ...` plus at most one `hint: ...` line; return the error line."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert lines, "nothing on stderr"
    assert lines[0].startswith("error: "), stderr
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint: ")), stderr
    assert "internal error" not in lines[0], stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


METADATA_CASES = [
    "path-missing", "dir-not-checkpoint", "text-file", "data-without-metadata", "unknown-format",
    "truncated-metadata", "truncated-rank-metadata", "empty-metadata", "forbidden-global-metadata",
]
DATA_CASES = [
    "forbidden-global-value", "truncated-safetensors", "header-longer-than-file", "header-invalid-json",
    "missing-rank-file", "missing-key", "chunk-out-of-bounds", "path-leaves-checkpoint",
]


def test_case_lists_cover_every_case(cases):
    assert sorted(METADATA_CASES + DATA_CASES) == sorted(cases)


@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("name", METADATA_CASES)
def test_metadata_problem_is_one_line_and_its_exit_code(cases, name, command):
    case = cases[name]
    result = invoke(command, case.path)
    assert result.exit_code == case.code, (result.exit_code, result.stderr)
    assert_one_error_line(result.stderr, case.needles)
    assert result.stdout == ""
    if case.marker is not None:
        assert not case.marker.exists(), "the pickle's payload ran"


@pytest.mark.parametrize("name", METADATA_CASES)
def test_metadata_problem_with_debug_raises_the_documented_error(cases, name):
    """--debug lets the error escape (the interpreter prints its traceback; checked in a subprocess below)."""
    case = cases[name]
    result = invoke("--debug", "inspect", case.path)
    assert type(result.exception) is case.error, repr(result.exception)
    assert result.exit_code != 0
    if case.marker is not None:
        assert not case.marker.exists()


@pytest.mark.parametrize("name", DATA_CASES)
def test_data_problem_verify_exit_code_and_finding(cases, name):
    case = cases[name]
    result = invoke("verify", case.path)
    assert result.exit_code == case.code, (result.exit_code, result.stdout, result.stderr)
    assert_one_error_line(result.stderr, ("verify found", f"exit code {case.code}"))

    result = invoke("verify", "--json", case.path)
    assert result.exit_code == case.code
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout)
    assert (report["ok"], report["exit_code"]) == (False, case.code)
    findings = report["findings"]
    assert findings, report
    assert {f["kind"] for f in findings} == {case.error.kind}, findings
    assert all(f["severity"] == "error" for f in findings)
    for needle in case.needles:
        assert any(needle in f["message"] for f in findings), (needle, findings)
    if case.marker is not None:
        assert not case.marker.exists(), "the pickle's payload ran"


@pytest.mark.parametrize("name", DATA_CASES)
def test_inspect_reads_metadata_only_and_does_not_crash_on_bad_data(cases, name):
    case = cases[name]
    result = invoke("inspect", case.path)
    assert "Traceback" not in result.stderr
    assert result.exit_code in (0, case.code), (result.exit_code, result.stderr)
    if result.exit_code:
        assert_one_error_line(result.stderr)
    if case.marker is not None:
        assert not case.marker.exists()


@pytest.mark.parametrize("name", ["truncated-safetensors", "header-longer-than-file", "header-invalid-json",
                                  "missing-rank-file"])
def test_a_broken_data_file_is_reported_once(cases, name):
    """validate._check_files: each file is checked once, its entries are not re-reported."""
    report = json.loads(invoke("verify", "--json", cases[name].path).stdout)
    assert len(report["findings"]) == 1, report["findings"]


def test_out_of_bounds_chunk_finding_has_the_box(cases):
    report = json.loads(invoke("verify", "--json", cases["chunk-out-of-bounds"].path).stdout)
    outside = [f for f in report["findings"] if "outside" in f["message"]]
    assert len(outside) == 1, report["findings"]
    assert (outside[0]["fqn"], outside[0]["boxes"]) == ("w", ["[3:5, 0:4]"])


def test_forbidden_value_is_shown_as_an_error_by_inspect(cases):
    case = cases["forbidden-global-value"]
    result = invoke("inspect", "--json", case.path)
    assert result.exit_code == 0, result.stderr
    (value,) = json.loads(result.stdout)["values"]
    assert value["fqn"] == "step"
    assert value["type"] is None and "value" not in value
    assert SYSTEM_GLOBAL in value["error"]

    table = invoke("inspect", case.path)
    assert table.exit_code == 0
    assert "refusing to load global" in table.stdout
    assert not case.marker.exists()


def test_the_payloads_are_real(tmp_path):
    """Control: the same payload, loaded by the stock unpickler, does run (so the marker checks mean something)."""
    marker = tmp_path / "control-marker"
    metadata = Metadata({}, planner_data={"x": touch_payload(marker)}, storage_data={})
    with hp_modules():
        pickle.loads(dump_hp(metadata))
    assert marker.exists()
    marker.unlink()
    pickle.loads(pickle.dumps(touch_payload(marker), protocol=4))
    assert marker.exists()


# --------------------------------------------------------------------------------------------
# What users see: the real console entry point, in subprocesses started by the `cases` fixture.


@pytest.fixture(scope="module")
def subprocess_results(cases) -> dict[tuple[str, bool], subprocess.CompletedProcess]:
    results = {}
    for key, proc in _running.items():
        out, err = proc.communicate(timeout=120)
        results[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", [name for name, _, debug in SUBPROCESS_RUNS if not debug])
def test_console_script_error_line_and_exit_code(cases, subprocess_results, name):
    case = cases[name]
    result = subprocess_results[(name, False)]
    assert result.returncode == case.code, (result.returncode, result.stderr)
    if case.data:
        assert_one_error_line(result.stderr, ("verify found",))
    else:
        assert_one_error_line(result.stderr, case.needles)
    if case.marker is not None:
        assert not case.marker.exists(), "the pickle's payload ran"


@pytest.mark.parametrize("name", [name for name, _, debug in SUBPROCESS_RUNS if debug])
def test_console_script_debug_shows_the_traceback(cases, subprocess_results, name):
    case = cases[name]
    result = subprocess_results[(name, True)]
    assert "Traceback (most recent call last)" in result.stderr, result.stderr
    assert f"{case.error.__module__}.{case.error.__qualname__}" in result.stderr, result.stderr
    assert result.returncode != 0
    if case.marker is not None:
        assert not case.marker.exists(), "the pickle's payload ran"


def test_console_script_verify_lists_the_finding_on_stdout(subprocess_results):
    result = subprocess_results[("missing-key", False)]
    assert result.returncode == EntryMismatchError.exit_code
    assert "model.embed_tokens.weight" in result.stdout and "entry-mismatch" in result.stdout


# --------------------------------------------------------------------------------------------
# No command writes to its input.


def snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    if root.is_file():
        stat = root.stat()
        return {root.name: (root.read_bytes(), stat.st_mtime_ns, stat.st_mode)}
    out = {}
    for path in sorted(root.rglob("*")):
        stat = path.lstat()
        out[str(path.relative_to(root))] = (path.read_bytes() if path.is_file() else b"", stat.st_mtime_ns, stat.st_mode)
    return out


COMMANDS = (
    ("inspect",), ("inspect", "--json"), ("inspect", "--shards", "*"), ("verify",), ("verify", "--json"),
    ("verify", "--strict"),
)


def test_no_command_modifies_its_source(cases, tmp_path):
    sources = [c.path for c in cases.values() if c.path.exists()]
    sources += [copy_fixture(name, tmp_path / name) for name in ("m0-torch-4rank", "legacy-torch-4rank")]
    sources.append(cases["path-leaves-checkpoint"].path.parent / "outside.safetensors")
    before = {path: snapshot(path) for path in sources}
    parent_before = sorted(p.name for p in cases["path-missing"].path.parent.iterdir())
    for path in sources:
        for command in COMMANDS:
            result = invoke(*command, path)
            assert "Traceback" not in result.stderr
    for path in sources:
        assert snapshot(path) == before[path], f"{path} changed"
    assert sorted(p.name for p in cases["path-missing"].path.parent.iterdir()) == parent_before
    assert not cases["path-missing"].path.exists()
