"""Carrying out a plan: writer -> engine -> commit, the tail of every writing command.

The steps before it (open the source, select and rename entries, choose the target layout, plan)
differ between commands; these do not, and no format may need anything else: the same function
writes a conversion from a checkpoint on disk and a save from arrays in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpckpt.core.commit import manifest
from hpckpt.core.commit.destination import refuse_unsafe
from hpckpt.core.commit.durable import write_error
from hpckpt.core.commit.fan_out import Fragment
from hpckpt.core.commit.staging import staging_for
from hpckpt.core.errors import HpckptError
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.geometry.plan_stats import RankStats
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io import engine
from hpckpt.core.io.accounting import check_layout, check_written
from hpckpt.core.io.output import Finished, OutputLayout
from hpckpt.core.safety.unpickle import reading_own_output
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import as_path


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
    manifest: bool = True  # hash while writing and add the manifest (`core.commit.manifest`); `--no-manifest`


@dataclass(frozen=True)
class ManifestFields:
    """What the manifest says besides the digests: the output's format, its layout (`mesh`,
    `placements`), the source's identity (`manifest.source_identity`), and `describe`, which turns
    the staged output as its reader reads it into the listing `inspect` takes from the manifest."""

    format_name: str
    layout: dict = field(default_factory=dict)
    source: dict | None = None
    describe: Callable[[CheckpointIndex], dict] | None = None
    command: str | None = None  # what made it, when not the running command line


@dataclass(frozen=True)
class Written:
    """What a write produced: data files, what each storing rank wrote and read, and what the
    format could not hold (`skipped`) or held in another kind (`converted`), each `(fqn, reason)`."""

    files: int
    ranks: tuple[RankStats, ...]
    skipped: tuple[tuple[str, str], ...]
    converted: tuple[tuple[str, str], ...] = ()
    names: tuple[str, ...] = ()  # every file written (data, then metadata), relative to its directory

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes_written for r in self.ranks)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)


def write_plan(plan: Plan, source: CheckpointIndex, writer, dest: Path, settings: WriteSettings, *,
               file_output: bool = False, fan_out: bool = False,
               read_back: Callable[[Path], CheckpointIndex] | None = None,
               source_path: Path | None = None, fields: ManifestFields | None = None) -> Written:
    """Lay `plan` out with `writer`, fill it from `source` and commit it at `dest`.

    `fan_out`: only the plan's producing ranks are written, straight into the shared `dest`
    (`core.commit.fan_out.Fragment`); `hpckpt reshard --finalize` writes the metadata later.
    `read_back` (the format's reader) reads the staged output's metadata before it is committed,
    to prove it holds every entry that was not reported skipped (`core.io.accounting`).
    `source_path` is where `source` was read from: `dest` may not overlap it (`core.commit`).
    `fields`: what the manifest records besides the digests (none: no manifest is written).

    Raises:
        NoSpaceError: the output does not fit (checked first), or the disk filled up meanwhile.
        WriteFailedError: the system refused another write; nothing is left behind either way.
    """
    dest = as_path(dest)
    for baseline in source.baselines:  # an incremental source reads the checkpoints it points into too
        refuse_unsafe(dest, (source.root / baseline).resolve())
    values = {v.fqn: source.decode_value(v.fqn) for v in plan.values}  # before anything is written
    layout = lay_out(plan, values, writer)
    progress = settings.progress
    if progress is not None:
        progress.start(layout.nbytes)
    needed = sum(f.size for f in layout.files)
    try:
        if fan_out:
            done, metadata = _write_fragment(plan, layout, source, writer, dest, settings, source_path, needed,
                                             fields), ()
        else:
            done, metadata = _write_staged(plan, layout, source, writer, dest, settings, file_output, read_back,
                                           source_path, needed, fields)
    except OSError as exc:
        if isinstance(exc, HpckptError):
            raise
        raise write_error(exc, dest, needed) from None
    return Written(len(layout.files), done.ranks, layout.skipped, layout.converted,
                   tuple(f.name for f in layout.files) + metadata)


def lay_out(plan: Plan, values: dict, writer) -> OutputLayout:
    """The writer's layout of `plan`, proven to place every box of the ranks it produces."""
    layout = writer.layout(plan, values)
    check_layout(plan, layout)
    return layout


def fill(layout: OutputLayout, source: CheckpointIndex, writer, directory: Path,
         settings: WriteSettings, filled: Callable[[str, int], None] | None = None) -> tuple[engine.Executed, Finished]:
    """Create and fill the layout's data files in `directory` from `source`, with the writer's
    patches, durable when `settings.sync`; returns what the engine did (with every file's digests
    when `settings.manifest`) and the writer's metadata files (not written: the caller decides
    where and whether). `filled` is told how much of each data file is final (`engine.execute`)."""
    done = engine.execute(layout, source, directory, **_engine_options(settings), hashing=settings.manifest,
                          filled=filled)
    finished = writer.finish(done.crcs)
    files = engine.finish(layout, finished, directory, sync=settings.sync, done=done)
    return replace(done, files=files), finished


def _engine_options(settings: WriteSettings) -> dict:
    progress = settings.progress
    advance: Callable[[int], None] | None = progress.advance if progress is not None else None
    return dict(jobs=settings.jobs, max_memory=settings.max_memory, progress=advance, sync=settings.sync)


def _upload_share(dest, settings: WriteSettings) -> tuple[WriteSettings, int | None]:
    """For a destination in a store, the parts in flight come out of the same budget as the
    engine's tiles: half each. Returns the engine's settings and the uploads' bytes (None: local)."""
    if not is_object(dest):
        return settings, None
    uploads = settings.max_memory // 2
    return replace(settings, max_memory=settings.max_memory - uploads), uploads


def _write_fragment(plan, layout, source, writer, dest, settings, source_path, needed, fields) -> engine.Executed:
    settings, uploads = _upload_share(dest, settings)
    if uploads is not None:
        from hpckpt.core.commit.object_fan_out import ObjectFragment

        fragment = ObjectFragment(dest, source=source_path, needed=needed, memory=uploads)
    else:
        fragment = Fragment(dest, source=source_path, sync=settings.sync, parents=settings.parents, needed=needed)
    with fragment:
        done, finished = fill(layout, source, writer, fragment.path, replace(settings, sync=fragment.sync),
                              filled=fragment.filled)
        every_rank = replace(plan, producing=tuple(range(plan.world_size)))
        header = None
        if fields is not None and settings.manifest:  # finalize adds the files and the listing
            header = manifest.header(format_name=fields.format_name, world_size=plan.world_size, files=(),
                                     metadata=finished.metadata, source=fields.source, layout=fields.layout)
        fragment.commit(plan.producing, finished.metadata, writer.expected_files(every_rank),
                        digests=done.files if header is not None else None, header=header)
    return done


def _write_staged(plan, layout, source, writer, dest, settings, file_output, read_back, source_path,
                  needed, fields) -> tuple[engine.Executed, tuple[str, ...]]:
    """The staged write; returns what the engine did and the names of the metadata files (the
    manifest's included)."""
    settings, uploads = _upload_share(dest, settings)
    with staging_for(dest, source=source_path, force=settings.force, sync=settings.sync, file_output=file_output,
                     parents=settings.parents, needed=needed, memory=uploads) as staging:
        done, finished = fill(layout, source, writer, staging.path, replace(settings, sync=staging.sync),
                              filled=staging.filled)
        staging.write_metadata(finished.metadata)
        written = None
        if read_back is not None:  # the staged output, read as the format's reader reads it
            with reading_own_output():
                written = read_back(staging.path / dest.name if file_output else staging.path)
            check_written(plan, layout, written)
        extra = ()
        if fields is not None and settings.manifest:
            name = manifest.sidecar_name(dest.name) if file_output else manifest.NAME
            listing = fields.describe(written) if fields.describe is not None and written is not None else None
            doc = manifest.header(format_name=fields.format_name, world_size=plan.world_size,
                                  files=manifest.summaries(done.files),
                                  metadata=finished.metadata, source=fields.source, layout=fields.layout,
                                  index=listing, command=fields.command)
            extra = ((name, manifest.encode(doc, done.files)),)
            staging.write_metadata(extra, marks=False)
        staging.commit()
    return done, tuple(name for name, _ in (*finished.metadata, *extra))
