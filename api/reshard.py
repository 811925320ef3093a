"""`reshard`: a checkpoint onto a new world size or layout (HyperParallel DCP, or another layout
format); and `finalize`."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from hpckpt.api import pipeline
from hpckpt.api.options import Selection
from hpckpt.api.reports import FinalizeReport, WriteReport
from hpckpt.converters import detect, format_named, open_index
from hpckpt.core.commit import fan_out
from hpckpt.core.commit.lock import holds_source
from hpckpt.core.errors import ReshardOptionError
from hpckpt.core.geometry.layout import LayoutSpec
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.write import WriteSettings
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.urls import as_path


@holds_source
def reshard(src: str | Path, dst: str | Path, layout: LayoutSpec, *, select: Selection = Selection(),
            ranks: Iterable[int] | None = None, framework: str | None = None, dtype: str | None = None,
            settings: WriteSettings = WriteSettings(), dry_run: bool = False,
            index: CheckpointIndex | None = None, to: str = "hyperparallel",
            keep_replicas: bool = False) -> WriteReport:
    """Reshard `src` into a checkpoint at `dst` laid out by `layout`, in the layout format `to`
    (HyperParallel DCP, PyTorch DCP or MindFormers; `keep_replicas`: MindFormers' form in which
    every rank holding a replicated box writes it).

    With `ranks`, only those target ranks' files are written (fan-out); `finalize(dst)` writes
    the metadata once every rank's files are there. `dry_run` plans and writes nothing.

    Raises:
        ReshardOptionError: `to` is not a format that stores a layout.
    """
    started = time.perf_counter()
    target = reshard_target(to, layout, ranks=ranks, framework=framework, dtype=dtype, keep_replicas=keep_replicas)
    index = index if index is not None else open_index(src)
    names = None if select.everything else select.names([*index.tensors, *index.values])
    return pipeline.write("reshard", src, dst, index, target, settings, names=names, dry_run=dry_run, started=started)


def reshard_target(to: str, layout: LayoutSpec, *, ranks: Iterable[int] | None = None, framework: str | None = None,
                   dtype: str | None = None, keep_replicas: bool = False) -> pipeline.Target:
    """What `reshard` writes: `layout` in the layout format `to`.

    Raises:
        ReshardOptionError: `to` is not a format that stores a layout.
    """
    fmt = format_named(to)
    if fmt.writer is None or fmt.whole_tensors:
        raise ReshardOptionError(f"reshard writes a layout format (hyperparallel, torch-dcp, mindformers), not {fmt.name}",
                                 hint="`hpckpt consolidate` or `hpckpt convert` writes whole tensors")
    return pipeline.Target(fmt, layout, tuple(ranks) if ranks is not None else None, framework, dtype,
                           every_replica=keep_replicas)


def finalize(dst: str | Path) -> FinalizeReport:
    """Write the metadata of a fanned-out reshard once every target rank's files are present.

    Raises:
        NotACheckpointError: `dst` holds no fan-out fragments.
        CorruptMetadataError: the fragments come from different plans.
        MissingFileError: some rank's files are missing (the message names one).
    """
    dst = as_path(dst)
    if is_object(dst):
        from hpckpt.core.commit.object_fan_out import finalize_objects

        data, metadata = finalize_objects(dst)
    else:
        data, metadata = fan_out.finalize(dst)
    written = tuple(str(dst / name) for name in (*data, *metadata))
    fmt = detect(dst)
    if fmt.after_commit is not None:  # (MindFormers' tracker)
        written += fmt.after_commit(dst)[0]
    return FinalizeReport(str(dst), written, len(data))
