"""`hpckpt verify`: every finding listed, boxes for gaps and overlaps, the lowest exit code wins.

Inputs are the real HyperParallel fixtures (copied to tmp_path before any change) and small
checkpoints written here by the independent writer in `hp_reference` (stand-in classes under
HyperParallel's module names, pickled by the stock pickler; data files by the `safetensors`
library), so a bug in hpckpt's own writer cannot hide a bug in verify. Runs go through typer's CliRunner; one
representative run uses the real console entry point in a subprocess.
"""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _util import FIXTURE_NAMES, FIXTURES
from hp_reference import copy_fixture, write_hp
from typer.testing import CliRunner

import hpckpt
from hpckpt.cli.app import app
from hpckpt.core.errors import EXIT_CODE_BY_KIND

# --------------------------------------------------------------------------------------------
# Checkpoints written here (by the independent writer in `hp_reference`) and edits to copies.


def edit_header(path: Path, edit) -> None:
    """Apply `edit(header_dict)` to a safetensors header, keeping its length (space padded)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    path.write_bytes(data[:8] + raw.ljust(n) + data[8 + n :])


COMPLETE_FLAG = b"\x00__PICKLE_WRITE_COMPLETE__\x00"  # format spec 2.2


def leftover(path: Path, obj: Any) -> None:
    """A LOCAL_PLAN_{r}.pkl / STORAGE_DATA_{r}.pkl as HyperParallel's async save writes it."""
    path.write_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) + COMPLETE_FLAG)


W = np.arange(16, dtype=np.float32).reshape(4, 4)


def two_chunks(root: Path, first: tuple, second: tuple) -> Path:
    """w [4, 4] float32 stored as two chunks, each given as (offsets, sizes)."""
    chunks = []
    for rank, (offsets, sizes) in enumerate((first, second)):
        box = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        chunks.append((f"_rank{rank}_.safetensors", "w", offsets, W[box]))
    return write_hp(root, {"w": ("torch.float32", (4, 4), chunks)})


# --------------------------------------------------------------------------------------------

runner = CliRunner()


def verify(path: Path, *options: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", "--json", *options, str(path)])
    assert "Traceback" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    assert report["exit_code"] == result.exit_code
    return result.exit_code, report


def check_schema(report: dict, path: Path) -> None:
    assert list(report) == ["schema", "hpckpt_version", "command", "ok", "written", "skipped", "warnings",
                            "path", "format", "exit_code", "checked", "findings"]
    assert report["schema"] == 3
    assert report["hpckpt_version"] == hpckpt.__version__
    assert report["path"] == str(path)
    assert isinstance(report["format"], str) and report["format"]
    assert isinstance(report["ok"], bool)
    assert isinstance(report["exit_code"], int)
    assert report["ok"] == (report["exit_code"] == 0)
    assert list(report["checked"]) == ["tensors", "chunks", "values", "files"]
    assert all(isinstance(v, int) and v >= 0 for v in report["checked"].values())
    for finding in report["findings"]:
        assert list(finding) == ["kind", "severity", "message", "fqn", "file", "boxes", "details"]
        assert finding["kind"] in EXIT_CODE_BY_KIND
        assert finding["severity"] in ("error", "warning")
        assert isinstance(finding["message"], str) and finding["message"]
        assert finding["fqn"] is None or isinstance(finding["fqn"], str)
        assert finding["file"] is None or isinstance(finding["file"], str)
        assert isinstance(finding["boxes"], list) and all(isinstance(b, str) for b in finding["boxes"])


def kinds(report: dict) -> list[str]:
    return sorted(f["kind"] for f in report["findings"])


def safetensors_keys(path: Path) -> list[str]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return [k for k in json.loads(data[8 : 8 + n]) if k != "__metadata__"]


# --------------------------------------------------------------------------------------------
# The real fixtures are sound


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_fixture_verifies_clean(name):
    fixture = FIXTURES / name
    code, report = verify(fixture)
    check_schema(report, fixture)
    # HyperParallel's storage-coordinated async save leaves its plan files behind: warnings only.
    left = [f"LOCAL_PLAN_{r}.pkl" for r in range(4)] if name.endswith("-async") else []
    assert (code, report["ok"]) == (0, True)
    assert [(f["kind"], f["severity"], f["file"]) for f in report["findings"]] == [
        ("interrupted-save", "warning", f) for f in left]
    assert report["format"] == ("hyperparallel-legacy" if name.startswith("legacy") else "hyperparallel")
    # The counts agree with the fixture's independently written ground truth.
    assert report["checked"]["tensors"] == len(safetensors_keys(fixture / "expected.safetensors"))
    assert report["checked"]["values"] == len(json.loads((fixture / "expected.json").read_text()))
    assert report["checked"]["chunks"] >= report["checked"]["tensors"]


def test_console_script_verify_on_a_fixture():
    fixture = FIXTURES / "m0-torch-4rank"
    result = subprocess.run([sys.executable, "-m", "hpckpt", "verify", "--json", str(fixture)],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (0, "")
    report = json.loads(result.stdout)
    check_schema(report, fixture)
    assert report["ok"] is True and report["checked"] == {"tensors": 15, "chunks": 42, "values": 9, "files": 7}


@pytest.mark.parametrize("name", ["legacy-torch-4rank-rankLocal", "m0-torch-4rank-rankLocal"])
def test_identical_replicas_in_rank_local_fixtures_are_accepted(name):
    # Precondition, read independently: some chunk box is listed by several ranks' metadata.
    from hpckpt.converters import open_index

    index = open_index(FIXTURES / name)
    replicated = [fqn for fqn, t in index.tensors.items() if len({c.box for c in t.chunks}) < len(t.chunks)]
    assert replicated
    code, report = verify(FIXTURES / name)
    assert (code, report["findings"]) == (0, [])


def test_identical_replicas_written_here_are_accepted(tmp_path):
    write_hp(tmp_path / "c", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:2]),
        ("_rank1_.safetensors", "w", (0, 0), W[:2]),  # same box as rank 0: a replica
        ("_rank2_.safetensors", "w", (2, 0), W[2:]),
        ("_rank3_.safetensors", "w", (2, 0), W[2:]),
    ])})
    code, report = verify(tmp_path / "c")
    assert (code, report["findings"]) == (0, [])
    assert report["checked"]["chunks"] == 4


# --------------------------------------------------------------------------------------------
# Gaps and overlaps, as boxes


@pytest.mark.parametrize(
    ("first", "second", "word", "boxes"),
    [
        (((0, 0), (2, 4)), ((3, 0), (1, 4)), "no chunk covers", ["[2:3, 0:4]"]),  # row 2 missing
        (((0, 0), (1, 4)), ((3, 0), (1, 4)), "no chunk covers", ["[1:3, 0:4]"]),  # rows 1-2 missing
        (((0, 0), (4, 2)), ((0, 3), (4, 1)), "no chunk covers", ["[0:4, 2:3]"]),  # column 2 missing
        (((0, 0), (3, 4)), ((2, 0), (2, 4)), "overlap", ["[2:3, 0:4]"]),  # row 2 twice
        (((0, 0), (4, 3)), ((0, 1), (4, 3)), "overlap", ["[0:4, 1:3]"]),  # columns 1-2 twice
    ],
)
def test_gaps_and_overlaps_are_reported_as_boxes(tmp_path, first, second, word, boxes):
    root = two_chunks(tmp_path / "c", first, second)
    code, report = verify(root)
    check_schema(report, root)
    assert code == 11 and report["ok"] is False
    (finding,) = report["findings"]
    assert (finding["kind"], finding["severity"], finding["fqn"]) == ("geometry", "error", "w")
    assert finding["boxes"] == boxes
    assert word in finding["message"] and boxes[0] in finding["message"]


def test_gap_and_overlap_in_one_tensor_are_two_findings(tmp_path):
    root = write_hp(tmp_path / "c", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:2]),
        ("_rank1_.safetensors", "w", (1, 0), W[1:3]),  # overlaps row 1; row 3 is nobody's
    ])})
    code, report = verify(root)
    assert code == 11
    by_word = {("overlap" if "overlap" in f["message"] else "gap"): f["boxes"] for f in report["findings"]}
    assert by_word == {"gap": ["[3:4, 0:4]"], "overlap": ["[1:2, 0:4]"]}


def test_l_shaped_gap_is_listed_as_boxes_covering_it_exactly(tmp_path):
    root = write_hp(tmp_path / "c", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:3, :3]),
    ])})
    code, report = verify(root)
    assert code == 11
    (finding,) = report["findings"]
    cells = set()
    for box in finding["boxes"]:
        rows, cols = (tuple(map(int, part.split(":"))) for part in box.strip("[]").split(", "))
        new = {(r, c) for r in range(*rows) for c in range(*cols)}
        assert not new & cells, "boxes of one finding overlap"
        cells |= new
    assert cells == {(r, c) for r in range(4) for c in range(4) if r == 3 or c == 3}


# --------------------------------------------------------------------------------------------
# Metadata vs file: dtype and shape


def test_dtype_mismatch_between_metadata_and_file(tmp_path):
    root = copy_fixture("m0-torch-4rank", tmp_path / "c")

    def to_f64(header):
        assert header["model.position_ids"]["dtype"] == "I64"
        header["model.position_ids"]["dtype"] = "F64"

    edit_header(root / "_rank2_.safetensors", to_f64)  # the de-duplicated replica lives on rank 2
    code, report = verify(root)
    assert code == 10
    (finding,) = report["findings"]
    assert (finding["kind"], finding["fqn"], finding["file"]) == ("entry-mismatch", "model.position_ids",
                                                                  "_rank2_.safetensors")
    assert "float64" in finding["message"] and "int64" in finding["message"]


def test_dtype_mismatch_written_here(tmp_path):
    root = write_hp(tmp_path / "c", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:2]),
        ("_rank1_.safetensors", "w", (2, 0), W[2:].astype(np.float16)),
    ])})
    code, report = verify(root)
    assert code == 10
    (finding,) = report["findings"]
    assert (finding["kind"], finding["file"]) == ("entry-mismatch", "_rank1_.safetensors")
    assert "float16" in finding["message"] and "float32" in finding["message"]


def test_shape_mismatch_between_metadata_and_file(tmp_path):
    root = copy_fixture("m0-torch-4rank", tmp_path / "c")

    def transpose(header):
        assert header["model.embed_tokens.weight"]["shape"] == [3, 4]
        header["model.embed_tokens.weight"]["shape"] = [4, 3]  # same bytes, other shape

    edit_header(root / "_rank1_.safetensors", transpose)
    code, report = verify(root)
    assert code == 10
    (finding,) = report["findings"]
    assert (finding["kind"], finding["fqn"], finding["file"]) == ("entry-mismatch", "model.embed_tokens.weight",
                                                                  "_rank1_.safetensors")
    assert "[4, 3]" in finding["message"] and "[3, 4]" in finding["message"]


def test_shape_mismatch_written_here(tmp_path):
    root = write_hp(tmp_path / "c", {"w": ("torch.float32", (4, 4), [
        ("_rank0_.safetensors", "w", (0, 0), W[:2].reshape(4, 2), (2, 4)),  # metadata says [2, 4]
        ("_rank1_.safetensors", "w", (2, 0), W[2:]),
    ])})
    code, report = verify(root)
    assert code == 10
    (finding,) = report["findings"]
    assert (finding["kind"], finding["fqn"]) == ("entry-mismatch", "w")
    assert "[4, 2]" in finding["message"] and "[2, 4]" in finding["message"]


# --------------------------------------------------------------------------------------------
# Files left by an interrupted save


def test_local_plan_is_a_warning_and_an_error_with_strict(tmp_path):
    root = copy_fixture("m0-mindspore-1rank", tmp_path / "c")
    leftover(root / "LOCAL_PLAN_0.pkl", {"items": []})
    code, report = verify(root)
    check_schema(report, root)
    assert (code, report["ok"]) == (0, True)
    (finding,) = report["findings"]
    assert (finding["kind"], finding["severity"], finding["file"]) == ("interrupted-save", "warning", "LOCAL_PLAN_0.pkl")

    code, report = verify(root, "--strict")
    assert (code, report["ok"]) == (13, False)
    assert kinds(report) == ["interrupted-save"]

    human = runner.invoke(app, ["verify", str(root)])
    assert human.exit_code == 0 and human.stderr == ""
    assert "LOCAL_PLAN_0.pkl" in human.stdout and "1 warning" in human.stdout


def test_storage_data_is_an_error(tmp_path):
    root = copy_fixture("m0-mindspore-1rank", tmp_path / "c")
    leftover(root / "STORAGE_DATA_0.pkl", [])
    code, report = verify(root)
    assert (code, report["ok"]) == (13, False)
    (finding,) = report["findings"]
    assert (finding["kind"], finding["severity"], finding["file"]) == ("interrupted-save", "error", "STORAGE_DATA_0.pkl")

    human = runner.invoke(app, ["verify", str(root)])
    assert human.exit_code == 13
    assert human.stderr.splitlines() == ["error: verify found 1 error(s) and 0 warning(s); exit code 13"]


# --------------------------------------------------------------------------------------------
# Several problems at once: all listed, the lowest code wins


def many_problems(root: Path, problems: set[str]) -> Path:
    tensors = {"fine": ("torch.float32", (4, 4), [("_rank0_.safetensors", "fine", (0, 0), W)])}
    if "geometry" in problems:  # row 2 of `gappy` is in no chunk
        tensors["gappy"] = ("torch.float32", (4, 4), [("_rank0_.safetensors", "gappy", (0, 0), W[:2]),
                                                       ("_rank1_.safetensors", "gappy", (3, 0), W[3:])])
    if "missing-file" in problems:  # its file is deleted below
        tensors["lost"] = ("torch.float32", (2, 2), [("_rank9_.safetensors", "lost", (0, 0), W[:2, :2])])
    if "entry-mismatch" in problems:
        tensors["wrong_dtype"] = ("torch.float32", (2, 2), [("_rank1_.safetensors", "wrong_dtype", (0, 0),
                                                             W[:2, :2].astype(np.float64))])
    if "unsafe-path" in problems:
        tensors["far"] = ("torch.float32", (2, 2), [("../elsewhere/_rank0_.safetensors", "far", (0, 0), W[:2, :2])])
        (root.parent / "elsewhere").mkdir(exist_ok=True)
    write_hp(root, tensors, {"step": ("_rank0_.bytes", pickle.dumps(3, protocol=4))})
    if "missing-file" in problems:
        (root / "_rank9_.safetensors").unlink()
    if "interrupted-save" in problems:
        leftover(root / "STORAGE_DATA_1.pkl", [])
    leftover(root / "LOCAL_PLAN_0.pkl", {"items": []})  # always: a warning never lowers the code
    return root


ALL_PROBLEMS = ["missing-file", "entry-mismatch", "geometry", "unsafe-path", "interrupted-save"]


@pytest.mark.parametrize("first", range(len(ALL_PROBLEMS)))
def test_several_problems_all_listed_lowest_code_wins(tmp_path, first):
    problems = set(ALL_PROBLEMS[first:])
    root = many_problems(tmp_path / "c", problems)
    code, report = verify(root)
    check_schema(report, root)
    expected = min(EXIT_CODE_BY_KIND[p] for p in problems)
    assert (code, report["ok"]) == (expected, False)
    errors = {f["kind"] for f in report["findings"] if f["severity"] == "error"}
    assert errors == problems
    warnings = [f for f in report["findings"] if f["severity"] == "warning"]
    assert [(f["kind"], f["file"]) for f in warnings] == [("interrupted-save", "LOCAL_PLAN_0.pkl")]
    where = {f["kind"]: (f["fqn"], f["file"]) for f in report["findings"] if f["severity"] == "error"}
    expected_where = {
        "missing-file": (None, "_rank9_.safetensors"),
        "entry-mismatch": ("wrong_dtype", "_rank1_.safetensors"),
        "geometry": ("gappy", None),
        "unsafe-path": (None, "../elsewhere/_rank0_.safetensors"),
        "interrupted-save": (None, "STORAGE_DATA_1.pkl"),
    }
    assert where == {k: expected_where[k] for k in problems}
    assert report["checked"]["tensors"] == 1 + len(problems - {"interrupted-save"})

    code, strict = verify(root, "--strict")
    assert code == min(expected, EXIT_CODE_BY_KIND["interrupted-save"])
    assert strict["findings"] == report["findings"]


def test_several_problems_human_report_lists_each(tmp_path):
    root = many_problems(tmp_path / "c", set(ALL_PROBLEMS))
    result = runner.invoke(app, ["verify", str(root)], env={"COLUMNS": "250"})
    assert result.exit_code == 8
    assert result.stderr.splitlines() == ["error: verify found 5 error(s) and 1 warning(s); exit code 8"]
    for kind in ALL_PROBLEMS:
        assert f"[{kind}]" in result.stdout, f"kind {kind} not shown:\n{result.stdout}"
    for text in ("_rank9_.safetensors", "wrong_dtype", "[2:3, 0:4]", "../elsewhere", "STORAGE_DATA_1.pkl",
                 "LOCAL_PLAN_0.pkl"):
        assert text in result.stdout, text


def test_one_line_per_damaged_file_with_its_size_details_behind_verbose(tmp_path):
    """A truncated file is one line saying how short it is (not a line per tensor or value in it);
    `--verbose` and `--json` (`details`) list each problem."""
    root = copy_fixture("m0-torch-4rank", tmp_path / "c")
    tensors, values = root / "_rank1_.safetensors", root / "_rank1_.bytes"
    size, value_size = tensors.stat().st_size, values.stat().st_size
    tensors.write_bytes(tensors.read_bytes()[:-100])
    values.write_bytes(values.read_bytes()[:30])
    result = runner.invoke(app, ["verify", str(root)], env={"COLUMNS": "250"})
    assert result.exit_code == 9, result.output
    errors = [line for line in result.stdout.splitlines() if line.startswith("error")]
    assert len(errors) == 2, result.stdout
    assert f"_rank1_.safetensors: truncated: {size - 100} of {size} bytes (the header places 3 tensor(s)" in errors[0]
    assert f"_rank1_.bytes: truncated: 30 of {value_size} bytes" in errors[1]
    code, report = verify(root)
    check_schema(report, root)
    assert [f["file"] for f in report["findings"]] == ["_rank1_.safetensors", "_rank1_.bytes"]
    # a file with several problems of other kinds: one line naming the count, each behind --verbose
    tensors.write_bytes(copy_fixture("m0-torch-4rank", tmp_path / "d").joinpath("_rank1_.safetensors").read_bytes())
    values.write_bytes((tmp_path / "d" / "_rank1_.bytes").read_bytes())
    keys = safetensors_keys(tensors)[:2]
    edit_header(tensors, lambda h: [h[k].update(dtype="F16") for k in keys])
    result = runner.invoke(app, ["verify", str(root)], env={"COLUMNS": "250"})
    errors = [line for line in result.stdout.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "more problem(s) in this file)" in errors[0], result.stdout
    verbose = runner.invoke(app, ["verify", "--verbose", str(root)], env={"COLUMNS": "250"}).stdout
    assert all(repr(k) in verbose for k in keys), verbose
    _, report = verify(root)
    assert len(report["findings"]) == 1 and len(report["findings"][0]["details"]) >= 2
