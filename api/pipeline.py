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

from hpckpt.api.layouts import check_fit
from hpckpt.api.reports import PlanSummary, WriteReport
from hpckpt.converters import index_cache
from hpckpt.converters.base import Format, WriterOptions, left_out_by_name
from hpckpt.core import dtypes
from hpckpt.core.commit import manifest
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import ReshardOptionError, UnsupportedDTypeError
from hpckpt.core.geometry.layout import LayoutSpec
from hpckpt.core.geometry.plan import Plan, make_plan, out_dtype, whole_tensor_plan
from hpckpt.core.geometry.plan_stats import rank_stats
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.accounting import check_plan, check_source_chunks
from hpckpt.core.io.write import ManifestFields, WriteSettings, write_plan
from hpckpt.core.safety.validate import refuse_interrupted
from hpckpt.core.storage.urls import as_path


@dataclass(frozen=True)
class Target:
    """What to write: a format and, for the formats that store any layout, the target `layout`
    (`None`: one rank, every tensor whole); `ranks` writes only those target ranks (fan-out);
    `dtype` casts floating tensors, `casts` single ones (fqn -> dtype); `framework` spells dtypes
    and file flavours as torch or MindSpore does. A tensor whose dtype the format cannot hold
    fails the run before anything is written, or with `skip_unsupported` is left out and
    reported. `every_replica` stores a replicated box on every rank holding it (formats that
    can: `Format.every_replica`), not once."""

    format: Format
    layout: LayoutSpec | None = None
    ranks: tuple[int, ...] | None = None
    framework: str | None = None
    dtype: str | None = None
    casts: Mapping[str, DType] | None = None
    max_shard_bytes: int = 5 * 10**9
    crc: bool = False
    skip_unsupported: bool = False
    every_replica: bool = False


def make_target_plan(source: CheckpointIndex, target: Target, names: Iterable[str] | None = None) -> Plan:
    """Plan `source` (the entries `names`, default all) onto the target's layout."""
    cast_to = dtypes.dtype(target.dtype) if target.dtype else None
    if target.format.whole_tensors or target.layout is None:
        return whole_tensor_plan(source, names=names, cast_to=cast_to, casts=target.casts)
    world_size = max(target.layout.mesh.ranks) + 1
    return make_plan(source, target.layout, world_size, names=names, ranks=target.ranks, cast_to=cast_to,
                     casts=target.casts, every_replica=target.every_replica)


def _layout_record(target: Target) -> dict:
    """The target mesh and, when one placement list applies to every tensor, its text: what the
    manifest records of the layout (`core.commit.manifest`)."""
    spec = target.layout
    if spec is None or target.format.whole_tensors:
        return {}
    out: dict = {"mesh": list(spec.mesh.shape)}
    if not spec.rules and not spec.layouts:
        out["placements"] = ",".join(map(str, spec.default))
    return out


def manifest_fields(src: str | Path, source: CheckpointIndex, target: Target) -> ManifestFields:
    """What the output's manifest records besides its digests: its format and layout, the
    source's identity, and the listing of the output (`converters.index_cache.snapshot`)."""
    return ManifestFields(target.format.name, _layout_record(target),
                          manifest.source_identity(as_path(src), source.format, source.metadata_files),
                          index_cache.snapshot)


def unsupported(source: CheckpointIndex, target: Target, names: Iterable[str] | None) -> list[tuple[str, str]]:
    """`(fqn, reason)` of every selected tensor whose dtype, as it would be written, the target
    format cannot hold."""
    cast_to = dtypes.dtype(target.dtype) if target.dtype else None
    casts = target.casts or {}
    wanted = None if names is None else set(names)
    out = []
    for fqn, entry in source.tensors.items():
        if wanted is None or fqn in wanted:
            reason = dtypes.unsupported_reason(out_dtype(entry.dtype, casts.get(fqn, cast_to)), target.format.name)
            if reason:
                out.append((fqn, reason))
    return out


def _refuse_or_skip(source: CheckpointIndex, target: Target, names: Iterable[str] | None):
    """The names to plan and the tensors left out for their dtype; raises when not asked to skip.

    Raises:
        UnsupportedDTypeError: a selected tensor's dtype cannot be held and `skip_unsupported` is off.
    """
    refused = unsupported(source, target, names)
    if not refused:
        return names, ()
    if not target.skip_unsupported:
        shown = ", ".join(f"{fqn!r} ({source.tensors[fqn].dtype})" for fqn, _ in refused[:5])
        more = f" and {len(refused) - 5} more" if len(refused) > 5 else ""
        raise UnsupportedDTypeError(f"{target.format.name} cannot hold {len(refused)} tensor(s): {shown}{more}: "
                                    f"{refused[0][1]}", hint="--skip-unsupported leaves them out (and lists them); "
                                    "--exclude or --dtype are the other ways")
    left_out = {fqn for fqn, _ in refused}
    everything = [*source.tensors, *source.values] if names is None else list(names)
    return [n for n in everything if n not in left_out], tuple(refused)


def _source_root(src: str | Path, source: CheckpointIndex | None = None) -> Path:
    """What the destination must not overlap: the checkpoint read; its directory for a file of a
    directory checkpoint given as the source (`DIR/.metadata` as `converters.open_index` reads it,
    `DIR/model.safetensors.index.json`, `DIR/pytorch_model.bin.index.json`: one of its metadata
    files), since writing over a shard next to it would change the checkpoint being read."""
    path = as_path(src)
    if not path.is_file():
        return path
    if path.name.endswith("metadata"):
        return path.parent
    if source is not None and path.name in source.metadata_files:
        try:
            if source.root.is_dir() and path.parent.samefile(source.root):
                return path.parent
        except OSError:
            pass
    return path


def write(command: str, src: str | Path, dst: str | Path, source: CheckpointIndex, target: Target,
          settings: WriteSettings, *, names: Iterable[str] | None = None, dry_run: bool = False,
          started: float | None = None, extra: Mapping | None = None,
          dropped: Iterable[tuple[str, str]] = ()) -> WriteReport:
    """Plan, lay out, copy and commit `source` at `dst` as `target` says; report what was done.

    `dropped` are `(name, reason)` of entries the command decided not to write (a name rule's
    drop), reported as skipped with the rest."""
    started = time.perf_counter() if started is None else started
    dst = as_path(dst)
    refuse_interrupted(source)
    if target.every_replica and not target.format.every_replica:
        raise ReshardOptionError(f"{target.format.name} stores each box once: --keep-replicas is for mindformers",
                                 hint="leave --keep-replicas out")
    names, refused = _refuse_or_skip(source, target, names)
    fit_warnings = () if target.format.whole_tensors else check_fit(target.layout, source, names)
    plan = make_target_plan(source, target, names)
    wanted = None if names is None else set(names)
    check_plan(plan, (f for f in source.tensors if wanted is None or f in wanted),
               (f for f in source.values if wanted is None or f in wanted))
    writer = target.format.writer(WriterOptions(name=dst.name, framework=target.framework,
                                                source_framework=source.framework,
                                                source_version=source.format_version if source.format.startswith(
                                                    "hyperparallel") else None,
                                                max_shard_bytes=target.max_shard_bytes, crc=target.crc,
                                                user_metadata=tuple(source.user_metadata.items()),
                                                layout=None if target.format.whole_tensors else target.layout))
    layouts = not target.format.whole_tensors
    if dry_run:  # nothing is read but the metadata
        written = read = 0
        paths = ()
        left_out = left_out_by_name(writer, (v.fqn for v in plan.values))
        files, skipped, converted = len(writer.expected_files(plan)), tuple(sorted({*refused, *dropped, *left_out})), ()
        ranks = tuple(rank_stats(plan, source))
    else:
        check_source_chunks(plan, source)
        result = write_plan(plan, source, writer, dst, settings, file_output=target.format.destination == "file",
                            fan_out=target.ranks is not None, read_back=target.format.reader.read_index,
                            source_path=_source_root(src, source), fields=manifest_fields(src, source, target))
        written, read, files, ranks = result.bytes_written, result.bytes_read, result.files, result.ranks
        base = dst.parent if target.format.destination == "file" else dst
        paths = tuple(str(base / name) for name in result.names)
        skipped, converted = tuple(sorted({*refused, *dropped, *result.skipped})), tuple(sorted(set(result.converted)))
        if target.format.after_commit is not None and target.ranks is None:
            beside, said = target.format.after_commit(dst)
            paths, fit_warnings = (*paths, *beside), (*fit_warnings, *said)
    summary = PlanSummary(plan.world_size, ranks, files) if layouts else None
    return WriteReport(
        command=command, source=str(src), destination=str(dst), source_format=source.format,
        format=target.format.name, bytes_written=written, bytes_read=read,
        seconds=time.perf_counter() - started, files=files, dry_run=dry_run, plan=summary,
        finalized=(target.ranks is None) if layouts and not dry_run else None, skipped=skipped,
        converted=converted, warnings=(*source.warnings, *fit_warnings), written=paths,
        planned=(plan, ranks) if dry_run else None, **(dict(extra) if extra else {}))
