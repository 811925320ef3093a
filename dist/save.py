"""`save` and `async_save`: every rank writes its own shards; the coordinator commits.

1. Each rank describes what it holds (`LocalPlan`) and checks that each value can be read back by
   hpckpt's safe unpickler, before any byte is written.
2. The coordinator takes the destination's lock and creates the staging directory every rank
   shares (`.NAME.hpckpt-tmp-dist`, `core.commit.staging.Staging`), removing what a killed save left.
3. The local plans are gathered (`coordination`), and every rank builds the same global plan
   (`core.geometry.global_plan`), or takes it from the plan cache when every rank's part is unchanged.
4. Each rank writes the files of the boxes it stores through the HyperParallel writer and the
   engine (`core.io.engine`), fsynced, and reports them.
5. Once every rank has reported, the coordinator checks the files, writes `.metadata` last and
   renames the staging directory into place. Until then there is nothing at the destination
   that loads or verifies; a job that dies leaves only the staging directory, which the next
   save to the same path removes.

Steps 1-3 are `dist/save_plan.py` (a frozen `SaveRequest`, then a frozen `PlannedSave`), steps
4-5 `dist/save_commit.py`; this module is the public calls.

`async_save` does step 1 in the caller (with a CPU copy of the shards, in pinned memory when
they are on an accelerator), returns, and does the rest on a thread, exchanging through files
(never through the training job's process group). Without a job identity for the files
(`HPCKPT_JOB_ID`, torchrun's run id), steps 2-3 stay in the caller, over the process group.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from hpckpt.dist.call_forms import checkpoint_path, coordination_of, format_of, refuse_torch_only
from hpckpt.dist.results import AsyncSaveHandle, SaveResult
from hpckpt.dist.save_commit import persist
from hpckpt.dist.save_plan import describe, plan_save

_in_flight: list[AsyncSaveHandle] = []
_lock = threading.Lock()


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
    checkpoint_id = checkpoint_path("save", checkpoint_id, storage_writer)
    _wait_in_flight()
    return persist(plan_save(describe(state_dict, checkpoint_id, asynchronous=False, **options)))


def _options(process_group, coordinator, coordination, use_collectives, dedup, plan_cache, timeout, progress,
             format, storage_writer, no_dist) -> dict:
    """`describe`'s options from `save`'s and `async_save`'s parameters (torch's forms mapped)."""
    return dict(process_group=process_group, coordinator=coordinator,
                coordination=coordination_of(coordination, use_collectives), dedup=dedup, plan_cache=plan_cache,
                timeout=timeout, progress=progress, no_dist=no_dist, format=format_of(format, storage_writer))


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
    request = describe(state_dict, checkpoint_id, asynchronous=True, **options)
    planned = None
    if request.exchange != "storage" or options["coordination"] == "storage":  # collectives in the caller, or one rank
        planned = plan_save(request)
    future: Future = Future()
    blocked = time.perf_counter() - started

    def run() -> None:
        try:
            result = persist(planned or plan_save(request))
            future.set_result(replace(result, blocked=blocked))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through result()
            future.set_exception(exc)
        finally:
            with _lock:
                if handle in _in_flight:
                    _in_flight.remove(handle)

    thread = threading.Thread(target=run, name="hpckpt-async-save", daemon=False)
    handle = AsyncSaveHandle(_future=future, blocked=blocked)
    with _lock:
        _in_flight.append(handle)
    thread.start()
    return handle
