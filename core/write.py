"""Carrying out a plan: writer -> engine -> commit, the tail of every writing command.

The steps before it (open the source, select and rename entries, choose the target layout, plan)
differ between commands; these do not, and no format may need anything else: the same function
writes a conversion from a checkpoint on disk and a save from arrays in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from hpckpt.core import engine
from hpckpt.core.accounting import check_layout, check_written
from hpckpt.core.commit import Fragment, Staging
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.plan import Plan
from hpckpt.core.plan_stats import RankStats


class Progress:
    """What a writing command reports its progress to: `start(total_bytes)`, then `advance(n)`."""

    def start(self, total: int) -> None: ...

    def advance(self, n: int) -> None: ...


@dataclass(frozen=True)
class WriteSettings:
    """How to write, whatever is written: workers, memory for copy buffers, durability, and
    whether an existing destination may be replaced or its missing parents created."""

    jobs: int | None = None
    max_memory: int = engine.DEFAULT_MAX_MEMORY
    sync: bool = True
    force: bool = False
    progress: Progress | None = None
    parents: bool = False  # create missing parent directories of the destination (`--parents`)


@dataclass(frozen=True)
class Written:
    """What a write produced: data files, what each storing rank wrote and read, and what the
    format could not hold (`skipped`) or held in another kind (`converted`), each `(fqn, reason)`."""

    files: int
    ranks: tuple[RankStats, ...]
    skipped: tuple[tuple[str, str], ...]
    converted: tuple[tuple[str, str], ...] = ()

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes_written for r in self.ranks)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)


def write_plan(plan: Plan, source: CheckpointIndex, writer, dest: Path, settings: WriteSettings, *,
               file_output: bool = False, fan_out: bool = False,
               read_back: Callable[[Path], CheckpointIndex] | None = None) -> Written:
    """Lay `plan` out with `writer`, fill it from `source` and commit it at `dest`.

    `fan_out`: only the plan's producing ranks are written, straight into the shared `dest`
    (`core.commit.Fragment`); `hpckpt reshard --finalize` writes the metadata later.
    `read_back` (the format's reader) reads the staged output's metadata before it is committed,
    to prove it holds every entry that was not reported skipped (`core.accounting`).
    """
    values = {v.fqn: source.decode_value(v.fqn) for v in plan.values}
    layout = writer.layout(plan, values)
    check_layout(plan, layout)
    progress = settings.progress
    if progress is not None:
        progress.start(layout.nbytes)
    advance: Callable[[int], None] | None = progress.advance if progress is not None else None
    options = dict(jobs=settings.jobs, max_memory=settings.max_memory, progress=advance, sync=settings.sync)
    if fan_out:
        with Fragment(Path(dest), sync=settings.sync) as fragment:
            done = engine.execute(layout, source, fragment.path, **options)
            finished = writer.finish(done.crcs)
            engine.finish(layout, finished, fragment.path, sync=settings.sync)
            every_rank = replace(plan, producing=tuple(range(plan.world_size)))
            fragment.commit(plan.producing, finished.metadata, writer.expected_files(every_rank))
    else:
        with Staging(Path(dest), force=settings.force, sync=settings.sync, file_output=file_output) as staging:
            done = engine.execute(layout, source, staging.path, **options)
            finished = writer.finish(done.crcs)
            engine.finish(layout, finished, staging.path, sync=settings.sync)
            staging.write_metadata(finished.metadata)
            if read_back is not None:
                check_written(plan, layout, read_back(staging.path / Path(dest).name if file_output else staging.path))
            staging.commit()
    return Written(len(layout.files), done.ranks, layout.skipped, layout.converted)
