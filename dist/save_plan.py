"""A live save's steps 1-3 (see `hpckpt.dist.save`): what each rank holds, described once as a
frozen `SaveRequest`, then the plan every rank agrees on, a frozen `PlannedSave`.

The plan cache lives here: one per process, keyed by every rank's plan digest, so a save whose
names, dtypes, shapes, layouts and values did not change skips building the global plan.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpckpt.core.commit.staging import Staging, shared_staging, staging_for
from hpckpt.core.dtypes import dtype as parse_dtype
from hpckpt.core.errors import GeometryError, HpckptError, SaveError, UnsafePickleError, UnsupportedDTypeError
from hpckpt.core.geometry.global_plan import (
    DEDUP_MODES,
    GlobalPlan,
    LocalPlan,
    LocalValue,
    build_global_plan,
    plan_key,
    values_of,
)
from hpckpt.core.geometry.layout import Mesh, Replicate, TensorLayout
from hpckpt.core.geometry.layout_plan import LayoutTable
from hpckpt.core.geometry.plan import Plan, PlannedValue, plan_as_given
from hpckpt.core.io.memory_source import MemoryTensor
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import as_path
from hpckpt.dist import frameworks
from hpckpt.dist.coordination import (
    DEFAULT_TIMEOUT,
    START,
    Restarted,
    ObjectExchange,
    Storage,
    new_nonce,
    wait_for_start,
    write_json,
)
from hpckpt.dist.flatten import flatten
from hpckpt.dist.job import Job, job_identity, this_job
from hpckpt.dist.output_formats import OutputFormat, output_format
from hpckpt.dist.shards import shards_of
from hpckpt.dist.stateful import is_stateful, resolve

COORDINATIONS = ("collectives", "storage", "none")


class _PlanCache:
    """The global plans this process built, oldest first, each with every rank's digest that made
    it; the oldest go beyond `size`."""

    def __init__(self, size: int):
        self.size = size
        self._plans: dict[str, GlobalPlan] = {}
        self._digests: dict[str, tuple[str, ...]] = {}

    def keys(self) -> list[str]:
        return list(self._plans)

    def holds_part(self, rank: int, world_size: int, digest: str) -> bool:
        """Some cached plan was made with this rank's part exactly as it is now."""
        return any(len(d) == world_size and d[rank] == digest for d in self._digests.values())

    def get(self, key: str) -> GlobalPlan | None:
        return self._plans.get(key)

    def put(self, key: str, plan: GlobalPlan, digests: tuple[str, ...]) -> None:
        self._plans[key], self._digests[key] = plan, digests
        while len(self._plans) > self.size:
            self._digests.pop(self._plans.pop(next(iter(self._plans))).key, None)


_plans = _PlanCache(8)
_saves_made: dict[str, int] = {}  # path -> saves this process made to it (every rank makes the same)


@dataclass
class _Local:
    """What this rank saves: its plan, the arrays of its shards and its values' pickles."""

    plan: LocalPlan
    tensors: dict[str, MemoryTensor]
    payloads: dict[str, bytes]
    rows: list  # (fqn, dtype name, shape, boxes) per tensor
    paths: dict[str, tuple]
    layouts: list  # per tensor: its Shards' layout (global ranks), "replicated" (held whole), or None
    table: LayoutTable | None = None  # every tensor's layout, checked against its boxes (`layout_table`)


def _describe(flat: dict, paths: dict, fw, rank: int, global_rank: int, *, stage: bool, fmt: OutputFormat) -> _Local:
    """Find each tensor's boxes, make each value's payload in the output format (proving, for
    HyperParallel, that hpckpt's safe unpickler reads it back). `stage`: copy every shard
    (async_save)."""
    rows, tensors, payloads, values, layouts = [], {}, {}, [], []
    for fqn, obj in flat.items():
        if frameworks.is_any_tensor(obj):
            shards = shards_of(fqn, obj, fw, global_rank)
            if shards.dtype.refusal:
                raise UnsupportedDTypeError(f"{fqn}: {shards.dtype.name} cannot be saved: {shards.dtype.refusal}")
            pieces = [(box, fw.to_numpy(t, copy=stage)) for box, t in shards.pieces]
            rows.append((fqn, shards.dtype.name, shards.shape, [b for b, _ in pieces]))
            layouts.append("replicated" if shards.replicated else shards.layout)
            if pieces:
                tensors[fqn] = MemoryTensor(shards.dtype, shards.shape, pieces)
        else:
            try:
                payload = fmt.payload(obj, fqn)
            except (HpckptError, pickle.PicklingError, AttributeError, TypeError, ValueError) as exc:
                if is_stateful(obj):
                    raise UnsafePickleError(
                        f"{fqn}: a {type(obj).__name__} (a Stateful object) inside another Stateful's state_dict() "
                        "cannot be saved", hint="return its state_dict() there instead, or put it at the top "
                        "of the state dict") from None
                raise UnsafePickleError(
                    f"{fqn}: a {type(obj).__name__} value cannot be saved: {fmt.cannot} ({error_text(exc)})",
                    hint="save plain Python values (numbers, strings, lists, dicts, tuples) or tensors") from None
            payloads[fqn] = payload
            values.append(LocalValue(fqn, len(payload), hashlib.sha256(payload).hexdigest()))
    if stage and hasattr(fw, "after_staging"):  # non-blocking copies to pinned memory are done
        fw.after_staging()
    return _Local(LocalPlan.build(rank, rows, values, paths), tensors, payloads, rows, paths, layouts)


def layout_table(local: _Local, rank: int, world_size: int, ranks_are_global: bool) -> LayoutTable | None:
    """Every tensor of this rank as a layout over the job's ranks, each checked to give exactly
    this rank's boxes; None when one has no such layout (HyperParallel `chunk_info`, a ragged
    or strided shard, a mesh given in global ranks of a job that is a subgroup). A plain tensor
    is replicated on every rank. The ranks then send their boxes instead."""
    if not local.rows:
        return None
    everyone = None
    rows = []
    for (fqn, dt, shape, boxes), layout in zip(local.rows, local.layouts):
        if layout == "replicated":
            everyone = everyone or TensorLayout(Mesh((world_size,)), (Replicate(),))
            layout = everyone
        elif layout is None or not ranks_are_global or max(layout.mesh.ranks) >= world_size:
            return None
        try:
            if layout.boxes(shape, rank) != list(boxes):
                return None
        except GeometryError:
            return None
        rows.append((fqn, dt, tuple(shape), layout))
    names = {row[0] for row in rows}
    return LayoutTable(rows, {fqn: path for fqn, path in local.plan.nesting.items() if fqn in names})


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """Step 1 on this rank: what it saves and how, before any exchange. A rank whose state cannot
    be saved keeps its error (`local_error`) and reports it to every rank in the first exchange."""

    path: Path
    job: Job
    framework: Any
    format: OutputFormat
    coordination: str
    exchange: str  # what the exchanges go through: "collectives", "storage" or "none"
    dedup: str
    coordinator: int
    use_cache: bool
    asynchronous: bool
    timeout: float
    progress: Any
    started: float
    local: _Local | None
    local_error: BaseException | None
    spool: Path | None = None  # (a checkpoint in an object store) where this rank's files are written: `persist`

    @property
    def is_coordinator(self) -> bool:
        return self.job.rank == self.coordinator

    @property
    def remote(self) -> bool:
        """The checkpoint is in an object store."""
        return is_object(self.path)

    @property
    def staging_path(self) -> Path:
        """Where this rank writes its files: the shared staging directory, or its spool."""
        return self.spool if self.spool is not None else shared_staging(self.path)

    def storage(self, nonce: str, token: str) -> Storage:
        if self.remote:  # exchange objects beside the checkpoint
            return ObjectExchange(self.path.parent / f".{self.path.name}.hpckpt-exchange", self.job.rank,
                                  self.job.world_size, nonce, self.timeout, coordinator=self.coordinator, token=token)
        return Storage(self.staging_path, self.job.rank, self.job.world_size, nonce, self.timeout,
                       coordinator=self.coordinator, token=token)


def describe(state_dict, checkpoint_id, *, process_group, coordinator, coordination, dedup, plan_cache, timeout,
             asynchronous, progress=None, no_dist=False, format="hyperparallel") -> SaveRequest:
    """Step 1: check the options, resolve Stateful objects, flatten, find every tensor's boxes and
    make every value's payload (a copy of every shard for an async save)."""
    if coordination not in COORDINATIONS:
        raise ValueError(f"coordination must be one of {', '.join(COORDINATIONS)}, not {coordination!r}")
    fmt = output_format(format, coordination)
    if dedup not in DEDUP_MODES:
        raise ValueError(f"dedup must be one of {', '.join(DEDUP_MODES)}, not {dedup!r}")
    started = time.perf_counter()
    local_error = local = None
    try:
        flat, paths = flatten(resolve(state_dict, frameworks.is_any_tensor).view, frameworks.is_any_tensor)
        framework = frameworks.of_state(flat)
    except Exception as exc:
        local_error, flat, paths, framework = exc, {}, {}, frameworks.of_state({})
    job = this_job(framework, process_group, need_collectives=coordination == "collectives", no_dist=no_dist)
    if not 0 <= coordinator < job.world_size:
        raise ValueError(f"coordinator {coordinator} is not a rank of this job of {job.world_size}")
    # an async save under a launcher that names the job plans on its thread through files, so the
    # caller waits for nothing but its own copy
    exchange = coordination
    path = as_path(checkpoint_id)
    remote = is_object(path)
    if remote and coordination != "collectives":
        raise ValueError(f"coordination={coordination!r} writes through a shared file system; a checkpoint in an "
                         "object store is saved with coordination='collectives'")
    if asynchronous and coordination == "collectives" and job.world_size > 1 and job_identity() and not remote:
        exchange = "storage"
    if local_error is None:
        try:
            local = _describe(flat, paths, framework, job.rank, job.global_rank(job.rank), stage=asynchronous, fmt=fmt)
            local.table = layout_table(local, job.rank, job.world_size,
                                       ranks_are_global=job.comm is None or bool(getattr(job.comm, "is_world", False)))
        except Exception as exc:  # reported to every rank in the first exchange
            local_error = exc
    return SaveRequest(path=path if remote else path.absolute(), job=job, framework=framework, format=fmt,
                       coordination=coordination, exchange=exchange, dedup=dedup, coordinator=coordinator,
                       use_cache=plan_cache and coordination != "none", asynchronous=asynchronous,
                       timeout=DEFAULT_TIMEOUT if timeout is None else float(timeout), progress=progress,
                       started=started, local=local, local_error=local_error)


@dataclass(frozen=True, kw_only=True)
class PlannedSave:
    """Steps 2-3 done: the plan every rank agreed on (or this rank's own, rank-local), and the
    resources the save holds until it ends: the coordinator's staging directory and its lock
    (`resources`, closed by the committer or when planning fails)."""

    request: SaveRequest
    save_id: str = ""  # the save's name in the exchange files (storage coordination)
    nonce: str = ""
    token: str = ""
    global_plan: GlobalPlan | None = None
    rank_local_plan: Plan | None = None
    lengths: dict[str, int] = field(default_factory=dict)
    staging: Staging | None = None
    cache_state: str = "off"
    plan_from: str = ""  # "layouts", "boxes" (what the ranks sent), "cache"; "" rank-local
    planning: float = 0.0
    resources: ExitStack = field(default_factory=ExitStack, repr=False)


def plan_save(request: SaveRequest) -> PlannedSave:
    """Steps 2-3; whatever they opened is released if they fail."""
    save_id = _save_id(request.path, request.job) if request.exchange == "storage" else ""
    _saves_made[str(request.path)] = _saves_made.get(str(request.path), 0) + 1
    if request.coordination == "none":
        return _plan_rank_local(request)
    resources = ExitStack()
    try:
        return _plan_with_restarts(request, resources, save_id)
    except BaseException:
        resources.close()
        raise


def plan_again(planned: PlannedSave) -> PlannedSave:
    """After the coordinator restarted a save this rank had joined: the same save, planned anew."""
    return _plan_with_restarts(planned.request, planned.resources, planned.save_id)


def _plan_with_restarts(request: SaveRequest, resources: ExitStack, save_id: str) -> PlannedSave:
    for _attempt in range(3):
        try:
            return _plan_together(request, resources, save_id)
        except Restarted:  # the coordinator began the save anew: join the new attempt
            continue
    raise SaveError("storage coordination: the coordinator restarted the save three times")


def _save_id(path: Path, job: Job) -> str:
    """The same name for this save on every rank: the job's identity and how many saves to this
    path it made before (every rank makes the same sequence of saves)."""
    identity = job_identity()
    if identity is None:
        raise ValueError("storage coordination needs a job identity shared by every rank: set HPCKPT_JOB_ID "
                         "(torchrun sets TORCHELASTIC_RUN_ID)")
    return f"{identity}#{job.world_size}#{_saves_made.get(str(path), 0)}"


def _open_staging(request: SaveRequest, resources: ExitStack, save_id: str) -> tuple[Staging, str]:
    """The coordinator: the destination locked, a fresh shared staging directory, its nonce."""
    staging = resources.enter_context(staging_for(request.path, force=True, sync=True, parents=True, shared=True))
    nonce = new_nonce()
    if not request.remote:  # (an object store's save plans over the process group only)
        write_json(staging.path / START, {"nonce": nonce, "save": save_id})
    return staging, nonce


def _plan_together(request: SaveRequest, resources: ExitStack, save_id: str) -> PlannedSave:
    t0 = time.perf_counter()
    nonce, setup_error, staging = "", None, None
    if request.is_coordinator and (request.local_error is None or request.exchange == "storage"):
        try:
            staging, nonce = _open_staging(request, resources, save_id)
        except Exception as exc:
            setup_error = exc
    if request.exchange == "storage" and not request.is_coordinator:
        nonce = wait_for_start(request.staging_path, save_id, request.timeout, request.coordinator)
    if request.exchange == "storage" and request.is_coordinator and not nonce:
        raise setup_error or request.local_error  # the others time out waiting for the start
    token = new_nonce()  # this attempt's, for the exchange files
    exchange = request.storage(nonce, token) if request.exchange == "storage" else request.job.collectives()
    error = request.local_error or setup_error
    digest = request.local.plan.digest() if request.local else ""
    rank, world = request.job.rank, request.job.world_size
    held = _plans.keys() if request.use_cache else []
    # this rank's part is unchanged from a cached plan: no need to send it (the others may need
    # it all the same, then it is sent in a second round)
    expect_hit = bool(held) and _plans.holds_part(rank, world, digest)
    # a rank whose tensors all have layouts sends only the digest of its table (plus its values):
    # when every rank's digest is the same, every rank already holds the table, and the plan
    # follows from it (`core.geometry.layout_plan`) without a box crossing the network
    table = None if error else request.local.table
    mine = {"error": error_text(error) if error else None, "nonce": nonce, "digest": digest, "cached": held,
            "plan": None if (expect_hit or error or table is not None) else request.local.plan.to_json()}
    if table is not None:
        plan = request.local.plan
        mine["table"] = table.digest()
        mine["values"] = [[v.fqn, v.nbytes, v.digest] for v in plan.values]
        mine["value_paths"] = {v.fqn: list(plan.nesting[v.fqn]) for v in plan.values if v.fqn in plan.nesting}
    answers = exchange.all_gather("plan", mine, "send a plan")
    if error is not None:
        raise error  # this rank's own error as it is; the others raise a SaveError naming this rank
    raise_reported(answers, "save refused before writing")
    nonce = answers[request.coordinator]["nonce"]
    digests = tuple(a["digest"] for a in answers)
    key = plan_key(digests, {"dedup": request.dedup, "world_size": request.job.world_size})
    # a hit only when every rank still holds this very plan: decided from what all gathered,
    # so every rank decides alike (one rank's cache may have lost it)
    cached = _plans.get(key) if request.use_cache and all(key in a["cached"] for a in answers) else None
    if cached is not None:
        global_plan, cache_state, plan_from = cached, "hit", "cache"
    else:
        if table is not None and all(a.get("table") == mine["table"] for a in answers):
            global_plan, plan_from = _from_layouts(table, answers, request, key), "layouts"
        else:
            if any(a["plan"] is None for a in answers):
                answers = exchange.all_gather("plan-full", {"plan": request.local.plan.to_json()}, "send a plan")
            plans = [LocalPlan.from_json(a["plan"]) for a in answers]
            global_plan, plan_from = build_global_plan(plans, dedup=request.dedup, key=key), "boxes"
        cache_state = "miss" if request.use_cache else "off"
        if request.use_cache:
            _plans.put(key, global_plan, digests)
    return PlannedSave(request=request, save_id=save_id, nonce=nonce, token=token, global_plan=global_plan,
                       staging=staging, cache_state=cache_state, plan_from=plan_from,
                       planning=time.perf_counter() - t0, resources=resources)


def _from_layouts(table: LayoutTable, answers: list[dict], request: SaveRequest, key: str) -> GlobalPlan:
    """The global plan from the table every rank holds alike and each rank's values."""
    values, lengths = values_of((r, [LocalValue(str(f), int(n), str(d)) for f, n, d in a["values"]])
                                for r, a in enumerate(answers))
    nesting: dict[str, tuple] = {}
    for a in answers:
        for fqn, path in a["value_paths"].items():
            nesting.setdefault(fqn, tuple(path))
    return table.plan(request.job.world_size, dedup=request.dedup, values=values, value_lengths=lengths,
                      nesting=nesting, key=key)


def _plan_rank_local(request: SaveRequest) -> PlannedSave:
    """`coordination="none"`: this rank's items alone, no de-dup, `{rank}.metadata`."""
    if request.local_error is not None:
        raise request.local_error
    rank, local = request.job.rank, request.local
    plan = plan_as_given(
        {fqn: (parse_dtype(dt), shape, [(rank, box) for box in boxes]) for fqn, dt, shape, boxes in local.rows},
        rank + 1, values=[PlannedValue(fqn, rank) for fqn in local.payloads], nesting=local.paths, producing=(rank,))
    return PlannedSave(request=request, rank_local_plan=plan, lengths={fqn: len(p) for fqn, p in local.payloads.items()})


def raise_reported(answers: list[dict], what: str) -> None:
    """Raise on every rank when some rank reported an error."""
    failed = [(r, a["error"]) for r, a in enumerate(answers) if a.get("error")]
    if failed:
        rank, message = failed[0]
        more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise SaveError(f"{what}: rank {rank}: {message}{more}", hint="nothing was committed")


def error_text(exc: BaseException) -> str:
    """How a rank reports its error to the others (one line, no traceback)."""
    return exc.message if isinstance(exc, HpckptError) else f"{type(exc).__name__}: {exc}"
