"""The one pipeline every writing command runs:

    open -> select -> layout -> plan -> writer -> engine -> commit -> report

`open` and `select` (and, for `convert`, renaming) are done by the command, which hands over the
source index it wants written; the rest is here, the same for reshard, consolidate, convert and
convert-ms-torch, whatever the source and target formats.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpckpt.api.reports import PlanSummary, WriteReport
from hpckpt.converters.base import Format, WriterOptions
from hpckpt.core import dtypes
from hpckpt.core.dtypes import DType
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.layout import LayoutSpec
from hpckpt.core.plan import Plan, make_plan, whole_tensor_plan
from hpckpt.core.plan_stats import rank_stats
from hpckpt.core.write import WriteSettings, write_plan


@dataclass(frozen=True)
class Target:
    """What to write: a format and, for the formats that store any layout, the target `layout`
    (`None`: one rank, every tensor whole); `ranks` writes only those target ranks (fan-out);
    `dtype` casts floating tensors, `casts` single ones (fqn -> dtype); `framework` spells dtypes
    and file flavours as torch or MindSpore does."""

    format: Format
    layout: LayoutSpec | None = None
    ranks: tuple[int, ...] | None = None
    framework: str | None = None
    dtype: str | None = None
    casts: Mapping[str, DType] | None = None
    max_shard_bytes: int = 5 * 10**9
    crc: bool = False


def make_target_plan(source: CheckpointIndex, target: Target, names: Iterable[str] | None = None) -> Plan:
    """Plan `source` (the entries `names`, default all) onto the target's layout."""
    cast_to = dtypes.dtype(target.dtype) if target.dtype else None
    if target.format.whole_tensors or target.layout is None:
        return whole_tensor_plan(source, names=names, cast_to=cast_to, casts=target.casts)
    world_size = max(target.layout.mesh.ranks) + 1
    return make_plan(source, target.layout, world_size, names=names, ranks=target.ranks, cast_to=cast_to,
                     casts=target.casts)


def write(command: str, src: str | Path, dst: str | Path, source: CheckpointIndex, target: Target,
          settings: WriteSettings, *, names: Iterable[str] | None = None, dry_run: bool = False,
          started: float | None = None, extra: Mapping | None = None) -> WriteReport:
    """Plan, lay out, copy and commit `source` at `dst` as `target` says; report what was done."""
    started = time.perf_counter() if started is None else started
    dst = Path(dst)
    plan = make_target_plan(source, target, names)
    writer = target.format.writer(WriterOptions(name=dst.name, framework=target.framework,
                                                source_framework=source.framework,
                                                max_shard_bytes=target.max_shard_bytes, crc=target.crc))
    layouts = not target.format.whole_tensors
    if dry_run:  # nothing is read but the metadata
        written = read = 0
        files, skipped, ranks = len(writer.expected_files(plan)), (), tuple(rank_stats(plan, source))
    else:
        result = write_plan(plan, source, writer, dst, settings, file_output=target.format.destination == "file",
                            fan_out=target.ranks is not None)
        written, read, files, ranks = result.bytes_written, result.bytes_read, result.files, result.ranks
        skipped = tuple(sorted({fqn for fqn, _ in result.skipped}))
    summary = PlanSummary(plan.world_size, ranks, files) if layouts else None
    return WriteReport(
        command=command, source=str(src), destination=str(dst), source_format=source.format,
        format=target.format.name, bytes_written=written, bytes_read=read,
        seconds=time.perf_counter() - started, files=files, dry_run=dry_run, plan=summary,
        finalized=(target.ranks is None) if layouts and not dry_run else None, skipped=skipped,
        **(dict(extra) if extra else {}))
