"""kill -9 in the middle of a live save (`hpckpt.dist.save` and `async_save`, 2 ranks, gloo).

Four saves are swept (`OPS`): `save` over collectives, `save` with storage coordination,
`async_save` (its exchanges through files, on its background thread: every one of its calls is
made after it returned), and `save` replacing an older checkpoint. A point is one file-system
call of one rank, numbered by `kill_harness`: 20 drawn with a fixed seed (in the test id) from
a trace run that lists each rank's calls, plus always the commit's renames and the call after
them. At each point, two scenarios:

- (one) only the rank that reaches the point is SIGKILLed: every other rank fails within about
  its timeout with a documented error (`CoordinationTimeoutError` exit 20, `SaveError` 21),
  never hangs, and never reports a commit that did not happen;
- (job) the whole job dies: that rank SIGKILLs itself and the test SIGKILLs the others at once.

After each kill the destination holds what the point says: before the commit, nothing (no path
that `verify` or an offline open accepts) or the older checkpoint untouched; between the
commit's two renames (replacing), nothing; after them, the new checkpoint, byte-identical to an
uninterrupted save's (the manifest's time of writing aside). Every name left beside it is one
`leftover` explains and none is accepted as a checkpoint. Then a save of other values to the
same path, by fresh processes, commits, loads back bit-exact on both ranks, and leaves the
checkpoint alone in its directory, byte-identical to an uninterrupted save's.

Ranks are forked from a zygote process that imported torch and hpckpt once
(`dist_scripts/kill_job.py`), several scenarios at a time, on a tmpfs when one can be mounted.
`HPCKPT_KILL_POINTS=N` and `HPCKPT_KILL_SEED=S` (bench/dist_kill_sweep.py) draw N points with seed S.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _util import file_tree
from hpckpt import api
from hpckpt.converters import open_index
from hpckpt.core.errors import HpckptError
from hpckpt.core.commit.leftovers import leftover

KILL_JOB = Path(__file__).parent / "dist_scripts" / "kill_job.py"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "HPCKPT_JOB_ID")
WORLD = 2
MANIFEST = ".hpckpt-manifest.jsonl"  # `core.commit.manifest.NAME`, when the save writes one

SEED = int(os.environ.get("HPCKPT_KILL_SEED", "13"))
POINTS = int(os.environ.get("HPCKPT_KILL_POINTS", "20"))
TIMEOUT = 2.0  # every rank's wait (storage exchange, gloo collectives) in a scenario with a kill
AT_ONCE = 8  # scenarios running together (2 ranks each; the survivors mostly wait)
NAME = "ckpt"
# the errors a survivor may fail with: SaveError (a rank failed), CoordinationTimeoutError
DOCUMENTED = {"SaveError": 21, "CoordinationTimeoutError": 20}
# what the tests sweep: (function, coordination, over an older checkpoint); async_save exchanges
# through files on its thread (the job has an identity, HPCKPT_JOB_ID)
OPS = {"save": ("save", "collectives", False), "save-storage": ("save", "storage", False),
       "async_save": ("async_save", "collectives", False), "save-replacing": ("save", "collectives", True)}


@dataclass
class Scenario:
    """One run of the 2-rank job in `folder` (the checkpoint's parent, nothing else in it)."""

    name: str
    op: str
    folder: Path
    variant: int = 0
    kill: tuple[int, int] | None = None  # (rank, call) where a rank SIGKILLs itself
    whole_job: bool = False
    old: dict | None = None  # the older checkpoint (a `tree`) the save replaces
    load: bool = False
    timeout: float = TIMEOUT
    pids: list = field(default_factory=list)
    codes: list = field(default_factory=list)
    started: float = 0.0
    hung: bool = False

    @property
    def path(self) -> Path:
        return self.folder / NAME

    def work(self) -> Path:
        return self.folder.parent / f"{self.name}.work"  # logs, reports, the FileStore: not beside the checkpoint

    def report(self, rank: int) -> dict | None:
        f = self.work() / f"rank{rank}.json"
        return json.loads(f.read_text()) if f.exists() else None

    def log(self) -> str:
        parts = []
        for rank, code in enumerate(self.codes):
            text = (self.work() / f"rank{rank}.log").read_text()[-3000:]
            parts.append(f"--- {self.name} rank {rank} (exit {code}): {self.report(rank)}\n{text}")
        return "\n".join(parts)


class Zygote:
    """`dist_scripts/kill_job.py`: one process that imported torch and hpckpt, forking ranks."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen([sys.executable, str(KILL_JOB)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.pending = b""
        self.exits: dict[int, int] = {}  # pid -> exit code (-9: SIGKILLed)

    def _messages(self, timeout: float) -> list[dict]:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if ready:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            assert chunk, f"the zygote exited: {self.proc.wait()}"
            self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        messages = [json.loads(line) for line in lines]
        for m in messages:
            if "exit" in m:
                self.exits[m["pid"]] = m["exit"]
        return messages

    def fork(self, spec: dict) -> int:
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            for m in self._messages(5.0):
                if m.get("id") == spec["id"]:
                    return m["pid"]

    def wait(self, timeout: float) -> None:
        """Until some rank ends or `timeout` passes."""
        self._messages(timeout)

    def close(self) -> None:
        self.proc.stdin.close()  # it exits once its last rank has ended
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A tmpfs for the sweeps (a plain directory where mounting is not allowed)."""
    root = tmp_path_factory.mktemp("dist-kill")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(root)],
                             capture_output=True, check=False).returncode == 0
    yield root
    if mounted:
        subprocess.run(["umount", "-l", str(root)], check=False)


def _start(zygote: Zygote, sc: Scenario) -> None:
    fn, coordination, _ = OPS[sc.op]
    work = sc.work()
    work.mkdir(parents=True)
    sc.folder.mkdir(parents=True, exist_ok=True)
    if sc.old is not None:
        lay_down(sc.path, sc.old)
    sc.started = time.monotonic()
    for rank in range(WORLD):
        spec = {"id": f"{sc.name}/{rank}", "rank": rank, "op": fn, "coordination": coordination,
                "path": str(sc.path), "variant": sc.variant, "group": True, "store": str(work / "store"),
                "job": f"{sc.name}-{sc.started}", "timeout": sc.timeout, "load": sc.load,
                "log": str(work / f"rank{rank}.log"), "report": str(work / f"rank{rank}.json"),
                "kill_at": sc.kill[1] if sc.kill and sc.kill[0] == rank else None}
        sc.pids.append(zygote.fork(spec))


def kill(sc: Scenario) -> None:
    """SIGKILL the ranks of `sc` still running (processes this test started)."""
    for pid, code in zip(sc.pids, sc.codes):
        if code is None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended meanwhile


def run(zygote: Zygote, scenarios: list[Scenario], at_once: int = AT_ONCE) -> None:
    """Run `scenarios`, `at_once` together; the whole-job kills are done as soon as the rank at
    the point is dead; a scenario still running long after its timeout is killed and marked hung."""
    pending, active = list(scenarios), []
    while pending or active:
        while pending and len(active) < at_once:
            sc = pending.pop(0)
            _start(zygote, sc)
            active.append(sc)
        zygote.wait(0.2)
        for sc in list(active):
            sc.codes = [zygote.exits.get(pid) for pid in sc.pids]
            if sc.whole_job and sc.codes[sc.kill[0]] is not None:
                kill(sc)
            elif time.monotonic() - sc.started > sc.timeout * 3 + 30 and not sc.hung:
                sc.hung = True
                kill(sc)
            if None not in sc.codes:
                active.remove(sc)


def tree(root: Path) -> dict[str, bytes | None]:
    """Every name under `root` (hidden ones too): a file's bytes, None for a directory."""
    return file_tree(root)


def comparable(files: dict[str, bytes | None]) -> dict[str, bytes | None]:
    """A `tree` with the manifest's time of writing left out: the one thing two saves of the same
    state do not share."""
    out = dict(files)
    for rel, data in files.items():
        if os.path.basename(rel) == MANIFEST and data is not None:
            header, _, rest = data.partition(b"\n")
            try:
                out[rel] = json.dumps(dict(json.loads(header), created=None)).encode() + b"\n" + rest
            except ValueError:
                pass  # not a manifest hpckpt wrote: compared as it is
    return out


def accepted(path: Path) -> bool:
    """`verify` passes or an offline open succeeds: something there is taken for a checkpoint."""
    try:
        ok = api.verify(path)["exit_code"] == 0
    except HpckptError:
        ok = False
    try:
        open_index(path)
        return True
    except HpckptError:
        return ok


def lay_down(folder: Path, files: dict[str, bytes | None]) -> None:
    """A checkpoint `tree` gave, written back."""
    folder.mkdir()
    for rel, data in sorted(files.items()):
        (folder / rel).mkdir(parents=True) if data is None else (folder / rel).write_bytes(data)


@pytest.fixture(scope="module")
def references(zygote, scratch):
    """Per op: an uninterrupted save of variant 0 (its bytes) and of variant 1 (what the saves
    after the kills must write); each rank's calls of a variant-0 save, made over the variant-1
    checkpoint for the ops that replace one."""
    runs = {(op, v): Scenario(f"ref-{op}-{v}", op, scratch / f"ref-{op}-{v}", variant=v, load=True, timeout=60)
            for op in OPS for v in (0, 1)}
    run(zygote, list(runs.values()))
    refs = {}
    for (op, v), sc in runs.items():
        check_clean(sc, f"uninterrupted {op} of variant {v}")
        refs[op, v] = {"tree": tree(sc.path), "calls": [sc.report(r)["calls"] for r in range(WORLD)]}
    traces = {op: Scenario(f"trace-{op}", op, scratch / f"trace-{op}", load=True, timeout=60, old=refs[op, 1]["tree"])
              for op in OPS if OPS[op][2]}
    run(zygote, list(traces.values()))
    for op, sc in traces.items():
        check_clean(sc, f"uninterrupted {op} over an older checkpoint", refs[op, 0]["tree"])
        refs[op, 0]["calls"] = [sc.report(r)["calls"] for r in range(WORLD)]
    return refs


def check_clean(sc: Scenario, where: str, expected: dict | None = None) -> None:
    """Both ranks committed and loaded back bit-exact; the checkpoint alone in its directory
    (no staging, lock or exchange file beside or in it), byte-identical to `expected`."""
    assert not sc.hung and sc.codes == [0, 0], f"{where}\n{sc.log()}"
    reports = [sc.report(r) for r in range(WORLD)]
    assert all(r["ok"] and r["committed"] for r in reports), f"{where}\n{sc.log()}"
    assert [r["load"] for r in reports] == [[], []], f"{where}: not loaded back bit-exact\n{sc.log()}"
    assert sorted(os.listdir(sc.folder)) == [NAME], f"{where}: left beside the checkpoint: {os.listdir(sc.folder)}"
    if expected is not None:
        assert comparable(tree(sc.path)) == comparable(expected), f"{where}: {sorted(tree(sc.path))} differs from an uninterrupted save"


def kill_points(op: str, calls: list[list[str]]) -> list[tuple[int, int]]:
    """POINTS (rank, call number) pairs, drawn with the seed from every call of every rank."""
    every = [(rank, n) for rank, names in enumerate(calls) for n in range(1, len(names) + 1)]
    return sorted(random.Random(f"{SEED}-{op}").sample(every, min(POINTS, len(every))))


def commit_calls(calls: list[str], replacing: bool) -> tuple[int, int]:
    """The coordinator's commit: its last `rename`s (the older checkpoint moved aside, then the
    staging directory onto the destination); killed before the first, the old checkpoint is
    untouched; after the last, the new one is in place."""
    renames = [i for i, name in enumerate(calls, start=1) if name.split("@")[0] == "rename"]
    return (renames[-2] if replacing else renames[-1]), renames[-1]


def check_killed(sc: Scenario, ref: dict, stage: str) -> str:
    """What a kill at `stage` of the commit ('before', 'between' its renames, 'after') left:
    the old checkpoint or nothing, nothing, the new checkpoint; asserts the survivors' ends."""
    rank, n = sc.kill
    where = f"{sc.name} (seed {SEED}, rank {rank} killed at call {n}, {stage} the commit)"
    assert not sc.hung, f"{where}: a rank hangs\n{sc.log()}"
    codes = sc.codes
    assert codes[rank] == -signal.SIGKILL, f"{where}: not killed at its point\n{sc.log()}"
    for other in range(WORLD):
        report = sc.report(other)
        if other == rank:
            continue
        if sc.whole_job:
            assert codes[other] in (0, -signal.SIGKILL), f"{where}: rank {other} exit {codes[other]}\n{sc.log()}"
        else:
            assert codes[other] == 0 and report is not None, f"{where}: rank {other} did not report\n{sc.log()}"
        if report is None:
            continue
        if report["ok"]:  # (a survivor may fail after the commit: its peer died before the last gather)
            assert report["committed"] and stage == "after", f"{where}: rank {other} says committed\n{sc.log()}"
        else:
            assert report["error"] in DOCUMENTED and DOCUMENTED[report["error"]] == report["exit_code"], \
                f"{where}: rank {other} failed with an undocumented error {report}\n{sc.log()}"
            assert report["seconds"] < sc.timeout * 2 + 5, \
                f"{where}: rank {other} gave up after {report['seconds']:.1f} s\n{sc.log()}"
    state = tree(sc.folder)
    for name in (k for k in state if os.sep not in k and k != NAME):  # each one explained, none taken for a checkpoint
        assert leftover(sc.folder / name) is not None, f"{where}: {name} left unexplained: {sorted(state)}"
        assert not accepted(sc.folder / name), f"{where}: {name} is taken for a checkpoint"
    there = {k[len(NAME) + 1:]: v for k, v in state.items() if k.startswith(NAME + os.sep)}
    if stage == "after":
        assert os.path.isdir(sc.path) and comparable(there) == comparable(ref["tree"]), \
            f"{where}: killed after the commit, but not the complete checkpoint: {sorted(state)}"
        assert accepted(sc.path), where
        return "new"
    if stage == "before" and sc.old is not None:
        assert os.path.isdir(sc.path) and there == sc.old, f"{where}: the older checkpoint changed: {sorted(state)}"
        return "old"
    assert not os.path.lexists(sc.path), f"{where}: {NAME} exists: {sorted(state)}"
    assert not accepted(sc.path), where
    return "absent"


@pytest.mark.dist
@pytest.mark.parametrize("op", [f"{op}-seed{SEED}" for op in OPS])
def test_kill_9_of_one_rank_or_the_whole_job_anywhere_in_a_live_save(op, zygote, scratch, references):
    op = op.split("-seed")[0]
    replacing = OPS[op][2]
    ref0, ref1 = references[op, 0], references[op, 1]
    calls = ref0["calls"]
    coordinator = 0
    first, last = commit_calls(calls[coordinator], replacing)
    # and, whatever the seed draws, the commit's renames and the call after them
    fixed = {(coordinator, n) for n in (first, last, last + 1) if n <= len(calls[coordinator])}
    points = sorted(set(kill_points(op, calls)) | fixed)
    killed = [Scenario(f"{op}-{'job' if whole else 'one'}-r{rank}-c{n}", op,
                       scratch / op / f"{'job' if whole else 'one'}-r{rank}-c{n}", kill=(rank, n), whole_job=whole,
                       old=ref1["tree"] if replacing else None)
              for whole in (False, True) for rank, n in points]
    run(zygote, killed)
    seen = []
    for sc in killed:
        rank, n = sc.kill
        stage = "before" if rank != coordinator or n <= first else "between" if n <= last else "after"
        seen.append(check_killed(sc, ref0, stage))
    # the next save, by fresh processes, of other values (variant 1) to the same path
    reruns = [Scenario(f"again-{sc.name}", op, sc.folder, variant=1, load=True, timeout=60) for sc in killed]
    run(zygote, reruns)
    for sc, before in zip(reruns, killed):
        check_clean(sc, f"the save after {before.name} (seed {SEED}, rank {before.kill[0]} killed at call "
                        f"{before.kill[1]})", ref1["tree"])
    errors = sorted({f"{r['error']}: {r['message'][:80]}" for sc in killed for r in map(sc.report, range(WORLD))
                     if r and not r["ok"]})
    threaded = sum(calls[r][n - 1].endswith("@thread") for r, n in points) if OPS[op][0] == "async_save" else 0
    print(f"{op} seed {SEED}: calls per rank {[len(c) for c in calls]}, commit renames at calls {first}-{last} of "
          f"rank {coordinator}; points {points}, {threaded} on async_save's background thread; after the kills: "
          + ", ".join(f"{seen.count(k)} {k}" for k in ("absent", "old", "new")) + "; the survivors' errors:\n  "
          + "\n  ".join(errors))
