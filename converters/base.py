"""The format protocol: one `Format` per checkpoint format, with a reader half and a writer half.

Every command is one pipeline (`hpckpt.api.pipeline`):

    open -> select -> layout -> plan -> writer -> engine -> commit -> report

and a format takes part in two of its steps, through the objects below. Nothing else in hpckpt
knows a format's file names, metadata classes or byte layout.

Reading (`FormatReader`), in this order:

1. (`converters.detect`) `sniff(path)` on every registered reader, in registry order: cheap,
   file names and a few header bytes, never a whole file. The first that answers True wins.
2. (`converters.open_index`) `read_index(path)` parses and validates the metadata and returns a
   `core.index.CheckpointIndex` whose locator reaches the data lazily, chunk by chunk.

Writing (`FormatWriter`), one writer object per run, in this order:

1. (pipeline) `layout(plan, values)`, once, with the frozen, format-neutral `core.geometry.plan.Plan` and
   the decoded non-tensor values: returns a `core.io.output.OutputLayout`, every data file the plan's
   producing ranks write, with its size, the bytes the format knows up front (headers, pickles,
   small records) at their offsets, where each planned box's bytes go (byte ranges, in row-major
   order), which ranges need a CRC-32, and what the format cannot hold (`skipped`, with reasons).
   The writer never copies tensor bytes; it only says where they go.
2. (engine, `core.io.engine`) creates the files in the staging directory, writes the fixed bytes,
   fills every box from the source (a checkpoint on disk, or arrays in memory) and computes the
   CRC-32s asked for.
3. (pipeline) `finish(crcs)` returns a `core.io.output.Finished`: the bytes that depended on the
   data (zip descriptors and directories, a `.ckpt` CRC trailer) as patches, and the metadata
   files of the whole plan (every rank, also in a fan-out run), which the commit writes last.
Any time, `expected_files(plan)` names the data files the plan's producing ranks write, without
reading a value or a byte of data: what `--plan` counts, and (with every rank producing) what a
fan-out `finalize` waits for.

To add a format: write a module in `converters/` with a reader and/or a writer class following
these protocols and add its `Format` to `converters.FORMATS` (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.output import Finished, OutputLayout


class FormatReader(Protocol):
    """Reads one checkpoint format into a `CheckpointIndex`."""

    def sniff(self, path: Path) -> bool:
        """Return True when `path` is a checkpoint of this format (cheaply)."""

    def read_index(self, path: Path) -> CheckpointIndex:
        """Parse `path`. Raises typed `HpckptError`s naming the file and entry at fault."""


@dataclass(frozen=True)
class WriterOptions:
    """What a writer may be asked besides the plan.

    `framework` ("torch", "mindspore" or None) is how dtypes and file flavours are spelled when
    the user asks; `source_framework` is the source's, for formats that keep it by default.
    `name` is the destination's file name (single-file formats name their file after it).
    """

    name: str = ""
    framework: str | None = None
    source_framework: str | None = None
    source_version: str | None = None  # the source's format version, which a writer of that format keeps
    max_shard_bytes: int = 5 * 10**9
    crc: bool = False
    user_metadata: tuple[tuple[str, str], ...] = ()  # a safetensors source's own __metadata__ keys
    layout: Any = None  # the target's `LayoutSpec`, for formats that record each tensor's layout (MindFormers)


class FormatWriter(Protocol):
    """Lays out a plan in one format's files; see the module docstring for the call order."""

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout: ...

    def finish(self, crcs: Mapping[str, int]) -> Finished: ...

    def expected_files(self, plan: Plan) -> list[str]: ...


def left_out_by_name(writer: Any, values: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """`(fqn, reason)` of the `values` a writer (its class or an instance) leaves out whatever
    they hold, for a writer that says so (`dropped_by_name`: MindFormers'): what a dry run can
    report without reading them, as the run will."""
    say = getattr(writer, "dropped_by_name", None)
    return tuple(say(values)) if say is not None else ()


@dataclass(frozen=True)
class Format:
    """One checkpoint format: its name (the one word every command and document uses), the
    names it also answers to, and its halves.

    `destination` is "dir" or "file"; `whole_tensors` formats store every tensor whole (one
    rank), so any plan given to them is a consolidation; `layouts` formats store any layout.
    `every_replica`: the format can also store each replicated box once per rank holding it (the
    others store a box once). `after_commit(dest)`, where set, runs once the output is committed
    and returns `(paths written beside it, warnings)`: what a format keeps outside its checkpoint
    directory (MindFormers' tracker file in the directory above).
    """

    name: str
    description: str
    aliases: tuple[str, ...] = ()
    reader: FormatReader | None = None
    writer: type | None = None  # called with WriterOptions, gives a FormatWriter
    destination: str = "dir"
    whole_tensors: bool = False
    extensions: tuple[str, ...] = ()
    every_replica: bool = False
    after_commit: Callable[[Path], tuple[tuple[str, ...], tuple[str, ...]]] | None = None
