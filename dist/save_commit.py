"""A live save's steps 4-5 (see `hpckpt.dist.save`): every rank writes its files of the agreed
plan; the coordinator checks them and commits through `core.commit` (the shared staging
directory), or each rank publishes its own part (`core.commit.rank_local`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from hpckpt.converters.hyperparallel.writer import tensor_file, values_file
from hpckpt.core.commit import manifest
from hpckpt.core.commit.durable import spool_root, write_error
from hpckpt.core.commit.leftovers import WRITING
from hpckpt.core.commit.object_uploads import Uploads
from hpckpt.core.commit.rank_local import publish_rank_part
from hpckpt.core.errors import HpckptError, SaveError
from hpckpt.core.io.accounting import check_written
from hpckpt.core.io.memory_source import memory_index
from hpckpt.core.io.output import Finished, OutputLayout
from hpckpt.core.io.write import WriteSettings, fill, lay_out
from hpckpt.core.safety.unpickle import reading_own_output
from hpckpt.dist import manifest_parts
from hpckpt.dist.coordination import Restarted, Storage, confirm_and_wait
from hpckpt.dist.results import SaveResult
from hpckpt.dist.save_plan import PlannedSave, error_text, plan_again, raise_reported


def persist(planned: PlannedSave) -> SaveResult:
    """Steps 4-5; the staging directory and its lock are released whatever happens (removed
    unless committed)."""
    with planned.resources:
        if planned.request.remote:  # this rank's files are written here, then go up
            spool = Path(tempfile.mkdtemp(prefix="hpckpt-save-spool-", dir=spool_root()))
            planned.resources.callback(shutil.rmtree, spool, True)
            planned = replace(planned, request=replace(planned.request, spool=spool))
        if planned.request.coordination == "none":
            return _persist_rank_local(planned)
        for _attempt in range(3):
            try:
                return _persist_together(planned)
            except Restarted:  # the coordinator replaced a killed attempt's directory we had joined
                planned = plan_again(planned)
        raise SaveError("storage coordination: the coordinator restarted the save three times")


def _write_own(planned: PlannedSave, plan, directory: Path, lengths,
               uploads: Uploads | None = None) -> tuple[list[list], int, Finished, list]:
    """This rank's files of `plan` (the boxes it stores, the values it stores) in `directory`,
    through the writer, engine and accounting every command uses (`core.io.write`); returns them,
    their bytes, the writer's metadata of `plan` and their digests. With `uploads` (a checkpoint
    in an object store) each file goes up as the engine writes it; a failed write removes them."""
    request = planned.request
    own = {v.fqn: request.local.payloads[v.fqn] for v in plan.values if v.rank in plan.producing}
    writer = request.format.writer(request.framework.NAME, lengths, own)
    layout = lay_out(plan, {}, writer)
    source = memory_index(request.local.tensors, framework=request.framework.NAME)
    if request.progress is not None:
        request.progress.start(layout.nbytes)
    try:
        sync = not request.remote  # (a spool is scratch: the store makes the objects durable)
        done, finished = fill(layout, source, writer, directory, WriteSettings(sync=sync, progress=request.progress),
                              filled=uploads.filled if uploads is not None else None)
    except BaseException as exc:
        if uploads is not None:
            uploads.cancel()
            request.path.store.delete([(request.path / name).key for name in uploads.uploaded])
        for f in layout.files:  # what this rank began: on a full disk, the room to report the error
            (directory / f.name).unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, HpckptError):
            raise write_error(exc, directory, layout.nbytes) from None
        raise
    files = [[f.name, f.size] for f in layout.files]
    return files, sum(f.size for f in layout.files), finished, done.files


def _persist_together(planned: PlannedSave) -> SaveResult:
    t0 = time.perf_counter()
    request, gp = planned.request, planned.global_plan
    rank = request.job.rank
    mine: dict = {"error": None, "files": [], "bytes": 0}
    if request.asynchronous or request.exchange == "storage":
        exchange = request.storage(planned.nonce, planned.token)
    else:
        exchange = request.job.collectives()
    own_error = None
    try:
        plan = replace(gp.plan([rank]), producing=(rank,))
        uploads = None
        if request.remote:  # this rank's files go up as they are written, then its manifest part
            uploads = Uploads(request.path.store, request.staging_path, lambda name: (request.path / name).key)
        mine["files"], mine["bytes"], _finished, digests = _write_own(planned, plan, request.staging_path,
                                                                      gp.value_lengths, uploads)
        mine["digests"] = manifest_parts.write_part(request.staging_path, rank, digests)
        if uploads is not None:
            uploads.upload_rest([name for name, _ in mine["files"]] + [manifest_parts.part_name(rank)])
    except Exception as exc:
        mine["error"], own_error = error_text(exc), exc
    writing = time.perf_counter() - t0
    answers = exchange.all_gather("done", mine, "report the files written")
    if own_error is not None:
        raise own_error  # this rank's own error as it is; the others raise a SaveError naming this rank
    raise_reported(answers, "save failed while writing")
    renames = isinstance(exchange, Storage) and exchange.confirms_by_rename
    if renames:  # the coordinator renames only after every rank has seen this
        if request.is_coordinator:
            exchange.all_gather("seen", {}, "confirm the reports")
        elif not confirm_and_wait(exchange, "seen", request.path):
            raise SaveError("the coordinator did not commit the checkpoint (its error is on its rank)",
                            hint="nothing was committed")
    committed_error = None
    if request.is_coordinator:
        try:
            _commit(planned, answers)
        except Exception as exc:
            committed_error = exc
    if not renames:
        outcome = exchange.all_gather("outcome", {"error": error_text(committed_error) if committed_error else None})
        raise_reported(outcome, "save failed at the commit")
    elif committed_error is not None:
        raise committed_error
    files = tuple(name for name, _size in mine["files"])
    total = sum(a["bytes"] for a in answers)
    return SaveResult(path=request.path, rank=rank, world_size=request.job.world_size,
                      coordinator=request.coordinator, coordination=request.coordination,
                      plan_cache=planned.cache_state, plan_from=planned.plan_from, files=files,
                      bytes_written=mine["bytes"], job_bytes_written=total, committed=True,
                      planning=planned.planning, writing=writing,
                      blocked=time.perf_counter() - request.started)


def _commit(planned: PlannedSave, answers: list[dict]) -> None:
    """The coordinator: every data file there with the size its rank reported, protocol and
    stale files gone, the ranks' manifest parts joined, `.metadata` last: one rename, or for an
    object store the order of `core.commit.object_staging` (the data objects are up already)."""
    request, staging, gp = planned.request, planned.staging, planned.global_plan
    writer = request.format.writer(request.framework.NAME, gp.value_lengths, None)
    from_arrays = getattr(writer, "from_global_plan", None)
    made = from_arrays(gp) if from_arrays is not None else None
    if made is not None:  # (thousands of ranks: the plan's arrays, no object per chunk)
        expected, finished = set(made[0]), made[1]
        full, layout = gp.plan([]), OutputLayout(())  # what the read-back is checked against: names, dtypes, shapes
    else:
        full = gp.plan()
        layout = lay_out(replace(full, producing=()), {}, writer)
        expected, finished = set(writer.expected_files(full)), None
    reported = {name: size for a in answers for name, size in a["files"]}
    parts = [manifest_parts.part_name(r) for r in range(len(answers))]
    root = request.path if request.remote else staging.path
    if request.remote:
        listed = root.store.walk(root.key)
        names, size_of = list(listed), listed.get
    else:
        names = os.listdir(root)
        size_of = lambda n: (root / n).stat().st_size if (root / n).exists() else None  # noqa: E731
    for name in sorted(expected):
        if reported.get(name) is None or size_of(name) != reported[name]:
            raise SaveError(f"{root / name}: expected with {reported.get(name)} bytes, found {size_of(name)}")
    stale = [n for n in names if n not in expected and n not in parts and n != WRITING]  # exchange files, a killed save's
    if request.remote:
        root.store.delete([(root / n).key for n in stale])
        for name in parts:
            (staging.path / name).write_bytes(root.store.read_all((root / name).key))
    else:
        for name in stale:
            (staging.path / name).unlink()
    metadata = (finished or writer.finish({})).metadata
    staging.write_metadata(metadata)
    with reading_own_output():
        written = request.format.reader().read_index(staging.path)  # the metadata as a loader will read it
    check_written(full, layout, written)
    files = [tuple(d) for a in answers for d in a.get("digests") or ()]
    manifest_parts.write_manifest(staging.path, format_name=request.format.name, world_size=request.job.world_size,
                                  files=files, metadata=metadata, written=written)
    staging.commit()
    if request.remote:
        root.store.delete([(root / n).key for n in parts])


def _persist_rank_local(planned: PlannedSave) -> SaveResult:
    """`coordination="none"`: this rank's data files and `{rank}.metadata` (last), each
    written aside and renamed, straight into the destination (no rank waits for another)."""
    t0 = time.perf_counter()
    request = planned.request
    rank = request.job.rank
    files, nbytes = [], 0

    def write(directory: Path) -> tuple[list[str], bytes]:
        nonlocal files, nbytes
        files, nbytes, finished, _digests = _write_own(planned, planned.rank_local_plan, directory, planned.lengths)
        return [name for name, _size in files], dict(finished.metadata)[".metadata"]

    publish_rank_part(request.path, f"{rank}.metadata", write,
                      forget=_stale_for_rank_local(request.path, rank, request.job.world_size),
                      previous=(tensor_file(rank), values_file(rank)))
    return SaveResult(path=request.path, rank=rank, world_size=request.job.world_size, coordinator=rank,
                      coordination="none", plan_cache="off", files=tuple(n for n, _ in files) + (f"{rank}.metadata",),
                      bytes_written=nbytes, job_bytes_written=nbytes, committed=True, planning=planned.planning,
                      writing=time.perf_counter() - t0, blocked=time.perf_counter() - request.started)


def _stale_for_rank_local(path: Path, rank: int, world_size: int) -> list[str]:
    """What the coordinator-free rank 0 removes before a rank-local save writes: what only a save
    of another kind or a larger world left (`.metadata`, the manifest, `.hpckpt.json`, the files
    of ranks >= `world_size`)."""
    if rank != 0 or not path.is_dir():
        return []
    stale = []
    for name in os.listdir(path):
        match = re.fullmatch(r"(?:(\d+)\.metadata|_rank(\d+)_\.(?:safetensors|bytes))", name)
        if (int(match.group(1) or match.group(2)) >= world_size) if match else \
                name in (".metadata", ".hpckpt.json", manifest.NAME):
            stale.append(name)
    return stale
