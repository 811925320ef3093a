"""`hpckpt run ... reshard`: the offline reshard spread over the launched workers.

Every worker opens the source and plans the same target; the target ranks are shared out by the
bytes each writes (`assign_shares`), each worker writes its share with the offline fan-out
(`api.reshard(ranks=...)`: its files go straight into the destination, the shares share its lock)
and the coordinator (worker 0) finalizes once every share is there. The output is the one a
single-process `hpckpt reshard` writes, byte for byte.

Workers that see different sources (nodes that do not share one) write fragments of different
plans, which finalize refuses (`CorruptMetadataError`). The workers agree at four points (`comm.all_gather_json`), so that every worker ends with the same
verdict and none is left waiting in a collective: planned, destination prepared, shares written,
finalized. A failure on any worker is carried to the next agreement point, never raised alone
(the launcher stops the other workers as soon as one reports a failure); then every worker raises
it, naming the worker. The run writes a whole output or none: the coordinator removes what the
shares wrote when one failed, and puts back an old destination it had moved aside for `--force`.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence

from hpckpt.core import job_files
from hpckpt.core.commit.set_aside import SetAside
from hpckpt.core.errors import HpckptError, ReshardOptionError, WorkerFailedError
from hpckpt.core.geometry.assign import least_loaded
from hpckpt.core.storage.urls import as_path

COORDINATOR = 0
#: What a share's write leaves out, converts or warns of: each writing worker's result carries
#: its own lists, and the report of every node says them once (`cli/run/report.py`).
NOTES = job_files.RESULT_NOTES


# -- the share of each worker (pure) -------------------------------------------------------------


def assign_shares(rank_bytes: Sequence[int], workers: int) -> list[tuple[int, ...]]:
    """Target ranks per worker: largest first, each to the least-loaded worker (ties: the one
    with fewer ranks, then the lower worker), so the bytes written are balanced, not only the
    rank count, and ranks that write nothing are still spread. Deterministic: every worker
    computes the same shares. Workers beyond the number of ranks get none."""
    if workers < 1:
        raise ValueError("at least one worker")
    shares: list[list[int]] = [[] for _ in range(workers)]
    order = sorted(range(len(rank_bytes)), key=lambda r: (-rank_bytes[r], r))
    everyone = range(workers)
    chosen = least_loaded([0] * workers, ((everyone, rank_bytes[r]) for r in order), counts=[0] * workers)
    for rank, worker in zip(order, chosen):
        shares[worker].append(rank)
    return [tuple(sorted(share)) for share in shares]


def first_failure(answers: Sequence[dict]) -> dict | None:
    """The failure of the lowest worker whose answer carries one (`{"worker", "kind", ...}`)."""
    for worker, answer in enumerate(answers):
        if answer.get("error"):
            return {"worker": worker, **answer["error"]}
    return None


def raised(failure: dict, rank: int) -> WorkerFailedError:
    """The error worker `rank` raises for `failure`."""
    return WorkerFailedError(failure["worker"], failure["kind"], failure["exit_code"], failure["message"],
                             failure.get("hint"), mine=rank == failure["worker"])


def _error_record(exc: BaseException) -> dict:
    if isinstance(exc, HpckptError):
        return {"kind": exc.kind, "exit_code": exc.exit_code, "message": exc.message, "hint": exc.hint}
    return {"kind": "internal", "exit_code": 1, "message": f"{type(exc).__name__}: {exc}", "hint": None}


def _attempt(step: Callable[[], object], log: Callable[[str], None]) -> tuple[object, dict | None]:
    """Run `step`; its failure is returned (and its traceback logged), not raised: it must
    reach the other workers at the next agreement point first."""
    try:
        return step(), None
    except Exception as exc:  # noqa: BLE001 - every failure is carried to the others
        if not isinstance(exc, HpckptError):
            log(traceback.format_exc())
        return None, _error_record(exc)


def _agree(ctx, answer: dict) -> list[dict]:
    """Gather every worker's answer; raise the first failure on every worker."""
    answers = ctx.comm.all_gather_json(answer)
    failure = first_failure(answers)
    if failure is not None:
        raise raised(failure, ctx.rank) from None
    return answers


# -- the steps ------------------------------------------------------------------------------------


class _Job:
    """One worker's part of the reshard: what it planned and what it wrote."""

    def __init__(self, spec: dict, ctx):
        from hpckpt.api import Selection, WriteSettings, parse_size

        self.spec, self.ctx = spec, ctx
        self.src, self.dst = as_path(spec["src"]), as_path(spec["out"])
        self.select = Selection.of(spec.get("include"), spec.get("exclude"))
        self.settings = WriteSettings(max_memory=parse_size(spec.get("max_memory") or "64MiB"),
                                      sync=not spec.get("no_fsync"), parents=bool(spec.get("parents")),
                                      manifest=not spec.get("no_manifest"), progress=ctx.progress)
        self.target = {"to": spec.get("to") or "hyperparallel", "keep_replicas": bool(spec.get("keep_replicas"))}
        self.index = self.layout = None
        self.replacing = SetAside(self.dst, bool(spec.get("force")))

    def plan(self, coordinator: bool) -> list[int] | None:
        """Open the source and build the target layout; the coordinator also plans the whole
        output and returns the bytes each target rank writes (a plan of a large source takes
        seconds: the others plan only their share, when they write it)."""
        from hpckpt import api
        from hpckpt.api.layouts import layout_spec
        from hpckpt.converters import open_index

        self.ctx.phase(f"reading metadata of {self.src}")
        self.index = open_index(self.src)
        self.ctx.phase("planning")
        s = self.spec
        try:
            self.layout = layout_spec(self.index, s.get("world_size"), s.get("split") or "balanced",
                                               s.get("mesh"), s.get("placements"), s.get("rules"),
                                               s.get("layout_files"), bool(s.get("keep_layout")))
        except Exception as exc:  # ValueError: the options, not the data
            if isinstance(exc, HpckptError):
                raise
            raise ReshardOptionError(str(getattr(exc, "message", None) or exc)) from None
        if not coordinator:
            return None
        report = api.reshard(self.src, self.dst, self.layout, select=self.select, framework=s.get("framework"),
                             dtype=s.get("dtype"), dry_run=True, index=self.index, **self.target)
        stored = {r.rank: r.bytes_written for r in report.plan.ranks}
        return [stored.get(rank, 0) for rank in range(report.plan.world_size)]

    def prepare(self) -> None:
        """The coordinator, before any share is written: refuse an existing destination (or, with
        --force, set an output hpckpt recognises aside, put back if the run fails)."""
        self.replacing.prepare()

    def write(self, ranks: tuple[int, ...]) -> dict:
        """This worker's share, straight into the destination (`core.commit.fan_out.Fragment`)."""
        from hpckpt import api

        if not ranks:
            self.ctx.progress.start(0)
            return {"bytes_written": 0, "bytes_read": 0, "files": 0, **{name: [] for name in NOTES}}
        self.ctx.phase(f"writing target ranks {_ranks_text(ranks)}")
        s = self.spec
        report = api.reshard(self.src, self.dst, self.layout, select=self.select, ranks=ranks,
                             framework=s.get("framework"), dtype=s.get("dtype"), settings=self.settings,
                             index=self.index, **self.target)
        return {"bytes_written": report.bytes_written, "bytes_read": report.bytes_read, "files": report.files,
                **{name: report[name] for name in NOTES}}

    def finalize(self) -> int:
        """The coordinator: the metadata, once every share is there; the old output goes."""
        from hpckpt import api

        self.ctx.phase("finalizing")
        report = api.finalize(self.dst)
        self.replacing.finished()
        return len(report.written)

    def undo(self) -> None:
        """The coordinator, after a failure: nothing of this run left, the old output back."""
        self.replacing.undo()


def _ranks_text(ranks: Sequence[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks from {min(ranks)} to {max(ranks)}"


def run(spec: dict, ctx) -> dict:
    """This worker's part of `hpckpt run ... reshard`; returns its figures."""
    from hpckpt.core.commit.lock import reading

    started = time.perf_counter()
    coordinator = ctx.rank == COORDINATOR
    job = _Job(spec, ctx)
    with reading(job.src):  # the source may not be replaced while any worker reads it
        rank_bytes, error = _attempt(lambda: job.plan(coordinator), ctx.log)
        rank_bytes = _agree(ctx, {"error": error, "rank_bytes": rank_bytes})[COORDINATOR]["rank_bytes"]
        mine = assign_shares(rank_bytes, ctx.world_size)[ctx.rank]

        _, error = _attempt(job.prepare, ctx.log) if coordinator else (None, None)
        _agree(ctx, {"error": error})

        figures, error = _attempt(lambda: job.write(mine), ctx.log)
        failure = first_failure(ctx.comm.all_gather_json({"error": error}))
        files = None
        if coordinator:
            if failure is None:
                files, error = _attempt(job.finalize, ctx.log)
                failure = {"worker": COORDINATOR, **error} if error else None
            if failure is not None:
                _, error = _attempt(job.undo, ctx.log)
                if error:
                    ctx.log(f"could not remove the unfinished output {job.dst}: {error['message']}")
        outcome = ctx.comm.all_gather_json({"failure": failure})[COORDINATOR]["failure"]
    if outcome is not None:
        raise raised(outcome, ctx.rank)
    result = {"target_ranks": list(mine), **figures, "seconds": round(time.perf_counter() - started, 3)}
    if coordinator:
        result.update(finalized=True, output_files=files)
    return result
