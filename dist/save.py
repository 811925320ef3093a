"""`save` and `async_save`: every rank writes its own shards; the coordinator commits.

1. Each rank describes what it holds (`LocalPlan`) and checks that each value can be read back by
   hpckpt's safe unpickler, before any byte is written.
2. The coordinator takes the destination's lock and creates the staging directory every rank
   shares (`.NAME.hpckpt-tmp-dist`, `core.commit.Staging`), removing what a killed save left.
3. The local plans are gathered (`coordination`), and every rank builds the same global plan
   (`core.global_plan`), or takes it from the plan cache when every rank's part is unchanged.
4. Each rank writes the files of the boxes it stores through the HyperParallel writer and the
   engine (`core.engine`), fsynced, and reports them.
5. Once every rank has reported, the coordinator checks the files, writes `.metadata` last and
   renames the staging directory into place. Until then there is nothing at the destination
   that loads or verifies; a job that dies leaves only the staging directory, which the next
   save to the same path removes.

`async_save` does step 1 in the caller (with a CPU copy of the shards, in pinned memory when
they are on an accelerator), returns, and does the rest on a thread, exchanging through files
(never through the training job's process group). Without a job identity for the files
(`HPCKPT_JOB_ID`, torchrun's run id), steps 2-3 stay in the caller, over the process group.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpckpt.converters import index_cache
from hpckpt.converters.hyperparallel.writer import tensor_file, values_file
from hpckpt.core.io.accounting import check_written
from hpckpt.core.commit import manifest
from hpckpt.core.commit.staging import Staging, shared_staging
from hpckpt.core.commit.durable import fsync_path, write_error, write_file
from hpckpt.core.errors import HpckptError, SaveError, UnsafePickleError, UnsupportedDTypeError
from hpckpt.core.geometry.global_plan import DEDUP_MODES, GlobalPlan, LocalPlan, LocalValue, build_global_plan, plan_key
from hpckpt.core.dtypes import dtype as parse_dtype
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.geometry.plan import PlannedValue, plan_as_given
from hpckpt.core.io.output import Finished
from hpckpt.core.io.write import WriteSettings, fill, lay_out
from hpckpt.dist.coordination import (
    DEFAULT_TIMEOUT,
    START,
    Restarted,
    Storage,
    confirm_and_wait,
    new_nonce,
    wait_for_start,
    write_json,
)
from hpckpt.dist import frameworks, manifest_parts
from hpckpt.dist.call_forms import checkpoint_path, coordination_of, format_of, refuse_torch_only
from hpckpt.dist.flatten import flatten
from hpckpt.dist.stateful import is_stateful, resolve
from hpckpt.dist.job import Job, job_identity, this_job
from hpckpt.dist.output_formats import OutputFormat, output_format
from hpckpt.dist.results import AsyncSaveHandle, SaveResult
from hpckpt.dist.shards import shards_of

COORDINATIONS = ("collectives", "storage", "none")
_CACHE_SIZE = 8
_plan_cache: dict[str, GlobalPlan] = {}  # key -> plan, oldest first
_plan_digests: dict[str, tuple[str, ...]] = {}  # key -> every rank's digest that made the plan
_sequence: dict[str, int] = {}  # path -> saves this process made to it (every rank makes the same)
_in_flight: list[AsyncSaveHandle] = []
_lock = threading.Lock()


@dataclass
class _Local:
    """What this rank saves: its plan, the arrays of its shards and its values' pickles."""

    plan: LocalPlan
    tensors: dict[str, MemoryTensor]
    payloads: dict[str, bytes]
    rows: list  # (fqn, dtype name, shape, boxes) per tensor
    paths: dict[str, tuple]


def _describe(flat: dict, paths: dict, fw, rank: int, global_rank: int, *, stage: bool, fmt: OutputFormat) -> _Local:
    """Find each tensor's boxes, make each value's payload in the output format (proving, for
    HyperParallel, that hpckpt's safe unpickler reads it back). `stage`: copy every shard
    (async_save)."""
    rows, tensors, payloads, values = [], {}, {}, []
    for fqn, obj in flat.items():
        if frameworks.is_any_tensor(obj):
            shards = shards_of(fqn, obj, fw, global_rank)
            if shards.dtype.refusal:
                raise UnsupportedDTypeError(f"{fqn}: {shards.dtype.name} cannot be saved: {shards.dtype.refusal}")
            pieces = [(box, fw.to_numpy(t, copy=stage)) for box, t in shards.pieces]
            rows.append((fqn, shards.dtype.name, shards.shape, [b for b, _ in pieces]))
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
                    f"{fqn}: a {type(obj).__name__} value cannot be saved: {fmt.cannot} ({_error_text(exc)})",
                    hint="save plain Python values (numbers, strings, lists, dicts, tuples) or tensors") from None
            payloads[fqn] = payload
            values.append(LocalValue(fqn, len(payload), hashlib.sha256(payload).hexdigest()))
    if stage and hasattr(fw, "after_staging"):  # non-blocking copies to pinned memory are done
        fw.after_staging()
    return _Local(LocalPlan.build(rank, rows, values, paths), tensors, payloads, rows, paths)


def _save_id(path: Path, job: Job) -> str:
    """The same name for this save on every rank: the job's identity and how many saves to this
    path it made before (every rank makes the same sequence of saves)."""
    identity = job_identity()
    if identity is None:
        raise ValueError("storage coordination needs a job identity shared by every rank: set HPCKPT_JOB_ID "
                         "(torchrun sets TORCHELASTIC_RUN_ID)")
    return f"{identity}#{job.world_size}#{_sequence.get(str(path), 0)}"


def _errors(answers: list[dict], what: str) -> None:
    """Raise on every rank when some rank reported an error."""
    failed = [(r, a["error"]) for r, a in enumerate(answers) if a.get("error")]
    if failed:
        rank, message = failed[0]
        more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise SaveError(f"{what}: rank {rank}: {message}{more}", hint="nothing was committed")


def _error_text(exc: BaseException) -> str:
    return exc.message if isinstance(exc, HpckptError) else f"{type(exc).__name__}: {exc}"


class _Save:
    """One save, from planning to commit, on one rank."""

    def __init__(self, state_dict, checkpoint_id, *, process_group, coordinator, coordination, dedup, plan_cache,
                 timeout, asynchronous, progress=None, no_dist=False, format="hyperparallel"):
        if coordination not in COORDINATIONS:
            raise ValueError(f"coordination must be one of {', '.join(COORDINATIONS)}, not {coordination!r}")
        self.format = output_format(format, coordination)
        if dedup not in DEDUP_MODES:
            raise ValueError(f"dedup must be one of {', '.join(DEDUP_MODES)}, not {dedup!r}")
        self.started = time.perf_counter()
        self.path = Path(checkpoint_id).absolute()
        self.coordination, self.dedup = coordination, dedup
        self.timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        self.progress = progress
        self.local_error: BaseException | None = None
        self.local: _Local | None = None
        try:
            flat, paths = flatten(resolve(state_dict, frameworks.is_any_tensor).view, frameworks.is_any_tensor)
            self.framework = frameworks.of_state(flat)
        except Exception as exc:
            self.local_error, flat, paths, self.framework = exc, {}, {}, frameworks.of_state({})
        self.job = this_job(self.framework, process_group, need_collectives=coordination == "collectives",
                            no_dist=no_dist)
        if not 0 <= coordinator < self.job.world_size:
            raise ValueError(f"coordinator {coordinator} is not a rank of this job of {self.job.world_size}")
        self.coordinator = coordinator
        self.is_coordinator = self.job.rank == coordinator
        self.use_cache = plan_cache and coordination != "none"
        self.asynchronous = asynchronous
        # what the exchanges go through: an async save under a launcher that names the job plans
        # on its thread through files, so the caller waits for nothing but its own copy
        self.exchange = coordination
        if asynchronous and coordination == "collectives" and self.job.world_size > 1 and job_identity():
            self.exchange = "storage"
        self.staging: Staging | None = None
        self.staging_path = shared_staging(self.path)
        try:
            if self.local_error is None:
                self.local = _describe(flat, paths, self.framework, self.job.rank,
                                       self.job.global_rank(self.job.rank), stage=asynchronous, fmt=self.format)
        except Exception as exc:  # reported to every rank in the first exchange
            self.local_error = exc
        self.cache_state = "off"
        self.planning = 0.0
        self.planned = False

    # -- steps 2-3 ----------------------------------------------------------------------------

    def plan(self) -> None:
        key = str(self.path)
        self.save_id = _save_id(self.path, self.job) if self.exchange == "storage" else ""
        _sequence[key] = _sequence.get(key, 0) + 1
        if self.coordination == "none":
            self._plan_rank_local()
        else:
            self._plan_again()
        self.planned = True

    def _plan_again(self) -> None:
        for _attempt in range(3):
            try:
                return self._plan_together()
            except Restarted:
                continue
        raise SaveError("storage coordination: the coordinator restarted the save three times")

    def _open_staging(self) -> str:
        """The coordinator: the destination locked, a fresh shared staging directory, its nonce."""
        self.staging = Staging(self.path, force=True, sync=True, parents=True, shared=True)
        self.staging.__enter__()
        nonce = new_nonce()
        write_json(self.staging.path / START, {"nonce": nonce, "save": self.save_id})
        return nonce

    def _plan_together(self) -> None:
        t0 = time.perf_counter()
        nonce, setup_error = "", None
        if self.is_coordinator and (self.local_error is None or self.exchange == "storage"):
            try:
                nonce = self._open_staging()
            except Exception as exc:
                setup_error = exc
        if self.exchange == "storage" and not self.is_coordinator:
            nonce = wait_for_start(self.staging_path, self.save_id, self.timeout, self.coordinator)
        if self.exchange == "storage" and self.is_coordinator and not nonce:
            raise setup_error or self.local_error  # the others time out waiting for the start
        self.nonce, self.token = nonce, new_nonce()  # the token: this attempt's, for the exchange files
        exchange = self._exchange()
        error = self.local_error or setup_error
        digest = self.local.plan.digest() if self.local else ""
        rank, world = self.job.rank, self.job.world_size
        held = list(_plan_cache) if self.use_cache else []
        # this rank's part is unchanged from a cached plan: no need to send it (the others may need
        # it all the same, then it is sent in a second round)
        expect_hit = any(len(d) == world and d[rank] == digest for d in (_plan_digests[k] for k in held))
        mine = {"error": _error_text(error) if error else None, "nonce": nonce, "digest": digest, "cached": held,
                "plan": None if (expect_hit or error) else self.local.plan.to_json()}
        answers = exchange.all_gather("plan", mine, "send a plan")
        if error is not None:
            raise error  # this rank's own error as it is; the others raise a SaveError naming this rank
        _errors(answers, "save refused before writing")
        self.nonce = answers[self.coordinator]["nonce"]
        digests = tuple(a["digest"] for a in answers)
        key = plan_key(digests, {"dedup": self.dedup, "world_size": self.job.world_size})
        # a hit only when every rank still holds this very plan: decided from what all gathered,
        # so every rank decides alike (one rank's cache may have lost it)
        cached = _plan_cache.get(key) if self.use_cache and all(key in a["cached"] for a in answers) else None
        if cached is not None:
            self.global_plan, self.cache_state = cached, "hit"
        else:
            if any(a["plan"] is None for a in answers):
                answers = exchange.all_gather("plan-full", {"plan": self.local.plan.to_json()}, "send a plan")
            plans = [LocalPlan.from_json(a["plan"]) for a in answers]
            self.global_plan = build_global_plan(plans, dedup=self.dedup, key=key)
            self.cache_state = "miss" if self.use_cache else "off"
            if self.use_cache:
                _plan_cache[key] = self.global_plan
                _plan_digests[key] = digests
                while len(_plan_cache) > _CACHE_SIZE:
                    _plan_digests.pop(_plan_cache.pop(next(iter(_plan_cache))).key, None)
        self.planning = time.perf_counter() - t0

    def _exchange(self):
        if self.exchange == "storage":
            return self._storage()
        return self.job.collectives()

    def _storage(self) -> Storage:
        return Storage(self.staging_path, self.job.rank, self.job.world_size, self.nonce, self.timeout,
                       coordinator=self.coordinator, token=self.token)

    def _plan_rank_local(self) -> None:
        """`coordination="none"`: this rank's items alone, no de-dup, `{rank}.metadata`."""
        if self.local_error is not None:
            raise self.local_error
        rank = self.job.rank
        self.rank_local_plan = plan_as_given(
            {fqn: (parse_dtype(dt), shape, [(rank, box) for box in boxes]) for fqn, dt, shape, boxes in self.local.rows},
            rank + 1, values=[PlannedValue(fqn, rank) for fqn in self.local.payloads],
            nesting=self.local.paths, producing=(rank,))
        self.lengths = {fqn: len(p) for fqn, p in self.local.payloads.items()}
        self.cache_state = "off"

    # -- steps 4-5 ----------------------------------------------------------------------------

    def persist(self) -> SaveResult:
        try:
            if self.coordination == "none":
                return self._persist_rank_local()
            for _attempt in range(3):
                try:
                    return self._persist_together()
                except Restarted:  # the coordinator replaced a killed attempt's directory we had joined
                    self._plan_again()
            raise SaveError("storage coordination: the coordinator restarted the save three times")
        finally:
            if self.staging is not None:
                self.staging.__exit__(None, None, None)  # removes it unless committed; releases the lock

    def _write_own(self, plan, directory: Path, lengths) -> tuple[list[list], int, Finished]:
        """This rank's files of `plan` (the boxes it stores, the values it stores) in `directory`,
        through the writer, engine and accounting every command uses (`core.write`); returns them,
        their bytes and the writer's metadata of `plan`."""
        own = {v.fqn: self.local.payloads[v.fqn] for v in plan.values if v.rank in plan.producing}
        writer = self.format.writer(self.framework.NAME, lengths, own)
        layout = lay_out(plan, {}, writer)
        source = memory_index(self.local.tensors, framework=self.framework.NAME)
        if self.progress is not None:
            self.progress.start(layout.nbytes)
        try:
            done, finished = fill(layout, source, writer, directory, WriteSettings(sync=True, progress=self.progress))
        except BaseException as exc:
            for f in layout.files:  # what this rank began: on a full disk, the room to report the error
                (directory / f.name).unlink(missing_ok=True)
            if isinstance(exc, OSError) and not isinstance(exc, HpckptError):
                raise write_error(exc, directory, layout.nbytes) from None
            raise
        files = [[f.name, f.size] for f in layout.files]
        self.digests = done.files
        return files, sum(f.size for f in layout.files), finished

    def _persist_together(self) -> SaveResult:
        t0 = time.perf_counter()
        gp = self.global_plan
        rank = self.job.rank
        mine: dict = {"error": None, "files": [], "bytes": 0}
        if self.asynchronous or self.exchange == "storage":
            exchange = self._storage()
        else:
            exchange = self.job.collectives()
        own_error = None
        try:
            plan = replace(gp.plan([rank]), producing=(rank,))
            mine["files"], mine["bytes"], _finished = self._write_own(plan, self.staging_path, gp.value_lengths)
            mine["digests"] = manifest_parts.write_part(self.staging_path, rank, self.digests)
        except Exception as exc:
            mine["error"], own_error = _error_text(exc), exc
        writing = time.perf_counter() - t0
        answers = exchange.all_gather("done", mine, "report the files written")
        if own_error is not None:
            raise own_error  # this rank's own error as it is; the others raise a SaveError naming this rank
        _errors(answers, "save failed while writing")
        if isinstance(exchange, Storage):  # the coordinator renames only after every rank has seen this
            if self.is_coordinator:
                exchange.all_gather("seen", {}, "confirm the reports")
            elif not confirm_and_wait(exchange, "seen", self.path):
                raise SaveError("the coordinator did not commit the checkpoint (its error is on its rank)",
                                hint="nothing was committed")
        committed_error = None
        if self.is_coordinator:
            try:
                self._commit(answers)
            except Exception as exc:
                committed_error = exc
        if not isinstance(exchange, Storage):
            outcome = exchange.all_gather("outcome", {"error": _error_text(committed_error) if committed_error else None})
            _errors(outcome, "save failed at the commit")
        elif committed_error is not None:
            raise committed_error
        files = tuple(name for name, _size in mine["files"])
        total = sum(a["bytes"] for a in answers)
        return SaveResult(self.path, rank, self.job.world_size, self.coordinator, self.coordination, self.cache_state,
                          files, mine["bytes"], total, True, self.planning, writing,
                          time.perf_counter() - self.started)

    def _commit(self, answers: list[dict]) -> None:
        """The coordinator: every data file there with the size its rank reported, protocol and
        stale files gone, `.metadata` last, one rename."""
        full = self.global_plan.plan()
        writer = self.format.writer(self.framework.NAME, self.global_plan.value_lengths, None)
        layout = lay_out(replace(full, producing=()), {}, writer)
        expected = set(writer.expected_files(full))
        reported = {name: size for a in answers for name, size in a["files"]}
        staging = self.staging.path
        for name in sorted(expected):
            size = reported.get(name)
            actual = os.stat(staging / name).st_size if (staging / name).exists() else None
            if size is None or actual != size:
                raise SaveError(f"{name}: expected in the staging directory with {size} bytes, found {actual}")
        parts = {manifest_parts.part_name(r) for r in range(len(answers))}
        for name in os.listdir(staging):
            if name not in expected and name not in parts:
                (staging / name).unlink()  # exchange files, and anything a killed save left
        metadata = writer.finish({}).metadata
        self.staging.write_metadata(metadata)
        written = self.format.reader().read_index(staging)  # as a loader will read it
        check_written(full, layout, written)
        self._write_manifest(answers, metadata, written)
        self.staging.commit()

    def _write_manifest(self, answers: list[dict], metadata, written) -> None:
        files = [tuple(d) for a in answers for d in a.get("digests") or ()]
        manifest_parts.write_manifest(self.staging.path, format_name=self.format.name, world_size=self.job.world_size,
                                      files=files, metadata=metadata, written=written)

    def _persist_rank_local(self) -> SaveResult:
        """`coordination="none"`: this rank's data files and `{rank}.metadata` (last), each
        written aside and renamed, straight into the destination (no rank waits for another)."""
        t0 = time.perf_counter()
        rank = self.job.rank
        self.path.mkdir(parents=True, exist_ok=True)
        plan = self.rank_local_plan
        _forget_rank_local(self.path, rank, self.job.world_size)
        tmp = self.path / f".hpckpt-tmp-{os.getpid()}"
        tmp.mkdir(exist_ok=True)
        try:
            files, nbytes, finished = self._write_own(plan, tmp, self.lengths)
            for name, _size in files:
                os.replace(tmp / name, self.path / name)
            write_file(tmp / f"{rank}.metadata", dict(finished.metadata)[".metadata"], True)
            os.replace(tmp / f"{rank}.metadata", self.path / f"{rank}.metadata")
            for old in (tensor_file(rank), values_file(rank)):  # a file of the last save this one does not have
                if old not in {n for n, _ in files}:
                    (self.path / old).unlink(missing_ok=True)
            fsync_path(self.path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return SaveResult(self.path, rank, self.job.world_size, rank, "none", "off",
                          tuple(n for n, _ in files) + (f"{rank}.metadata",), nbytes, nbytes, True, self.planning,
                          time.perf_counter() - t0, time.perf_counter() - self.started)


def _forget_rank_local(path: Path, rank: int, world_size: int) -> None:
    """Before a rank-local save writes: this rank's old `{rank}.metadata` goes first (a rank killed
    from here on leaves its part absent, never an old part beside new ones); the coordinator-free
    rank 0 also removes what only a save of another kind or a larger world left: `.metadata`,
    the manifest, `.hpckpt.json` and the files of ranks >= `world_size`."""
    (path / f"{rank}.metadata").unlink(missing_ok=True)
    if rank != 0:
        return
    for name in os.listdir(path):
        stale = name in (".metadata", ".hpckpt.json", manifest.NAME)
        match = re.fullmatch(r"(?:(\d+)\.metadata|_rank(\d+)_\.(?:safetensors|bytes))", name)
        if match:
            stale = int(match.group(1) or match.group(2)) >= world_size
        if stale:
            (path / name).unlink(missing_ok=True)


def _wait_in_flight() -> None:
    with _lock:
        pending = list(_in_flight)
    for handle in pending:
        try:
            handle.result()
        except BaseException:
            pass  # its own caller sees its error


def save(state_dict: Any, checkpoint_id: str | os.PathLike | None = None, *, process_group: Any = None,
         coordinator: int = 0, coordination: str = "collectives", dedup: str = "balanced", plan_cache: bool = True,
         timeout: float | None = None, progress: Any = None, format: str | None = None, no_dist: bool = False,
         use_collectives: bool = True, storage_writer: Any = None, planner: Any = None) -> SaveResult:
    """Save `state_dict` (every rank calls this with its own shards) as a checkpoint at
    `checkpoint_id`, replacing a checkpoint there: HyperParallel DCP (`format` "hyperparallel",
    the default), or PyTorch DCP (`format="torch-dcp"`, what torch's own `dcp.load` reads; the
    default when `storage_writer` is hpckpt's HpckptWriter), planned, de-duplicated, committed
    and with a manifest alike.

    `state_dict` holds tensors, values, nested dicts and lists, and Stateful objects (anything
    with `state_dict()` and `load_state_dict()`: a module, an optimizer, a recipe's `AppState`),
    saved as what their `state_dict()` returns. `coordination`: "collectives" (exchanges over
    `process_group`, default the world), "storage" (no collectives: JSON files in the staging
    directory; every wait bounded by `timeout` seconds, default 600) or "none" (each rank writes
    `{rank}.metadata` of its own items; torch's `use_collectives=False`). `dedup`: who stores a
    box several ranks hold: "balanced" (least bytes, as HyperParallel), "lowest-rank" or "none"
    (every holder). `plan_cache`: reuse the global plan when no rank's names, dtypes, shapes,
    layouts or values changed. `progress`: an object with `start(total_bytes)` and `advance(n)`
    told about this rank's bytes as they are written. `no_dist`: this process saves alone, as
    rank 0 of 1, whatever the process group (torch's meaning). `storage_writer`: hpckpt's own
    HpckptWriter gives the path; torch's other writers and a `planner` are refused with a
    TypeError saying what to use instead.

    Raises:
        SaveError: some rank failed (every rank raises it; nothing was committed).
        CoordinationTimeoutError: some ranks did not arrive within `timeout` (storage), or the
            process group failed (a rank died; collectives).
        UnsafePickleError: a value hpckpt's safe unpickler would not read back (before any byte is written).
    """
    refuse_torch_only("save", storage_writer=storage_writer, planner=planner)
    options = _options(process_group, coordinator, coordination, use_collectives, dedup, plan_cache, timeout,
                       progress, format, storage_writer, no_dist)
    job = _planned(state_dict, checkpoint_path("save", checkpoint_id, storage_writer), options, asynchronous=False)
    return job.persist()


def _options(process_group, coordinator, coordination, use_collectives, dedup, plan_cache, timeout, progress,
             format, storage_writer, no_dist) -> dict:
    """`_Save`'s options from `save`'s and `async_save`'s parameters (torch's forms mapped)."""
    return dict(process_group=process_group, coordinator=coordinator,
                coordination=coordination_of(coordination, use_collectives), dedup=dedup, plan_cache=plan_cache,
                timeout=timeout, progress=progress, no_dist=no_dist, format=format_of(format, storage_writer))


def _planned(state_dict: Any, checkpoint_id, options: dict, *, asynchronous: bool,
             described: _Save | None = None) -> _Save:
    """Steps 1-3, after any save in flight has finished; the staging directory is released if they fail."""
    if described is None:
        _wait_in_flight()
    job = described or _Save(state_dict, checkpoint_id, asynchronous=asynchronous, **options)
    _plan_releasing(job)
    return job


def _plan_releasing(job: _Save) -> None:
    try:
        job.plan()
    except BaseException:
        if job.staging is not None:
            job.staging.__exit__(None, None, None)
        raise


def async_save(state_dict: Any, checkpoint_id: str | os.PathLike | None = None, *, process_group: Any = None,
               coordinator: int = 0, coordination: str = "collectives", dedup: str = "balanced",
               plan_cache: bool = True, timeout: float | None = None, progress: Any = None,
               format: str | None = None, no_dist: bool = False, use_collectives: bool = True,
               storage_writer: Any = None, planner: Any = None, async_checkpointer_type: Any = None,
               async_stager: Any = None) -> AsyncSaveHandle:
    """`save`, returning once this rank's shards are copied (the caller may change its tensors
    then) and persisting on a background thread. The handle behaves as torch's future:
    `result(timeout)` returns the SaveResult or raises the save's error (then nothing was
    committed), `done()`, `exception()`, `add_done_callback()`.

    A second call while one is in flight waits for the first to finish (saves of one process
    persist one at a time, in order). From the copy on, the save exchanges only files, never
    collectives, so the training job's process group is free. torch's `async_checkpointer_type`
    is taken only as THREAD (what this is); `async_stager`, a `planner` and storage writers other
    than hpckpt's HpckptWriter are refused with a TypeError saying what to use instead.
    """
    refuse_torch_only("async_save", storage_writer=storage_writer, planner=planner, async_stager=async_stager,
                      async_checkpointer_type=async_checkpointer_type)
    checkpoint_id = checkpoint_path("async_save", checkpoint_id, storage_writer)
    started = time.perf_counter()
    options = _options(process_group, coordinator, coordination, use_collectives, dedup, plan_cache, timeout,
                       progress, format, storage_writer, no_dist)
    _wait_in_flight()
    job = _Save(state_dict, checkpoint_id, asynchronous=True, **options)
    if job.exchange != "storage" or options["coordination"] == "storage":  # collectives in the caller, or one rank
        job = _planned(state_dict, checkpoint_id, options, asynchronous=True, described=job)
    future: Future = Future()
    blocked = time.perf_counter() - started

    def run() -> None:
        try:
            if not job.planned:
                _plan_releasing(job)
            result = job.persist()
            future.set_result(replace(result, blocked=blocked))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through result()
            future.set_exception(exc)
        finally:
            with _lock:
                if handle in _in_flight:
                    _in_flight.remove(handle)

    thread = threading.Thread(target=run, name="hpckpt-async-save", daemon=False)
    handle = AsyncSaveHandle(future, blocked)
    with _lock:
        _in_flight.append(handle)
    thread.start()
    return handle
