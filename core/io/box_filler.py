"""Filling the boxes of one output file from the source: the engine's worker, one per file.

A tile that one source chunk holds as one contiguous run is copied without a buffer (by the kernel;
from a mapping of the source a MiB at a time when summing; straight from an array in memory); any
other is gathered into one buffer, cast if asked and written with one `pwrite`. Each box's digest,
and its CRC-32 when the format records one (zip members), are taken from the bytes as they are
written, so no byte is read back. Writeback is started as ranges complete, and the worker stops at
its next range once the stop flag is set.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from hpckpt.core.commit.durable import start_writeback
from hpckpt.core.errors import CorruptDataError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.tiles import contiguous_in, contiguous_tiles, linear
from hpckpt.core.index import BufferLocation, CheckpointIndex, Chunk, Location
from hpckpt.core.io import digest
from hpckpt.core.io.cast import cast
from hpckpt.core.io.crc import crc32
from hpckpt.core.io.output import Extent, Placement
from hpckpt.core.io.read import OpenFiles, read_region
from hpckpt.core.storage.readers import read_at

WRITEBACK_SPAN = 8 * 1024 * 1024  # writeback is started in aligned spans of this size (docs/design-figures.md)
WRITE_PIECE, WRITE_ALIGN = 2 * 1024 * 1024, 64 * 1024  # how gathered bytes are handed to pwrite
# hashed copies from a file are mapped: from MAP_MIN, MAP_SPAN at a time (the mapped pages count in
# the RSS: a 2 GiB reshard peaks at 57 MiB with these, 41 MiB unhashed, 104 MiB with 64 MiB spans)
MAP_MIN, MAP_SPAN = 4 * 1024 * 1024, 8 * 1024 * 1024
COPY_PIECE = 1024 * 1024  # hashed copies go piece by piece, each written while a core still caches it
Progress = Callable[[int], None]


class Stopped(Exception):
    """Raised in a worker that was told to stop: the run it belongs to is failing already."""


def check_stop(stop: threading.Event) -> None:
    if stop.is_set():
        raise Stopped


def copy_range(src_fd: int, dst_fd: int, count: int, src_offset: int, dst_offset: int, source: Path) -> None:
    """Kernel-side copy; falls back to read/write where copy_file_range is not possible.

    Raises:
        CorruptDataError: `source` ends before the range does (truncated since its metadata was read).
    """
    done = 0
    try:
        while done < count:
            n = os.copy_file_range(src_fd, dst_fd, count - done, src_offset + done, dst_offset + done)
            if n == 0:
                break  # end of the source, or a file system that copies nothing: read/write tells which
            done += n
        if done == count:
            return
    except (OSError, AttributeError):
        pass
    while done < count:
        chunk = os.pread(src_fd, min(count - done, 64 * 1024 * 1024), src_offset + done)
        if not chunk:
            raise _truncated(source, src_offset, count, f"the file ends at {src_offset + done}")
        os.pwrite(dst_fd, chunk, dst_offset + done)
        done += len(chunk)


def _piece_length(at: int, left: int) -> int:
    """How much of `left` bytes to hash and write at output offset `at` in one piece: about
    `COPY_PIECE`, ending on a `WRITE_ALIGN` boundary (see `pwrite_all`)."""
    return min(left, (at + COPY_PIECE) // WRITE_ALIGN * WRITE_ALIGN - at)


def _truncated(path: Path, offset: int, count: int, found: str = "the file is shorter now") -> CorruptDataError:
    return CorruptDataError(f"{path}: truncated: needed bytes [{offset}, {offset + count}) but {found}",
                            hint="was it changed during the run?")


def _runs(extents: tuple[Extent, ...], start: int, nbytes: int) -> list[tuple[int, int, int]]:
    """Bytes `[start, start + nbytes)` of a box's row-major stream as `(file offset, length,
    offset in the range)` runs over its extents."""
    if len(extents) == 1:
        return [(extents[0].offset + start, nbytes, 0)]
    out, base = [], 0
    for extent in extents:
        lo, hi = max(start, base), min(start + nbytes, base + extent.nbytes)
        if lo < hi:
            out.append((extent.offset + lo - base, hi - lo, lo - start))
        base += extent.nbytes
    return out


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write `data` at `offset` in pieces of at most `WRITE_PIECE` bytes ending on 64 KiB file
    boundaries: on this project's VMs a buffered write of a MiB or more can cost several times
    what the same bytes cost in 64 KiB-aligned pieces (large page-cache pages from memory the
    host took back; docs/design-figures.md), and aligned ends give the disk whole requests."""
    done = 0
    while done < len(data):
        at = offset + done
        n = min(len(data) - done, (at + WRITE_PIECE) // WRITE_ALIGN * WRITE_ALIGN - at)
        done += os.pwrite(fd, data[done:done + n], at)



Pieces = list[tuple[Chunk, Box]]


class Filled(NamedTuple):
    """What was taken of a box's bytes as they were written: its digest (None when not hashing)
    and its CRC-32 (None unless its placement asks for one)."""

    digest: str | None
    crc: int | None


class _Sums:
    """The digest and the CRC-32 of one box, updated piece by piece from the bytes written, while a
    core still caches them: one pass over the bytes serves the copy and both sums."""

    def __init__(self, hashing: bool, crc: bool):
        self.hasher = digest.new() if hashing else None
        self.crc = 0 if crc else None

    def update(self, piece: memoryview) -> None:
        if self.hasher is not None:
            self.hasher.update(piece)
        if self.crc is not None:
            self.crc = crc32(piece, self.crc)

    def result(self) -> Filled:
        return Filled(None if self.hasher is None else self.hasher.hexdigest(), self.crc)


class BoxFiller:
    """Fills planned boxes of one output file from their source pieces, one tile at a time."""

    def __init__(self, index: CheckpointIndex, files: OpenFiles, fd: int, budget: int, progress: Progress,
                 writeback: bool, stop: threading.Event, hashing: bool = True):
        self.index, self.files, self.fd = index, files, fd
        self.budget, self.progress, self.writeback = budget, progress, writeback
        self.stop = stop
        self.hashing = hashing
        self._buffer: np.ndarray | None = None
        self._sums: _Sums | None = None  # the box being filled's, None when nothing is summed
        self._piece: memoryview | None = None  # the buffer of small hashed copies (`_copy_buffered`)
        self._flushed = 0  # writeback has been started for the file's bytes before this offset

    def fill(self, placement: Placement, pieces: Pieces) -> Filled:
        """Write the box; return its digest (`core.io.digest`) and the CRC-32 its placement asks
        for, both taken from the bytes as they are written (tiles come in the box's C order)."""
        tensor, box = placement.tensor, placement.box.box
        entry = self.index.tensors[tensor.fqn]
        itemsize = tensor.dtype.itemsize
        needs_crc = placement.checksum is not None
        self._sums = _Sums(self.hashing, needs_crc) if self.hashing or needs_crc else None
        for tile_local in contiguous_tiles(box.sizes, itemsize, self.budget):
            check_stop(self.stop)
            tile = Box(tuple(o + t for o, t in zip(box.offsets, tile_local.offsets)), tile_local.sizes)
            start = linear(tile_local.offsets, box.sizes) * itemsize
            parts = [(chunk, region.intersect(tile) if tile.ndim else tile) for chunk, region in pieces]
            parts = [(chunk, region) for chunk, region in parts if region is not None]
            if tensor.source_dtype == tensor.dtype and self._direct(entry, parts, tile, itemsize, placement, start):
                continue
            data = self._gather(entry, tile, parts, tensor.source_dtype, tensor.dtype)
            for at, count, skip in _runs(placement.extents, start, len(data)):
                self._write(data[skip:skip + count], at)
                self._written(at, count)
        return Filled(None, None) if self._sums is None else self._sums.result()

    def _write(self, data: memoryview, at: int) -> None:
        """Write bytes from memory, summing them when asked: a piece at a time, each summed just
        before its write, so that the write copies it from cache rather than from memory again."""
        if self._sums is None:
            pwrite_all(self.fd, data, at)
            return
        done = 0
        while done < len(data):
            piece = data[done:done + _piece_length(at + done, len(data) - done)]
            self._sums.update(piece)
            pwrite_all(self.fd, piece, at + done)
            done += len(piece)

    def _copy_from_file(self, path: Path, offset: int, count: int, at: int) -> None:
        """Copy a byte range of a source file to the output, summing it on the way when asked
        (digest, CRC-32): the source is read once and the output never.

        With no sum, the kernel copies it (`copy_file_range`). Summed, a range from `MAP_MIN` up is
        mapped, and each piece is summed from the mapping and then written from it with `pwrite`,
        while the sums have left it in this core's cache: one pass over the source serves all.
        That is as fast as the unhashed kernel copy or faster, and faster than the alternatives
        measured (docs/design-figures.md). Smaller ranges cost less read into the piece buffer
        than mapped."""
        fd = self.files.fd(path)
        if not isinstance(fd, int):  # an object in a store: ranged GETs, no kernel copy, no mapping
            self._copy_object(fd, path, offset, count, at)
            return
        if self._sums is None:
            copy_range(fd, self.fd, count, offset, at, path)
            return
        end = offset + count
        if count < MAP_MIN:
            self._copy_buffered(fd, path, offset, end, at - offset)
            return
        if end > os.fstat(fd).st_size:  # never map past the end (SIGBUS)
            raise _truncated(path, offset, count)
        done = offset
        while done < end:
            base = done - done % mmap.ALLOCATIONGRANULARITY
            span = min(end, base + MAP_SPAN) - base
            try:
                mapped = mmap.mmap(fd, span, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=base)
            except OSError:  # a file system that cannot map files
                self._copy_buffered(fd, path, done, end, at - offset)
                return
            # not a `with`: a failed write's traceback still holds a piece of the view, and
            # closing the mapping under it would raise BufferError in place of the write's error
            view = memoryview(mapped)
            self._write(view[done - base:], done + at - offset)
            view.release()
            mapped.close()
            done = base + span

    def _copy_object(self, reader, path: Path, offset: int, count: int, at: int) -> None:
        """Copy an object's byte range to the output through the tile buffer, half a budget at a
        time (each fill is ranged GETs in flight together, whose answers are the other half until
        they are copied in: `core.storage.object_store`)."""
        step = max(1, min(count, self.budget // 2))
        view = memoryview(self._scratch(step))
        for done in range(0, count, step):
            piece = view[:min(step, count - done)]
            if read_at(reader, piece, offset + done) != len(piece):
                raise _truncated(path, offset, count)
            self._write(piece, at + done)

    def _copy_buffered(self, fd: int, path: Path, start: int, end: int, shift: int) -> None:
        """Copy and sum source bytes `[start, end)` to output offset `start + shift` through the
        piece buffer."""
        if self._piece is None:
            self._piece = memoryview(bytearray(COPY_PIECE))
        for done in range(start, end, COPY_PIECE):
            piece = self._piece[:min(COPY_PIECE, end - done)]
            if os.preadv(fd, [piece], done) != len(piece):
                raise _truncated(path, start, end - start)
            self._sums.update(piece)
            pwrite_all(self.fd, piece, done + shift)

    def _written(self, at: int, count: int) -> None:
        """Count the bytes, and start writeback of every whole `WRITEBACK_SPAN` written so far.

        One writeback request per copied range leaves the page shared with the next range to be
        written on its own later, and a disk that limits requests then waits on thousands of
        small ones (docs/design-figures.md). Spans are only a hint,
        so ranges written out of order stay correct; the rest is started when the file is done.
        """
        check_stop(self.stop)
        if self.writeback:
            end = (at + count) // WRITEBACK_SPAN * WRITEBACK_SPAN
            if end > self._flushed:
                start_writeback(self.fd, self._flushed, end - self._flushed)
                self._flushed = end
        self.progress(count)

    def _scratch(self, nbytes: int) -> np.ndarray:
        """One reused tile buffer: no page faults for a fresh buffer per tile, and never two
        tiles in memory at once. Its bytes are only valid until the next tile."""
        if self._buffer is None or self._buffer.size < nbytes:
            self._buffer = None  # free the old one before allocating the bigger one
            self._buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        return self._buffer[:nbytes]

    def _gather(self, entry, tile: Box, parts, source, target) -> memoryview:
        """Read every piece of `tile` into the tile buffer (casting if asked); return its bytes."""
        buffer = self._scratch(tile.volume * source.itemsize).view(source.np).reshape(tile.sizes)
        for chunk, region in parts:
            view = buffer[region.relative_to(tile).slices()] if region.ndim else buffer
            read_region(self.files, self.index.locate(chunk, entry), region.relative_to(chunk.box), view)
        if source != target:
            buffer = np.require(cast(buffer, source, target), requirements="C")
        return memoryview(buffer.reshape(-1).view(np.uint8))

    def _direct(self, entry, parts, tile: Box, itemsize: int, placement: Placement, start: int) -> bool:
        """Write a tile without a tile buffer when each of its pieces is one contiguous byte run
        both in its source and in the tile (e.g. row shards of a whole tensor): a copy from a file
        (`_copy_from_file`), a `pwrite` straight from an array in memory; else do nothing."""
        runs = []
        for chunk, region in parts:
            loc = self.index.locate(chunk, entry)
            local, in_tile = region.relative_to(chunk.box), region.relative_to(tile)
            if not contiguous_in(local, chunk.box.sizes) or not contiguous_in(in_tile, tile.sizes):
                return False
            if isinstance(loc, Location) and loc.strides is None:
                source = (loc.path, loc.offset + linear(local.offsets, chunk.box.sizes) * itemsize)
            elif isinstance(loc, BufferLocation) and loc.array.flags.c_contiguous:
                source = (None, memoryview(loc.array[local.slices()] if local.ndim else loc.array).cast("B"))
            else:
                return False
            runs.append((source, start + linear(in_tile.offsets, tile.sizes) * itemsize, region.volume * itemsize))
        runs.sort(key=lambda run: run[1])  # in the tile's byte order, as the digest takes them
        for (path, source_at), stream_at, count in runs:
            for at, length, skip in _runs(placement.extents, stream_at, count):
                if path is None:
                    self._write(source_at[skip:skip + length], at)
                else:
                    self._copy_from_file(path, source_at + skip, length, at)
                self._written(at, length)
        return True
