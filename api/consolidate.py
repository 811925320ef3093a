"""`consolidate`: whole tensors for release or inference, in any format hpckpt writes."""

from __future__ import annotations

import time
from pathlib import Path

from hpckpt.api import pipeline
from hpckpt.api.options import Selection, parse_size
from hpckpt.api.reports import WriteReport
from hpckpt.converters import format_named, open_index
from hpckpt.core.commit.lock import holds_source
from hpckpt.core.geometry.layout import LayoutSpec
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.write import WriteSettings


@holds_source
def consolidate(src: str | Path, out: str | Path, fmt: str = "safetensors", *, select: Selection = Selection(),
                dtype: str | None = None, max_shard_size: str | int = "5GB", framework: str | None = None,
                settings: WriteSettings = WriteSettings(), index: CheckpointIndex | None = None,
                skip_unsupported: bool = False, dry_run: bool = False) -> WriteReport:
    """Merge `src` into whole tensors: one safetensors file, Hugging Face shards, a torch.save
    file, a `.ckpt`, or a one-rank HyperParallel or PyTorch DCP checkpoint. Non-tensor values go
    where the format keeps them (the pt file, a JSON side file for the safetensors formats).
    A tensor whose dtype the format cannot hold fails the run, or is left out and reported with
    `skip_unsupported`. `dry_run` plans and writes nothing.

    Raises:
        ValueError: an unknown format.
    """
    started = time.perf_counter()
    index = index if index is not None else open_index(src)
    target = consolidate_target(fmt, framework=framework, dtype=dtype, max_shard_size=max_shard_size,
                                skip_unsupported=skip_unsupported)
    names = None if select.everything else select.names([*index.tensors, *index.values])
    return pipeline.write("consolidate", src, out, index, target, settings, names=names, started=started,
                          dry_run=dry_run)


def consolidate_target(fmt: str, *, framework: str | None = None, dtype: str | None = None,
                       max_shard_size: str | int = "5GB", skip_unsupported: bool = False) -> pipeline.Target:
    """What `consolidate` writes: every tensor whole, in `fmt` (a layout format on one rank).

    Raises:
        ValueError: an unknown format.
    """
    target_format = format_named(fmt)
    layout = None if target_format.whole_tensors else LayoutSpec.for_world_size(1)
    return pipeline.Target(target_format, layout, None, framework, dtype, max_shard_bytes=parse_size(max_shard_size),
                           skip_unsupported=skip_unsupported)
