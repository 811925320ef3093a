"""Ranks of a live save with their file-system calls counted, for tests/test_dist_kill.py.

    python kill_job.py        # a zygote: reads one JSON spec a line on stdin, forks a rank for each

The zygote imports torch and hpckpt once, so a rank starts in milliseconds, not the ~2 s of a
fresh Python with torch. On stdout it answers each spec with `{"id": ID, "pid": PID}` and tells
each rank's end with `{"pid": PID, "exit": CODE}` (CODE -9: SIGKILLed); it exits at the end of
its input.

Each rank (`run_rank`) joins a gloo process group (a `FileStore` in the scenario's work
directory: no port to race for), wraps the file-system calls with `kill_harness` (SIGKILLing
itself before call `spec["kill_at"]`), saves `rank_state(rank, variant)` with `hpckpt.dist.save`
or `async_save`, and writes to `spec["report"]` (JSON) its calls by name (`NAME@thread`: made on
async_save's background thread) and the outcome, or the error's class, exit code and message.
With `spec["load"]` it then loads the checkpoint into zeros and reports every tensor or value
that did not come back bit-exact.
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kill_harness, beside the tests

import hpckpt.dist as hdist
import hpckpt.dist.frameworks.torch_tensors  # noqa: F401 - imported by the first save otherwise (DTensor: seconds)
import kill_harness as kh
import torch
import torch.distributed as tdist

WORLD = 2
W_SHAPE, B_SHAPE = (6, 4), (5,)


def _rows(n: int, rank: int) -> slice:
    """The balanced split of `n` rows over WORLD ranks (HyperParallel's rule: 3,2 for 5)."""
    base, extra = divmod(n, WORLD)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def full_state(variant: int) -> dict:
    """The global tensors and values every rank's part is cut from; `variant` changes them all."""
    w = torch.arange(24, dtype=torch.float32).reshape(W_SHAPE) * 0.5 + variant
    b = (torch.arange(5, dtype=torch.float32) - 2.25 + variant).to(torch.bfloat16)
    e = torch.full((3, 3), 7.0 + variant)
    return {"w": w, "b": b, "e": e, "step": torch.tensor(3.0 + variant), "ids": torch.arange(4) * (variant + 1)}


def rank_state(rank: int, variant: int) -> dict:
    """Rank `rank`'s state dict: `w` and `b` row-sharded, `e` and `step` replicated, `ids` only
    on rank 1, and values, one of them each rank's own."""
    g = full_state(variant)
    state = {
        "model": {"w": hdist.sharded(g["w"][_rows(6, rank)].clone(), W_SHAPE, mesh=(WORLD,), placements="S0"),
                  "b": hdist.sharded(g["b"][_rows(5, rank)].clone(), B_SHAPE, mesh=(WORLD,), placements="S0"),
                  "e": g["e"].clone()},
        "optim": {"step": g["step"].clone(), "lr": 0.1 * (variant + 1), "betas": (0.9, 0.95)},
        "notes": {f"r{rank}": f"rank {rank}, variant {variant}"},
    }
    if rank == 1:
        state["model"]["ids"] = g["ids"].clone()
    return state


def _zeros_like(state: dict) -> dict:
    """`state` with every tensor zeroed (a fresh copy) and every value None: a load target."""
    def blank(x):
        if isinstance(x, hdist.Sharded):
            return hdist.sharded(torch.zeros_like(x.local), x.shape, layout=x.layout)
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: blank(v) for k, v in x.items()}
        return None
    return blank(state)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _differences(got, want, where: str = "") -> list[str]:
    if isinstance(want, hdist.Sharded):
        return _differences(got.local, want.local, where)
    if isinstance(want, torch.Tensor):
        same = got.dtype == want.dtype and got.shape == want.shape and torch.equal(_bits(got), _bits(want))
        return [] if same else [f"{where}: got {got!r}, want {want!r}"]
    if isinstance(want, dict):
        return [d for k in want for d in _differences(got.get(k), want[k], f"{where}.{k}")]
    return [] if (type(got) is type(want) and got == want) else [f"{where}: got {got!r}, want {want!r}"]


def _error(exc: BaseException) -> dict:
    return {"error": type(exc).__name__, "exit_code": getattr(exc, "exit_code", None),
            "message": str(getattr(exc, "message", exc)).splitlines()[0][:500]}


def run_rank(spec: dict) -> None:
    """One rank of one scenario (see the module docstring); never raises."""
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the zygote's pipes
    os.dup2(log, 1)
    os.dup2(log, 2)
    rank = spec["rank"]
    os.environ["HPCKPT_JOB_ID"] = spec["job"]  # what async_save's file exchange names the job by
    torch.set_num_threads(1)
    report: dict = {"rank": rank, "pid": os.getpid()}
    tdist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=WORLD,
                             timeout=timedelta(seconds=spec["timeout"]))
    state = rank_state(rank, spec["variant"])
    names: list[str] = []
    counter = kh.install(kh.Actions(kill_at=kh.Point(spec["kill_at"]) if spec.get("kill_at") else None))
    count = counter.before

    def before(name: str) -> None:
        names.append(name if threading.current_thread() is threading.main_thread() else f"{name}@thread")
        count(name)

    counter.before = before
    options = {"coordination": spec["coordination"], "timeout": spec["timeout"]}
    started = time.monotonic()
    try:
        if spec["op"] == "save":
            result = hdist.save(state, spec["path"], **options)
        else:
            handle = hdist.async_save(state, spec["path"], **options)
            state["model"]["w"].local.add_(1000)  # the caller may change its tensors once it returned
            result = handle.result(timeout=spec["timeout"] * 4 + 30)
        report.update(ok=True, committed=result.committed)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report.update(ok=False, **_error(exc))
    report["seconds"] = time.monotonic() - started
    for name, real in kh._REAL.items():  # the calls below are the test's, not the save's
        setattr(os, name, real)
    report["calls"] = names
    if spec.get("load") and report["ok"]:
        want = rank_state(rank, spec["variant"])
        target = _zeros_like(want)
        try:
            hdist.load(target, spec["path"])
            report["load"] = _differences(target, want)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report["load"] = [f"load raised {_error(exc)}"]
    out = Path(spec["report"])  # written aside and renamed: a rank killed meanwhile leaves no half report
    out.with_name(out.name + ".tmp").write_text(json.dumps(report))
    os.replace(out.with_name(out.name + ".tmp"), out)
    sys.stdout.flush()
    sys.stderr.flush()
    # a forked rank of the kill sweep, whose peers the test kills on purpose: it leaves as a forked
    # child must, without the zygote's interpreter teardown (atexit, gloo waiting for a dead peer)
    os._exit(0)


def serve() -> None:
    """The zygote's loop, one thread (a fork copies no other): start ranks, report their ends."""
    pending = b""
    ranks: set[int] = set()
    stdin = sys.stdin.fileno()
    open_input = True
    while open_input or ranks:
        readable, _, _ = select.select([stdin] if open_input else [], [], [], 0.005)
        if readable:
            chunk = os.read(stdin, 1 << 16)
            open_input = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                spec = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    try:
                        run_rank(spec)
                    finally:
                        os._exit(70)  # run_rank never returns; a crash in it is still an exit code
                ranks.add(pid)
                _say({"id": spec["id"], "pid": pid})
        while ranks:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            ranks.discard(pid)
            _say({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})


def _say(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


if __name__ == "__main__":
    serve()
