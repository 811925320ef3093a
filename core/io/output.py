"""What a format writer hands the engine: every output file, its fixed bytes and where each box goes.

A writer never moves a byte of tensor data. Given a frozen `core.geometry.plan.Plan` it returns an
`OutputLayout`: for each file its size, the bytes it already knows (headers, pickles, small
records) at their offsets, and for each planned box the byte ranges (`Extent`s, in C order) its
data goes to; ranges whose CRC-32 the format needs (zip records, a `.ckpt` trailer) are named too.
The engine fills the files from the source; the writer's `finish` then turns the CRCs into the
bytes that depended on them (`Finished.patches`) and the metadata files, written last.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpckpt.core.geometry.plan import PlannedBox, PlannedTensor


@dataclass(frozen=True, slots=True)
class Extent:
    """`nbytes` bytes of a file at byte `offset`; ranges are `[offset, offset + nbytes)`."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """Where one planned box's bytes go: row-major, spread over `extents` in order (one extent
    unless the format cuts a large tensor, as MindSpore's `.ckpt` does). With `checksum`, the
    engine reports the CRC-32 of those bytes under that id."""

    tensor: PlannedTensor
    box: PlannedBox
    extents: tuple[Extent, ...]
    checksum: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.extents)


@dataclass(frozen=True)
class FileLayout:
    """One data file: `size` bytes, `fixed` bytes at offsets, `boxes` filled by the engine, and
    `checksums` `(id, offset, nbytes)`: CRC-32 of a range, taken once the file's data is in."""

    name: str
    size: int
    fixed: tuple[tuple[int, bytes], ...] = ()
    boxes: tuple[Placement, ...] = ()
    checksums: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class OutputLayout:
    """Every data file a plan's producing ranks write, the entries the format cannot hold
    (`skipped`: `(fqn, reason)`) and those it holds only in another kind (`converted`: a Python
    int a `.ckpt` stores as a 0-d tensor); both are reported to the user, never passed off."""

    files: tuple[FileLayout, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    converted: tuple[tuple[str, str], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for f in self.files for p in f.boxes)


@dataclass(frozen=True)
class Finished:
    """What a writer adds once the data is in: `patches` `(file, offset, bytes)` over the data
    files, and `metadata` `(name, bytes)` files, written after every data file is durable (their
    presence is what marks the output complete)."""

    patches: tuple[tuple[str, int, bytes], ...] = ()
    metadata: tuple[tuple[str, bytes], ...] = ()
