"""`hpckpt.dist` in real multi-process jobs.

* every HyperParallel fixture loaded with `hpckpt.dist.load` into DTensors at world sizes 1-4
  (one torchrun per world size, each covering all fixtures), bit-exact against `expected.*`;
* `coordination="storage"`: 3 plain processes, no process group: a clean save; a rank that never
  arrives (exits, or is SIGKILLed) makes the others fail within the timeout naming it, and leaves
  no checkpoint; the next run to the same path succeeds and leaves nothing beside it;
* `coordination="none"`: rank-local metadata, no de-dup, loaded back in one process;
* a live 2-rank save (collectives, storage, async) is byte-identical to `hpckpt reshard`'s
  offline output for the same layout.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _util import FIXTURE_NAMES, FIXTURES, run_torchrun
from hp_reference import hp_modules

SCRIPTS = Path(__file__).parent / "dist_scripts"
FIXTURES_JOB = SCRIPTS / "fixtures_job.py"
STORAGE_JOB = SCRIPTS / "storage_job.py"
HPCKPT = Path(sys.executable).with_name("hpckpt")
CKPT_FILE = re.compile(r"(\.metadata|\d+\.metadata|_rank\d+_\.safetensors|_rank\d+_\.bytes|\.hpckpt\.json|\.hpckpt-manifest\.jsonl)")

# Environment of a child: nothing of an enclosing torchrun/launcher may leak into it.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "HPCKPT_JOB_ID")


def _base_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _run_torchrun(n: int, args: list[str], log: Path, timeout: float = 600) -> tuple[int | None, str]:
    return run_torchrun(n, args, log, _base_env(), timeout)


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(HPCKPT), *args], env=_base_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)


# ------------------------------------------------------------------------------ plain processes

class Job:
    """`world` plain Python processes of storage_job.py (no torchrun, no process group)."""

    def __init__(self, logs: Path, name: str, world: int, job_id: str, args: list[str]):
        self.logs, self.name, self.world = logs, name, world
        self.procs: list[subprocess.Popen] = []
        self.files = []
        self.started = time.monotonic()
        for r in range(world):
            out = open(logs / f"{name}.rank{r}.out", "w+")  # noqa: SIM115 - closed in wait()
            err = open(logs / f"{name}.rank{r}.err", "w+")  # noqa: SIM115 - closed in wait()
            self.files.append((out, err))
            env = _base_env(RANK=str(r), WORLD_SIZE=str(world), HPCKPT_JOB_ID=job_id)
            self.procs.append(subprocess.Popen([sys.executable, str(STORAGE_JOB), "save", *args], env=env,
                                               stdout=out, stderr=err, start_new_session=True))

    def wait_ready(self, rank: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        out = self.logs / f"{self.name}.rank{rank}.out"
        while "READY" not in out.read_text():
            assert self.procs[rank].poll() is None, f"rank {rank} exited before READY:\n{self.log()}"
            assert time.monotonic() < deadline, f"rank {rank} never READY:\n{self.log()}"
            time.sleep(0.05)

    def wait(self, timeout: float = 180) -> list[int | None]:
        rcs, self.seconds = [], []
        for p in self.procs:
            try:
                rcs.append(p.wait(timeout=max(1.0, self.started + timeout - time.monotonic())))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)  # a process this test started
                p.wait(timeout=30)
                rcs.append(None)
            self.seconds.append(time.monotonic() - self.started)
        for out, err in self.files:
            out.close()
            err.close()
        self.rcs = rcs
        return rcs

    def out(self, r: int) -> str:
        return (self.logs / f"{self.name}.rank{r}.out").read_text()

    def err(self, r: int) -> str:
        return (self.logs / f"{self.name}.rank{r}.err").read_text()

    def result(self, r: int) -> dict:
        lines = [line for line in self.out(r).splitlines() if line.startswith("RESULT ")]
        assert lines, f"rank {r} printed no RESULT:\n{self.log()}"
        return json.loads(lines[-1][len("RESULT "):])

    def log(self) -> str:
        parts = []
        for r in range(self.world):
            rc = getattr(self, "rcs", [None] * self.world)[r]
            parts.append(f"--- {self.name} rank {r} (exit {rc})\nstdout:\n{self.out(r)[-3000:]}\n"
                         f"stderr:\n{self.err(r)[-5000:]}")
        return "\n".join(parts)


def _load_single(ckpt: Path, world_saved: int, logs: Path, variant: int = 0) -> tuple[int, str]:
    """storage_job.py load in one process: no process group, no RANK/WORLD_SIZE."""
    p = subprocess.run([sys.executable, str(STORAGE_JOB), "load", str(ckpt), str(world_saved), "--variant", str(variant)],
                       env=_base_env(), capture_output=True, text=True, timeout=300, check=False)
    log = f"exit {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    results = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode == 0:  # a clean checkpoint of exactly this save: nothing in it the target lacks
        assert results and results[-1]["unused"] == [] and results[-1]["missing"] == [], log
    return p.returncode, log


def _listing(directory: Path) -> list[str]:
    return sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())


def _tree(directory: Path) -> str:
    if not directory.exists():
        return f"{directory} does not exist"
    return "\n".join(f"  {p.relative_to(directory)}{'/' if p.is_dir() else ''}" for p in sorted(directory.rglob("*")))


def _assert_clean_checkpoint(ckpt: Path, what: str) -> None:
    """Committed, nothing but checkpoint files inside, nothing beside it, `verify --strict` happy."""
    assert _listing(ckpt.parent) == [ckpt.name + "/"], f"{what}: leftovers beside the checkpoint:\n{_tree(ckpt.parent)}"
    entries = _listing(ckpt)
    odd = [e for e in entries if not CKPT_FILE.fullmatch(e)]
    assert not odd, f"{what}: protocol/staging leftovers inside the checkpoint: {odd}\n{_tree(ckpt)}"
    assert any(e.endswith("metadata") for e in entries), f"{what}: no metadata: {entries}"
    v = _cli("verify", "--strict", "--no-progress", str(ckpt))
    assert v.returncode == 0, f"{what}: hpckpt verify --strict exit {v.returncode}\n{v.stdout}\n{v.stderr}"


def _safetensors_keys(path: Path) -> list[str]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]


def _holders(ckpt: Path, name: str) -> list[str]:
    """Files whose safetensors header stores (a chunk of) `name`."""
    return sorted(f.name for f in ckpt.glob("_rank*_.safetensors")
                  if any(k == name or k.startswith(name + ".__dcp_chunk_") for k in _safetensors_keys(f)))


# ------------------------------------------------------------------------------ 1. fixtures x N

@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_load_every_fixture_into_dtensors(world, tmp_path):
    rc, log = _run_torchrun(world, [str(FIXTURES_JOB), "load-fixtures", str(FIXTURES), str(tmp_path)],
                            tmp_path / "torchrun.log")
    reports = {}
    for r in range(world):
        f = tmp_path / f"load-rank{r}.json"
        if f.exists():
            reports[r] = json.loads(f.read_text())
    problems = []
    for r in range(world):
        if r not in reports:
            problems.append(f"rank {r}: no report")
            continue
        fixtures = reports[r]["fixtures"]
        saved_layout = fixtures.pop("m0-torch-4rank-async@saved-layout", None)
        if world == 4:  # also loaded into the layout each tensor was saved with (chunk_info tensors)
            if saved_layout is None:
                problems.append(f"rank {r}: the async fixture was not loaded into its saved layout")
            else:
                problems += [f"rank {r} async@saved-layout: {p}" for p in saved_layout["failures"]]
                shards = list(saved_layout["layout"].values()).count("chunk_info")
                if not saved_layout["failures"] and (saved_layout["tensors_checked"] < 10 or shards < 8):
                    problems.append(f"rank {r} async@saved-layout: {saved_layout['tensors_checked']} tensors checked, "
                                    f"{shards} as chunk_info shards")
                if saved_layout["wants_from"] != "boxes":  # chunk_info has no layout: the ranks list their boxes
                    problems.append(f"rank {r} async@saved-layout: wants from {saved_layout['wants_from']!r}")
        missing = sorted(set(FIXTURE_NAMES) - set(fixtures))
        if missing:
            problems.append(f"rank {r}: fixtures not covered: {missing}")
        for name, rep in sorted(fixtures.items()):
            for p in rep["failures"]:
                problems.append(f"rank {r} {name}: {p}")
            if not rep["failures"]:
                from safetensors import safe_open

                with safe_open(str(FIXTURES / name / "expected.safetensors"), "pt") as st:
                    n_tensors = len(list(st.keys()))
                n_values = len(json.loads((FIXTURES / name / "expected.json").read_text()))
                if (rep["tensors_checked"], rep["values_checked"]) != (n_tensors, n_values):
                    problems.append(f"rank {r} {name}: checked {rep['tensors_checked']} tensors / "
                                    f"{rep['values_checked']} values of {n_tensors} / {n_values}")
    if world == 4 and 0 in reports:  # the 2x2 layouts were really exercised
        layouts = {lay for rep in reports[0]["fixtures"].values() for lay in rep.get("layout", {}).values()}
        assert {"2x2:R,S1", "2x2:S0,S1", "4:S0", "4:R", "plain"} <= layouts, layouts
    assert rc == 0 and not problems, (f"torchrun exit {rc}; {len(problems)} problems:\n" + "\n".join(problems[:60])
                                      + f"\n--- torchrun log (tail):\n{log[-8000:]}")


# ------------------------------------------------------------------------------ 2. storage

def _assert_timed_out_naming(job: Job, ranks: list[int], missing: int, timeout: float) -> None:
    for r in ranks:
        assert job.rcs[r] == 3, f"rank {r} should fail with CoordinationTimeoutError (exit 3):\n{job.log()}"
        err = job.err(r)
        m = re.search(r"TIMEOUT after ([0-9.]+)s: (.*)", err)
        assert m, f"rank {r}: no timeout line:\n{job.log()}"
        seconds, message = float(m.group(1)), m.group(2)
        assert re.search(rf"\branks? (?:\d+, )*{missing}\b", message), f"rank {r}: message does not name rank {missing}: {message!r}"
        assert re.search(rf"timed? ?out|within {timeout:g} ?s", message, re.IGNORECASE), \
            f"rank {r}: message does not mention the timeout: {message!r}"
        assert "CoordinationTimeoutError" in err, f"rank {r}: not a CoordinationTimeoutError:\n{err[-3000:]}"
        # every wait is bounded by `timeout`: a failed save gives up after about one timeout
        assert seconds < timeout * 2 + 3, f"rank {r} took {seconds:.1f}s to give up (timeout {timeout}s):\n{job.log()}"
        assert job.seconds[r] < 90, f"rank {r} ran {job.seconds[r]:.0f}s"


@pytest.mark.dist
def test_storage_coordination_clean_killed_and_rerun(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    state = {}

    # (a) normal run: 3 plain processes, no process group
    a = tmp_path / "a" / "ckpt"
    a.parent.mkdir()
    job = Job(logs, "a", 3, "job-a", [str(a), "storage", "--timeout", "5"])
    assert job.wait() == [0, 0, 0], job.log()
    results = [job.result(r) for r in range(3)]
    for r, res in enumerate(results):
        assert (res["rank"], res["world_size"], res["coordination"]) == (r, 3, "storage"), res
        assert Path(res["path"]).resolve() == a.resolve(), res
    coordinator = results[0]["coordinator"]
    assert results[coordinator]["committed"] is True, results
    assert sum(res["bytes_written"] for res in results) == results[0]["job_bytes_written"], results
    _assert_clean_checkpoint(a, "(a)")
    assert _holders(a, "shared") and len(_holders(a, "shared")) == 1, f"replicated tensor not stored once: {_holders(a, 'shared')}"
    for r in range(3):
        assert len(_holders(a, f"own{r}")) == 1, (r, _holders(a, f"own{r}"))
    rc, log = _load_single(a, 3, logs)
    assert rc == 0, log
    state["a"] = _listing(a)

    b = tmp_path / "b" / "ckpt"
    b.parent.mkdir()
    # (b') rank 1 is SIGKILLed once it is about to save (the others already are in save)
    job = Job(logs, "b2", 3, "job-b2", [str(b), "storage", "--timeout", "5", "--hang-before-save", "1"])
    job.wait_ready(1)
    os.kill(job.procs[1].pid, signal.SIGKILL)  # the process this test started
    job.wait()
    assert job.rcs[1] == -signal.SIGKILL, job.log()
    _assert_timed_out_naming(job, [0, 2], missing=1, timeout=5)
    assert not b.exists(), f"(b') a checkpoint appeared after a failed save:\n{_tree(b.parent)}"
    after_b2 = _listing(b.parent)

    # (c) a normal run to the same path succeeds and removes what the failed runs left
    job = Job(logs, "c", 3, "job-c", [str(b), "storage", "--timeout", "5"])
    assert job.wait() == [0, 0, 0], f"(c) failed; beside the path before: {after_b2}\n{job.log()}"
    _assert_clean_checkpoint(b, f"(c) (left by the failed run: {after_b2})")
    rc, log = _load_single(b, 3, logs)
    assert rc == 0, log
    assert _listing(b) == state["a"], (_listing(b), state["a"])
    for name in state["a"]:
        if name.endswith((".safetensors", ".bytes")):
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between (a) and (c)"


@pytest.mark.dist
def test_storage_coordinator_never_arrives(tmp_path):
    """The coordinator (rank 0) leaves before saving: the others time out naming rank 0."""
    logs = tmp_path / "logs"
    logs.mkdir()
    ckpt = tmp_path / "out" / "ckpt"
    ckpt.parent.mkdir()
    job = Job(logs, "nocoord", 3, "job-nocoord", [str(ckpt), "storage", "--timeout", "5", "--die-before-save", "0"])
    job.wait()
    assert job.rcs[0] == 9, job.log()
    _assert_timed_out_naming(job, [1, 2], missing=0, timeout=5)
    assert not ckpt.exists(), _tree(ckpt.parent)
    assert _listing(ckpt.parent) == [], f"leftovers:\n{_tree(ckpt.parent)}"


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.dist
def test_storage_rank_killed_while_writing_keeps_the_old_checkpoint(tmp_path):
    """A rank dies after writing its files into the staging directory, before reporting them
    (a non-coordinator, then the coordinator): the others time out naming it, nothing is
    committed, the checkpoint saved before at that path is untouched; the next run replaces it."""
    logs = tmp_path / "logs"
    logs.mkdir()
    ckpt = tmp_path / "out" / "ckpt"
    ckpt.parent.mkdir()
    job = Job(logs, "v0", 3, "job-v0", [str(ckpt), "storage", "--timeout", "5"])
    assert job.wait() == [0, 0, 0], job.log()
    _assert_clean_checkpoint(ckpt, "v0")
    old = _snapshot(ckpt)

    job = Job(logs, "kill1", 3, "job-kill1", [str(ckpt), "storage", "--timeout", "5", "--variant", "1",
                                              "--die-while-writing", "1"])
    job.wait()
    assert job.rcs[1] == 9 and "WROTE" in job.out(1), job.log()
    _assert_timed_out_naming(job, [0, 2], missing=1, timeout=5)
    assert _snapshot(ckpt) == old, "the old checkpoint changed after a failed save"
    # the coordinator survived: it removes the staging directory it made
    assert _listing(ckpt.parent) == ["ckpt/"], f"leftovers after a failed save:\n{_tree(ckpt.parent)}"

    job = Job(logs, "kill0", 3, "job-kill0", [str(ckpt), "storage", "--timeout", "5", "--variant", "1",
                                              "--die-while-writing", "0"])
    job.wait()
    assert job.rcs[0] == 9 and "WROTE" in job.out(0), job.log()
    _assert_timed_out_naming(job, [1, 2], missing=0, timeout=5)
    assert _snapshot(ckpt) == old, "the old checkpoint changed after a failed save"
    v = _cli("verify", "--no-progress", str(ckpt))
    assert v.returncode == 0, f"old checkpoint no longer verifies: exit {v.returncode}\n{v.stdout}\n{v.stderr}"
    rc, log = _load_single(ckpt, 3, logs, variant=0)
    assert rc == 0, log
    left = _listing(ckpt.parent)

    job = Job(logs, "v1", 3, "job-v1", [str(ckpt), "storage", "--timeout", "5", "--variant", "1"])
    assert job.wait() == [0, 0, 0], f"left before: {left}\n{job.log()}"
    _assert_clean_checkpoint(ckpt, f"v1 (left by the killed coordinator: {left})")
    rc, log = _load_single(ckpt, 3, logs, variant=1)
    assert rc == 0, log


@pytest.mark.dist
def test_storage_same_job_id_after_a_killed_coordinator(tmp_path):
    """The coordinator is killed mid-save (its staging directory stays, with its start file and
    plans); the job is requeued with the same HPCKPT_JOB_ID and the coordinator comes late: the
    others must not join the dead attempt's save, and the new one commits cleanly."""
    logs = tmp_path / "logs"
    logs.mkdir()
    ckpt = tmp_path / "out" / "ckpt"
    ckpt.parent.mkdir()
    job = Job(logs, "dead", 3, "job-requeued", [str(ckpt), "storage", "--timeout", "5", "--die-while-writing", "0"])
    job.wait()
    assert job.rcs[0] == 9, job.log()
    _assert_timed_out_naming(job, [1, 2], missing=0, timeout=5)
    assert not ckpt.exists(), _tree(ckpt.parent)
    left = _tree(ckpt.parent)
    job = Job(logs, "requeued", 3, "job-requeued", [str(ckpt), "storage", "--timeout", "15", "--variant", "2",
                                                   "--sleep-before-save", "0:3"])
    assert job.wait() == [0, 0, 0], f"left by the dead attempt:\n{left}\n{job.log()}"
    _assert_clean_checkpoint(ckpt, "requeued")
    rc, log = _load_single(ckpt, 3, logs, variant=2)
    assert rc == 0, log


# ------------------------------------------------------------------------------ 3. coordination none

@pytest.mark.dist
def test_no_coordination_rank_local_metadata(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    ckpt = tmp_path / "out" / "ckpt"
    ckpt.parent.mkdir()
    job = Job(logs, "none", 2, "job-none", [str(ckpt), "none", "--timeout", "5"])
    assert job.wait() == [0, 0], job.log()
    for r in range(2):
        res = job.result(r)
        assert (res["rank"], res["world_size"], res["coordination"]) == (r, 2, "none"), res
    entries = _listing(ckpt)
    assert "0.metadata" in entries and "1.metadata" in entries, entries
    assert ".metadata" not in entries, f"coordination='none' wrote a global .metadata: {entries}"
    # no de-dup: both ranks store the replicated tensor
    assert _holders(ckpt, "shared") == ["_rank0_.safetensors", "_rank1_.safetensors"], _holders(ckpt, "shared")
    assert _holders(ckpt, "own0") == ["_rank0_.safetensors"] and _holders(ckpt, "own1") == ["_rank1_.safetensors"]
    _assert_clean_checkpoint(ckpt, "coordination=none")
    rc, log = _load_single(ckpt, 2, logs)
    assert rc == 0, log


def _run(logs: Path, name: str, world: int, ckpt: Path, *args: str) -> Job:
    job = Job(logs, name, world, f"job-{name}", [str(ckpt), *args])
    assert job.wait() == [0] * world, job.log()
    return job


@pytest.mark.dist
def test_no_coordination_replaces_an_existing_checkpoint(tmp_path):
    """`save` replaces a checkpoint at the path, whatever the coordination: a rank-local save
    into a directory holding an older checkpoint (a coordinated one with `.metadata`, or a
    rank-local one of more ranks) must not leave the old files mixed with the new ones."""
    logs = tmp_path / "logs"
    logs.mkdir()
    problems = []
    for old_coordination in ("storage", "none"):
        ckpt = tmp_path / old_coordination / "ckpt"
        ckpt.parent.mkdir()
        _run(logs, f"old-{old_coordination}", 3, ckpt, old_coordination, "--timeout", "5")
        _run(logs, f"new-after-{old_coordination}", 2, ckpt, "none", "--timeout", "5", "--variant", "1")
        entries = _listing(ckpt)
        want = ["0.metadata", "1.metadata", "_rank0_.bytes", "_rank0_.safetensors", "_rank1_.bytes", "_rank1_.safetensors"]
        stale = [e for e in entries if e not in want and e != ".hpckpt.json"]
        if stale:
            problems.append(f"after a {old_coordination} save of 3 ranks, a 2-rank coordination='none' save left "
                            f"files of the old checkpoint: {stale} (all: {entries})")
        try:
            rc, log = _load_single(ckpt, 2, logs, variant=1)
        except AssertionError as e:
            rc, log = -1, str(e)
        if rc != 0:
            problems.append(f"after a {old_coordination} save: the new checkpoint does not load as saved:\n{log}")
        v = _cli("verify", "--no-progress", str(ckpt))
        if v.returncode != 0:
            problems.append(f"after a {old_coordination} save: verify exit {v.returncode}: {v.stdout.strip()} {v.stderr.strip()}")
    assert not problems, "\n\n".join(problems)


# ------------------------------------------------------------------------------ 4. live == offline

def _describe_metadata(raw: bytes) -> list[str]:
    with hp_modules():
        try:
            md = pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - described, not raised
            return [f"<unpicklable: {e!r}>"]
    lines = []
    for fqn, m in md.state_dict_metadata.items():
        lines.append(f"sdm {fqn}: {m!r}")
    for k, v in md.storage_data.items():
        lines.append(f"storage {k!r}: {v!r}")
    lines.append(f"planner_data: {md.planner_data!r}")
    for attr in sorted(vars(md)):
        if attr not in ("state_dict_metadata", "storage_data", "planner_data"):
            lines.append(f"{attr}: {getattr(md, attr)!r}")
    return lines


def _describe_diff(name: str, a: bytes, b: bytes) -> str:
    if name.endswith(".safetensors"):
        na, nb = struct.unpack("<Q", a[:8])[0], struct.unpack("<Q", b[:8])[0]
        ha, hb = json.loads(a[8:8 + na]), json.loads(b[8:8 + nb])
        if ha != hb:
            keys = sorted(set(ha) | set(hb))
            d = [f"  {k}: live={ha.get(k)} offline={hb.get(k)}" for k in keys if ha.get(k) != hb.get(k)]
            return f"{name}: headers differ:\n" + "\n".join(d)
        if a[8:8 + na] != b[8:8 + nb]:
            return f"{name}: same header content, different header bytes:\n live {a[8:8 + na]!r}\n off  {b[8:8 + nb]!r}"
        return f"{name}: same header, data differs at byte {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
    if name.endswith("metadata"):
        la, lb = _describe_metadata(a), _describe_metadata(b)
        d = [f"  live:    {x}\n  offline: {y}" for x, y in zip(la, lb) if x != y]
        if len(la) != len(lb):
            d.append(f"  {len(la)} vs {len(lb)} lines: extra live {la[len(lb):]} extra offline {lb[len(la):]}")
        if not d:
            d = [f"  same content, different pickle bytes ({len(a)} vs {len(b)} bytes)"]
        return f"{name}: metadata differs:\n" + "\n".join(d[:40])
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{name}: {len(a)} vs {len(b)} bytes, first difference at {first}: live {a[first:first + 40]!r} offline {b[first:first + 40]!r}"


def _compare_dirs(live: Path, offline: Path) -> tuple[list[str], list[str]]:
    """(differences in the data/metadata files, notes about other files)."""
    kinds = re.compile(r"(\.metadata|_rank\d+_\.safetensors|_rank\d+_\.bytes)")
    la = {p.name for p in live.iterdir() if kinds.fullmatch(p.name)}
    lb = {p.name for p in offline.iterdir() if kinds.fullmatch(p.name)}
    diffs = []
    if la != lb:
        diffs.append(f"file sets differ: only live {sorted(la - lb)}, only offline {sorted(lb - la)}")
    for name in sorted(la & lb):
        a, b = (live / name).read_bytes(), (offline / name).read_bytes()
        if a != b:
            diffs.append(_describe_diff(name, a, b))
    others = sorted(({p.name for p in live.iterdir()} ^ {p.name for p in offline.iterdir()}) - (la ^ lb))
    notes = [f"other files present on one side only: {others}"] if others else []
    sa, sb = live / ".hpckpt.json", offline / ".hpckpt.json"
    if sa.exists() and sb.exists() and sa.read_bytes() != sb.read_bytes():
        ja, jb = json.loads(sa.read_text()), json.loads(sb.read_text())
        keys = sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))
        notes.append(".hpckpt.json differs: " + "; ".join(f"{k}: live={ja.get(k)!r} offline={jb.get(k)!r}" for k in keys))
    return diffs, notes


@pytest.mark.dist
def test_live_save_matches_offline_reshard(tmp_path):
    rc, log = _run_torchrun(2, [str(FIXTURES_JOB), "save-live", str(tmp_path)], tmp_path / "torchrun.log")
    assert rc == 0, f"torchrun exit {rc}:\n{log[-10000:]}"
    for r in range(2):
        rep = json.loads((tmp_path / f"save-rank{r}.json").read_text())
        assert not rep["failures"], rep["failures"]
        for kind in ("collectives", "storage", "async"):
            assert rep["saves"][kind]["world_size"] == 2 and rep["saves"][kind]["rank"] == r, rep["saves"][kind]
            assert rep["saves"][kind]["plan_from"] in ("layouts", "cache"), rep["saves"][kind]  # DTensors: no boxes sent
        assert rep["saves"]["collectives"]["plan_from"] == "layouts"  # (the first save: planned from the table)
    for kind in ("collectives", "storage", "async"):
        entries = _listing(tmp_path / kind)
        assert all(CKPT_FILE.fullmatch(e) for e in entries), f"{kind}: leftovers {entries}"
        v = _cli("verify", "--strict", "--no-progress", str(tmp_path / kind))
        assert v.returncode == 0, f"verify {kind}: exit {v.returncode}\n{v.stdout}\n{v.stderr}"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], f"leftovers beside: {_listing(tmp_path)}"
    # the same layout written offline: torch splits uneven dims like torch.chunk (= ceil)
    rules = tmp_path / "rules.toml"
    rules.write_text('mesh = "2"\nsplit = "ceil"\ndefault = "S0"\n\n[[rule]]\nmatch = "model.rep"\nplacements = "R"\n')
    offline = tmp_path / "offline"
    p = _cli("reshard", str(tmp_path / "collectives"), "-o", str(offline), "--layout-rules", str(rules),
             "--no-progress", "--framework", "torch")
    assert p.returncode == 0, f"hpckpt reshard exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    problems, notes = [], []
    for kind in ("collectives", "storage", "async"):
        d, n = _compare_dirs(tmp_path / kind, offline)
        problems += [f"[{kind} vs offline] {x}" for x in d]
        notes += [f"[{kind} vs offline] {x}" for x in n]
    print("\n".join(notes))
    assert not problems, "live save differs from the offline writer:\n" + "\n".join(problems) + "\n" + "\n".join(notes)
