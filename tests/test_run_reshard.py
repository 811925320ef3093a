"""`hpckpt run ... reshard` (`hpckpt.dist.jobs.reshard_job`): the offline reshard spread over workers.

The proof: real torchrun jobs of 2 and 4 workers write outputs whose every file (names and
sha256, metadata and manifest included) equals the one-process `hpckpt reshard` output of
the same target options. One launch per worker count runs many cases (a launch costs ~10 s):
several targets in the three layout formats (HyperParallel, PyTorch DCP, MindFormers with
`--keep-replicas`), more workers than target ranks, an existing destination (refused on every
worker, left alone), `--force`, and a real failure on a non-coordinator worker (its share does
not fit a small tmpfs: no output, no leftovers, every worker names worker 1). The share
assignment and the failure bookkeeping are pure functions, tested without processes; one
in-process run with a single worker checks the job end to end fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpckpt.core import errors
from hpckpt.dist.jobs import reshard_job
from hpckpt.dist.jobs.reshard_job import assign_shares, first_failure, raised
from tests._util import MANIFEST, REPO, RUN_FIELDS, manifest_content, run_torchrun

DRIVER = REPO / "tests" / "dist_scripts" / "reshard_driver.py"
HPCKPT = Path(sys.executable).with_name("hpckpt")


# -- a source of a few MB with uneven tensors and values on both ranks ----------------------------


def make_source(root: Path) -> Path:
    """A 2-rank HyperParallel checkpoint of random data (so a misplaced byte shows): row shards
    of uneven lengths, a replicated 0-d tensor stored once, a value on each rank."""
    from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
    from hpckpt.core import dtypes
    from hpckpt.core.geometry.layout import Mesh, TensorLayout, parse_placements

    rng = np.random.default_rng(7)
    tensors = {}
    for name, shape, dt in [("model.w", (1000, 600), "float32"), ("model.b", (333,), "float32"),
                            ("model.e", (517, 256), "float16"), ("optimizer.step", (), "float32")]:
        array = rng.standard_normal(shape).astype(dt)
        layout = TensorLayout(Mesh((2,)), parse_placements("S0" if shape else "R"))
        chunks = [ChunkData(rank, box, np.ascontiguousarray(array[box.slices()]).tobytes())
                  for rank, boxes in layout.all_boxes(array.shape).items() for box in boxes
                  if shape or rank == 0]
        tensors[name] = (dtypes.dtype(dt), array.shape, chunks)
    root.mkdir(parents=True)
    write_checkpoint(root, tensors, {"extra_state.step": (0, 7), "extra_state.name": (1, "run-reshard")})
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("run-reshard") / "src")


def digests(directory: Path) -> dict[str, str]:
    """Every file's sha256 by name (hidden ones included); a subdirectory fails the comparison.
    The manifest counts by its content without the run's own fields (command line, time) and
    the listing (a fan-out's finalize reads no data file and has none)."""
    out = {}
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        if entry == MANIFEST:
            content = manifest_content(path, (*RUN_FIELDS, "index"))
            out[entry] = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
        else:
            out[entry] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "<directory>"
    return out


def one_process(src: Path, dst: Path, *options: str) -> dict:
    """The reference: the one-process `hpckpt reshard` as users run it; its JSON report."""
    done = subprocess.run([str(HPCKPT), "reshard", str(src), "-o", str(dst), *options, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def spec(src: Path, out: Path, **options) -> dict:
    return {"job": "reshard", "src": str(src), "out": str(out), **options}


# -- the share of each worker ---------------------------------------------------------------------


def test_shares_cover_every_rank_once_and_balance_bytes():
    rank_bytes = [100, 1, 1, 1, 1, 1, 50, 50]
    shares = assign_shares(rank_bytes, 2)
    assert sorted(r for share in shares for r in share) == list(range(8))
    loads = [sum(rank_bytes[r] for r in share) for share in shares]
    assert loads == [103, 102]  # round-robin (rank % 2) would give 152 / 53
    assert shares == assign_shares(list(rank_bytes), 2)  # deterministic: every worker computes it alone


def test_shares_largest_first_to_the_least_loaded_lower_worker_on_ties():
    assert assign_shares([5, 9, 9, 1], 3) == [(1,), (2,), (0, 3)]
    assert assign_shares([0, 0, 0, 0], 2) == [(0, 2), (1, 3)]


def test_workers_beyond_the_target_ranks_get_nothing():
    assert assign_shares([3, 4], 4) == [(1,), (0,), (), ()]
    assert assign_shares([], 2) == [(), ()]
    with pytest.raises(ValueError):
        assign_shares([1], 0)


def test_first_failure_is_the_lowest_failing_worker_and_keeps_its_exit_code():
    error = {"kind": "no-space", "exit_code": 18, "message": "disk full", "hint": "free some"}
    answers = [{"error": None}, {"error": error}, {"error": {**error, "message": "other"}}]
    failure = first_failure(answers)
    assert failure["worker"] == 1
    exc = raised(failure, 1)
    assert (exc.kind, exc.exit_code, exc.message, exc.hint) == ("no-space", 18, "worker 1: disk full", "free some")
    other = raised(failure, 0)  # what the other workers raise: the same line, a report about worker 1
    assert (other.kind, other.exit_code, other.message) == ("worker-failed", 18, "worker 1: disk full")
    assert first_failure([{"error": None}, {}]) is None


# -- one worker, in process ------------------------------------------------------------------------


class _OneWorker:
    """The job interface for a run of one worker: gathering is the worker's own answer."""

    rank, world_size, local_rank, node_rank, framework = 0, 1, 0, 0, "torch"

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.comm = self
        self.progress = self
        self.started = self.advanced = 0
        self.gathers = 0

    def all_gather_json(self, obj):
        self.gathers += 1
        return [json.loads(json.dumps(obj))]  # what crosses processes is JSON

    def barrier(self):
        pass

    def start(self, total):
        self.started += total

    def advance(self, n):
        self.advanced += n

    def phase(self, text):
        pass

    def log(self, text):
        print(text)


def test_one_worker_writes_the_one_process_output_and_refuses_an_existing_destination(source, tmp_path):
    reference = one_process(source, tmp_path / "ref", "--mesh", "2x2", "--placements", "R,S0")
    ctx = _OneWorker(tmp_path)
    result = reshard_job.run(spec(source, tmp_path / "out", mesh="2x2", placements="R,S0"), ctx)
    assert digests(tmp_path / "out") == digests(tmp_path / "ref")
    assert result["target_ranks"] == [0, 1, 2, 3] and result["finalized"] is True
    assert result["output_files"] == len(digests(tmp_path / "ref"))
    assert result["bytes_written"] == reference["bytes_written"] == ctx.started == ctx.advanced
    assert ctx.gathers == 4
    before = digests(tmp_path / "out")
    with pytest.raises(errors.WorkerFailedError) as caught:
        reshard_job.run(spec(source, tmp_path / "out", world_size=3), _OneWorker(tmp_path))
    assert (caught.value.kind, caught.value.exit_code) == ("destination-exists", 14)
    assert caught.value.message.startswith("worker 0: ")
    assert digests(tmp_path / "out") == before
    assert sorted(os.listdir(tmp_path)) == ["out", "ref"]  # no lock file, nothing moved aside


def test_a_bad_target_is_a_usage_error_on_the_worker(source, tmp_path):
    with pytest.raises(errors.WorkerFailedError) as caught:
        reshard_job.run(spec(source, tmp_path / "out", mesh="2x2"), _OneWorker(tmp_path))  # no placements
    assert caught.value.exit_code == 2 and "placements" in caught.value.message
    assert not (tmp_path / "out").exists()


# -- real workers under torchrun ---------------------------------------------------------------------


def _launch(nproc: int, cases: list[dict], work: Path) -> dict[int, dict]:
    """One torchrun job of `nproc` workers running every case; each rank's outcomes by case."""
    (work / "cases.json").write_text(json.dumps(cases))
    results = work / "results"
    results.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO.parent)}
    rc, output = run_torchrun(nproc, [str(DRIVER), str(work / "cases.json"), str(results)], work / "torchrun.log",
                              env, timeout=240)
    assert rc == 0, output[-3000:]
    return {r: json.loads((results / f"rank-{r}.json").read_text()) for r in range(nproc)}


def _check_written(outcomes: dict[int, dict], case: str, reference: dict, out: Path, ref_dir: Path,
                   writing_workers: int, beside: int = 0) -> None:
    """Byte-identical output; every target rank written by exactly one worker; the figures add up
    (`beside`: files finalize writes next to the output, MindFormers' tracker)."""
    assert digests(out) == digests(ref_dir), case
    results = [outcomes[r][case]["result"] for r in sorted(outcomes)]
    ranks = sorted(t for result in results for t in result["target_ranks"])
    assert ranks == list(range(reference["plan"]["world_size"])), case
    assert sum(bool(result["target_ranks"]) for result in results) == writing_workers, case
    assert sum(result["bytes_written"] for result in results) == reference["bytes_written"], case
    assert sum(result["bytes_read"] for result in results) == reference["bytes_read"], case
    for rank, result in enumerate(results):
        assert outcomes[rank][case]["progress_total"] == outcomes[rank][case]["progress_done"] \
            == result["bytes_written"], case
        assert ("finalized" in result) == (rank == 0), case
    assert results[0]["finalized"] is True and results[0]["output_files"] == len(digests(ref_dir)) + beside, case


def _check_failed(outcomes: dict[int, dict], case: str, worker: int, kind: str, exit_code: int) -> str:
    """Every worker raised the failing worker's error (its kind there, `worker-failed` on the
    others); its message."""
    errors = [outcomes[r][case]["error"] for r in sorted(outcomes)]
    assert [e["kind"] for e in errors] == [kind if r == worker else "worker-failed" for r in sorted(outcomes)], errors
    assert all(e["exit_code"] == exit_code for e in errors), errors
    assert len({e["message"] for e in errors}) == 1 and errors[0]["message"].startswith(f"worker {worker}: "), errors
    return errors[0]["message"]


def _hpckpt_run(nproc: int, work: Path, *args: str) -> subprocess.CompletedProcess:
    """The real `hpckpt run --launcher torchrun ... reshard` as users type it."""
    log_dir = work / f"logs-{len(list(work.glob('logs-*')))}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(HPCKPT), "run", "--launcher", "torchrun", "--nproc-per-node", str(nproc),
                           "--log-dir", str(log_dir), "reshard", *args], capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [2, 4])
def test_hpckpt_run_reshard_matches_the_one_process_reshard(source, tmp_path, nproc):
    to = ["--to", "torch-dcp"] if nproc == 4 else []  # the option reaches the workers
    reference = one_process(source, tmp_path / "ref", "--world-size", "8", *to)
    done = _hpckpt_run(nproc, tmp_path, str(source), "-o", str(tmp_path / "out"), "--world-size", "8", *to, "--json")
    assert done.returncode == 0, done.stderr
    assert digests(tmp_path / "out") == digests(tmp_path / "ref")
    assert (tmp_path / "out" / ("__7_0.distcp" if to else "_rank7_.safetensors")).is_file()
    report = json.loads(done.stdout)
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == list(range(nproc))
    assert sorted(t for r in ranks for t in r["target_ranks"]) == list(range(8))
    assert all(len(r["target_ranks"]) == 8 // nproc for r in ranks)  # equal ranks: balanced by bytes too
    assert sum(r["bytes_written"] for r in ranks) == reference["bytes_written"]
    assert ranks[0]["finalized"] is True and ranks[0]["output_files"] == len(digests(tmp_path / "ref"))
    assert not any("finalized" in r for r in ranks[1:])
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no lock file left
    if nproc == 2:  # the same command again: the destination exists
        before = digests(tmp_path / "out")
        again = _hpckpt_run(nproc, tmp_path, str(source), "-o", str(tmp_path / "out"), "--world-size", "8")
        # refused before any launcher starts, with the error's own code (the workers' own refusal,
        # for storage only they see, is tested in the driver job below)
        assert again.returncode == 14, again.stderr
        assert again.stderr.startswith(f"error: {tmp_path / 'out'} exists"), again.stderr
        assert not (tmp_path / "logs-1").exists()
        assert digests(tmp_path / "out") == before


@pytest.mark.dist
def test_workers_match_one_process_and_fail_as_one(source, tmp_path):
    """One driver launch of 2 workers, many cases: other targets, more workers than target ranks,
    an existing destination, --force, and a share that does not fit on worker 1."""
    tmpfs = tmp_path / "small"
    tmpfs.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(tmpfs)],
                             capture_output=True).returncode == 0
    try:
        refs = {"mesh": one_process(source, tmp_path / "ref-mesh", "--mesh", "2x3", "--placements", "S1,S0",
                                    "--dtype", "bf16"),
                "rules": one_process(source, tmp_path / "ref-rules", "--layout-rules", str(_rules(tmp_path)),
                                     "--exclude", "optimizer.*"),
                "ws1": one_process(source, tmp_path / "ref-ws1", "--world-size", "1"),
                "ws3": one_process(source, tmp_path / "ref-ws3", "--world-size", "3"),
                "dcp": one_process(source, tmp_path / "ref-dcp", "--to", "torch-dcp", "--world-size", "3"),
                "mf": one_process(source, tmp_path / "ref-mf" / "iteration_00000007", "--to", "mf", "--keep-replicas",
                                  "--mesh", "2", "--placements", "R", "--parents")}
        before = digests(tmp_path / "ref-ws1")
        (tmp_path / "replace").mkdir()  # an old output --force replaces: a copy of another reshard
        for name in before:
            (tmp_path / "replace" / name).write_bytes((tmp_path / "ref-ws1" / name).read_bytes())
        cases = [
            {"name": "mesh", "spec": spec(source, tmp_path / "mesh", mesh="2x3", placements="S1,S0", dtype="bf16")},
            {"name": "rules", "spec": spec(source, tmp_path / "rules", rules=str(tmp_path / "rules.toml"),
                                           exclude=["optimizer.*"])},
            {"name": "ws1", "spec": spec(source, tmp_path / "ws1", world_size=1)},
            {"name": "exists", "spec": spec(source, tmp_path / "ref-ws1", world_size=3)},
            {"name": "force", "spec": spec(source, tmp_path / "replace", world_size=3, force=True)},
            {"name": "dcp", "spec": spec(source, tmp_path / "dcp", to="torch-dcp", world_size=3)},
            {"name": "mf", "spec": spec(source, tmp_path / "mf" / "iteration_00000007", to="mf", keep_replicas=True,
                                        mesh="2", placements="R", parents=True)},
        ]
        if mounted:  # worker 1's share (two of three target ranks, ~1.9 MiB) does not fit; worker 0's does
            cases.append({"name": "no-space", "spec": spec(source, tmpfs / "out", world_size=3)})
        outcomes = _launch(2, cases, tmp_path)

        _check_written(outcomes, "mesh", refs["mesh"], tmp_path / "mesh", tmp_path / "ref-mesh", 2)
        _check_written(outcomes, "rules", refs["rules"], tmp_path / "rules", tmp_path / "ref-rules", 2)
        _check_written(outcomes, "ws1", refs["ws1"], tmp_path / "ws1", tmp_path / "ref-ws1", 1)
        assert outcomes[1]["ws1"]["result"]["target_ranks"] == []  # the extra worker took part, wrote nothing
        _check_written(outcomes, "force", refs["ws3"], tmp_path / "replace", tmp_path / "ref-ws3", 2)
        _check_written(outcomes, "dcp", refs["dcp"], tmp_path / "dcp", tmp_path / "ref-dcp", 2)
        assert (tmp_path / "dcp" / "__0_0.distcp").is_file()  # PyTorch DCP's own names
        mf, ref_mf = tmp_path / "mf" / "iteration_00000007", tmp_path / "ref-mf" / "iteration_00000007"
        _check_written(outcomes, "mf", refs["mf"], mf, ref_mf, 2, beside=1)
        assert refs["mf"]["skipped"]  # the values MindFormers' files do not hold: each share says so
        for rank in sorted(outcomes):
            result = outcomes[rank]["mf"]["result"]
            assert [result[k] for k in ("skipped", "converted", "warnings")] == \
                [refs["mf"][k] for k in ("skipped", "converted", "warnings")], rank
        tensor_bytes = 1000 * 600 * 4 + 333 * 4 + 517 * 256 * 2 + 4
        assert refs["mf"]["bytes_written"] == 2 * tensor_bytes  # --keep-replicas: both ranks write every tensor
        assert digests(tmp_path / "mf") == digests(tmp_path / "ref-mf")  # MindFormers' tracker beside it too
        message = _check_failed(outcomes, "exists", 0, "destination-exists", 14)
        assert str(tmp_path / "ref-ws1") in message
        assert digests(tmp_path / "ref-ws1") == before  # left alone
        leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".")]
        assert leftovers == [], leftovers  # no lock file, no staging, no old output moved aside
        if mounted:
            message = _check_failed(outcomes, "no-space", 1, "no-space", 18)
            assert "no space" in message
            assert os.listdir(tmpfs) == []  # worker 0's share removed, no lock file: nothing
    finally:
        if mounted:
            subprocess.run(["umount", str(tmpfs)], check=True)
    if not mounted:
        pytest.skip("could not mount a tmpfs (needs root): the failure of a non-coordinator worker is untested")


def _rules(work: Path) -> Path:
    """Per-tensor placements on a 2x2 mesh: what a tensor-parallel target looks like."""
    path = work / "rules.toml"
    path.write_text('mesh = \"2x2\"\ndefault = "S0,R"\n\n[[rule]]\nmatch = "model.w"\nplacements = "R,S1"\n')
    return path
