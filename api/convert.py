"""`convert` and `convert-ms-torch`: any source into any format, renaming entries on the way.

Renaming happens once, on the source: the entries are presented under their new names (and a
transposed one through permuted strides, `core.view`), and the counters MindSpore and PyTorch
keep differently are computed into memory (`converters.naming.derive`); the pipeline then
writes that view like any other source.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hpckpt.api import pipeline
from hpckpt.api.layouts import check_fit, source_layout
from hpckpt.api.options import Selection, parse_size
from hpckpt.api.reports import WriteReport
from hpckpt.converters import format_for_extension, format_named, open_index
from hpckpt.converters.base import left_out_by_name
from hpckpt.core.commit.lock import holds_source
from hpckpt.core.errors import UnknownFormatError
from hpckpt.core.geometry.layout import LayoutSpec
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.write import WriteSettings
from hpckpt.core.view import renamed_view


def rename(index: CheckpointIndex, rules: Any, select: Selection):
    """Rename and select `index`'s entries: returns (view index, `NameMapping` or None, per-tensor
    dtypes asked by the rules, derived tensors to compute, `(name, reason)` of the entries the
    rules drop). Globs match the source name or the destination name (`--exclude 'optim.*'` works
    whichever side says it); what the user leaves out is not reported, what the rules drop is
    (the mapping returned is of every entry: `NameMapping.selected` is what the selection keeps)."""
    everything = [*index.tensors, *index.values]
    if rules is None:
        return renamed_view(index, {n: None for n in everything if not select.keeps(n)}), None, {}, (), ()
    from hpckpt.converters.naming import map_names

    mapping = map_names(everything, rules, shapes={n: e.shape for n, e in index.tensors.items()})
    renames: dict[str, str | None] = {}
    transposes, casts, dropped = {}, {}, []
    for source, entry in mapping.entries.items():
        if entry.destination is None and select.keeps(source):
            dropped.append((source, entry.note or f"dropped by the name rules ({entry.rule})"))
        keep = entry.destination is not None and select.keeps(source, entry.destination)
        renames[source] = entry.destination if keep else None
        if keep and entry.transpose is not None and source in index.tensors:
            transposes[source] = entry.transpose
        if keep and entry.dtype is not None:
            casts[entry.destination] = entry.dtype
    derived = tuple(d for d in mapping.derived if select.keeps(d.destination))
    return renamed_view(index, renames, transposes), mapping, casts, derived, tuple(dropped)


def target_format(to: str | None, dst: str | Path):
    """The format `--to` names, else the one the destination's extension names.

    Raises:
        ValueError: neither names a format hpckpt writes.
    """
    if to is not None:
        return format_named(to)
    found = format_for_extension(dst)
    if found is None:
        raise ValueError(f"cannot tell the target format of {dst}: pass --to (or name it .pt, .ckpt, .safetensors)")
    return found


@holds_source
def convert(src: str | Path, dst: str | Path, to: str | None = None, *, layout: LayoutSpec | None = None,
            framework: str | None = None, dtype: str | None = None, select: Selection = Selection(),
            rules: Any = None, max_shard_size: str | int = "5GB", crc: bool = False,
            settings: WriteSettings = WriteSettings(), dry_run: bool = False, command: str = "convert",
            index: CheckpointIndex | None = None, skip_unsupported: bool = False,
            keep_replicas: bool = False) -> WriteReport:
    """Convert `src` (any format hpckpt reads) into the format `to` (or the one `dst`'s
    extension names); layout formats keep the source's layout unless `layout` is given.

    `rules` (a `converters.naming.NameRules` or a preset name) renames, transposes and casts
    entries; `framework` picks dtype spellings and file flavours ("torch" or "mindspore");
    `index` is the source's, when the caller has opened it already; `skip_unsupported` leaves out
    (and reports) the tensors whose dtype the target format cannot hold instead of failing;
    `keep_replicas` has every rank holding a replicated box write it (MindFormers' form without
    remove-redundancy).
    """
    started = time.perf_counter()
    fmt = target_format(to, dst)
    source = index if index is not None else open_index(src)
    view, mapping, casts, derived, dropped = rename(source, rules, select)
    extra: dict[str, Any] = {}
    if mapping is not None:
        from hpckpt.converters.naming import mapping_json, render_mapping

        shown = mapping if select.everything else mapping.selected(select.keeps)  # what was asked for
        extra["names"] = {**mapping_json(shown), "table": render_mapping(shown)}
    if dry_run:  # the checks of a real run that need no data: the names, and the layout's fit
        fit = check_fit(layout, view) if layout is not None and not fmt.whole_tensors else []
        left_out = left_out_by_name(fmt.writer, view.values)
        would = {"tensors": len(view.tensors) + len(derived), "values": len(view.values) - len(left_out),
                 "bytes": sum(e.nbytes for e in view.tensors.values())}
        return WriteReport(command=command, source=str(src), destination=str(dst), source_format=source.format,
                           format=fmt.name, bytes_written=0, bytes_read=0, seconds=time.perf_counter() - started,
                           files=0, dry_run=True, would_write=would, skipped=tuple(sorted({*dropped, *left_out})),
                           warnings=(*view.warnings, *fit), **extra)
    if derived:
        from hpckpt.converters.naming import derive_values, with_tensors

        values, inexact = derive_values(source, derived)
        view = with_tensors(view, values, {d.destination: d.dtype for d in derived})
        view.warnings.extend(inexact)
    target = convert_target(fmt, view, layout, framework=framework, dtype=dtype, casts=casts,
                            max_shard_size=max_shard_size, crc=crc, skip_unsupported=skip_unsupported,
                            keep_replicas=keep_replicas)
    return pipeline.write(command, src, dst, view, target, settings, started=started, extra=extra, dropped=dropped)


def convert_target(fmt, view: CheckpointIndex, layout: LayoutSpec | None = None, *, framework: str | None = None,
                   dtype: str | None = None, casts=None, max_shard_size: str | int = "5GB", crc: bool = False,
                   skip_unsupported: bool = False, keep_replicas: bool = False) -> pipeline.Target:
    """What `convert` writes of `view` (the source renamed): `fmt` at `layout`, a layout format
    at the source's own layout when none is given."""
    if not fmt.whole_tensors and layout is None:
        layout = source_layout(view)
    return pipeline.Target(fmt, layout, None, framework, dtype, casts or None, parse_size(max_shard_size), crc,
                           skip_unsupported, every_replica=keep_replicas)


# source format -> the container convert-ms-torch keeps by default (the other framework's file)
_KEEP_KIND = {"hyperparallel": "hyperparallel", "hyperparallel-legacy": "hyperparallel", "torch-dcp": "torch-dcp",
              "hf-sharded": "hf-sharded", "hf-torch-bin": "hf-sharded", "safetensors": "safetensors",
              "mindspore-ckpt": "torch-save", "mindformers": "torch-dcp",
              "torch-save": "mindspore-ckpt"}


def ms_torch_target(src: str | Path, dst: str | Path, *, to: str | None = None, to_format: str | None = None,
                    index: CheckpointIndex | None = None) -> dict:
    """Direction and container of `convert-ms-torch`: the other framework than the source's, and
    the source's kind of container unless `to_format` or the destination's extension says
    otherwise (a PyTorch DCP going to MindSpore becomes a HyperParallel DCP, which MindSpore
    reads; a `.ckpt` or torch.save file asked for the wrong side becomes safetensors).

    Raises:
        UnknownFormatError: the source's framework cannot be told and `to` is not given.
    """
    from hpckpt.converters.naming import detect_direction

    index = index if index is not None else open_index(src)
    if to is None:
        side = index.framework
        if side is None:
            direction = detect_direction([*index.tensors, *index.values])
            side = {"ms-to-torch": "mindspore", "torch-to-ms": "torch"}.get(direction or "")
        if side is None:
            raise UnknownFormatError(f"{src}: cannot tell whether MindSpore or PyTorch wrote it",
                                     hint="pass --to torch or --to mindspore")
        to = "torch" if side == "mindspore" else "mindspore"
    by_extension = format_for_extension(dst)
    fmt = (format_named(to_format).name if to_format else by_extension.name if by_extension else
           _KEEP_KIND.get(index.format, "safetensors"))
    if fmt == "torch-dcp" and to == "mindspore":
        fmt = "hyperparallel"
    if (fmt == "mindspore-ckpt" and to == "torch" or fmt == "torch-save" and to == "mindspore") and to_format is None:
        fmt = "safetensors"
    return {"to": to, "format": fmt, "source_format": index.format}
