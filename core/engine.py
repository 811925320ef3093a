"""The copy engine: executes a `Plan` into safetensors files in bounded memory.

Every output file's header is computed up front from the plan, so each tensor's bytes are written
in place. A target tensor is filled tile by tile: a tile is a block of whole rows (contiguous in
the output) within the memory budget. When one source chunk holds a tile as one contiguous byte
run, the kernel copies it (`copy_file_range`, no user-space buffer); otherwise the tile is
gathered from its pieces with ranged reads into one buffer and written with one `pwrite`.
Files are filled in parallel, one per worker thread (I/O and numpy copies release the GIL).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from hpckpt.core.box import Box
from hpckpt.core.cast import cast
from hpckpt.core.index import CheckpointIndex, Location
from hpckpt.core.plan import Plan, TargetFile, TargetTensor
from hpckpt.core.read import OpenFiles, read_region
from hpckpt.core.staging import fsync_files, start_writeback

DEFAULT_MAX_MEMORY = 64 * 1024 * 1024  # tiles this size already move at disk speed
Progress = Callable[[int], None]


def default_jobs() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def contiguous_tiles(sizes: tuple[int, ...], itemsize: int, budget: int) -> Iterator[Box]:
    """Split a C-ordered array of `sizes` into tiles of at most `budget` bytes (at least one
    element), each a contiguous byte run: whole trailing dims, a block along one dim, single
    indices before it."""
    ndim = len(sizes)
    if ndim == 0 or math.prod(sizes) == 0:
        if ndim == 0:
            yield Box((), ())
        return
    inner, k = itemsize, ndim
    while k > 0 and inner * sizes[k - 1] <= budget:
        inner *= sizes[k - 1]
        k -= 1
    if k == 0:
        yield Box((0,) * ndim, sizes)
        return
    step = max(1, budget // inner)
    outer = sizes[: k - 1]
    for index in np.ndindex(*outer) if outer else [()]:
        for start in range(0, sizes[k - 1], step):
            n = min(step, sizes[k - 1] - start)
            yield Box(tuple(int(i) for i in index) + (start,) + (0,) * (ndim - k),
                      (1,) * len(outer) + (n,) + tuple(sizes[k:]))


def _linear(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    position = 0
    for o, n in zip(offsets, shape):
        position = position * n + o
    return position


def _contiguous_in(region: Box, shape: tuple[int, ...]) -> bool:
    """True when `region` (local coordinates) is one contiguous run of a C-ordered `shape`."""
    d = region.ndim - 1
    while d >= 0 and region.offsets[d] == 0 and region.sizes[d] == shape[d]:
        d -= 1
    return d < 0 or all(s == 1 for s in region.sizes[:d])


def _copy_range(src_fd: int, dst_fd: int, count: int, src_offset: int, dst_offset: int) -> None:
    """Kernel-side copy; falls back to read/write where copy_file_range is not possible."""
    done = 0
    try:
        while done < count:
            n = os.copy_file_range(src_fd, dst_fd, count - done, src_offset + done, dst_offset + done)
            if n == 0:
                raise OSError("copy_file_range copied nothing (source truncated?)")
            done += n
        return
    except (OSError, AttributeError):
        pass
    while done < count:
        chunk = os.pread(src_fd, min(count - done, 64 * 1024 * 1024), src_offset + done)
        if not chunk:
            raise OSError(f"source ended {count - done} bytes early")
        os.pwrite(dst_fd, chunk, dst_offset + done)
        done += len(chunk)


class TileCopier:
    """Copies target tensors out of their source pieces, one contiguous tile at a time.

    `out_fd` is the file `write` fills unless a call names another (writers that own their file,
    torch.save and .ckpt, pass theirs per tensor); `buffers` needs none.
    """

    def __init__(self, index: CheckpointIndex, files: OpenFiles, out_fd: int, budget: int, progress: Progress,
                 *, writeback: bool = False):
        self.index = index
        self.files = files
        self.out_fd = out_fd
        self.budget = budget
        self.progress = progress
        self.writeback = writeback  # start writing each range to disk as soon as it is copied
        self._buffer: np.ndarray | None = None

    def _written(self, fd: int, dest: int, count: int) -> None:
        if self.writeback:
            start_writeback(fd, dest, count)
        self.progress(count)

    def _location(self, piece, target: TargetTensor) -> Location:
        return self.index.locate(piece.chunk, self.index.tensors[target.fqn])

    def write(self, target: TargetTensor, base: int, out_fd: int | None = None) -> None:
        """Fill the tensor at byte `base` of the output file (`out_fd`, default the copier's),
        tile by tile."""
        fd = self.out_fd if out_fd is None else out_fd
        for tile, dest, parts in self._tiles(target, base):
            if target.source_dtype is None and self._direct(parts, tile, target, fd, dest):
                continue
            data = self._gather(target, tile, parts)
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], dest + written)
            self._written(fd, dest, len(data))

    def buffers(self, target: TargetTensor) -> Iterator[memoryview]:
        """The tensor's bytes in order, one tile at a time (for writers that append); each view is
        valid only until the next one is asked for (they share one buffer)."""
        for tile, _dest, parts in self._tiles(target, 0):
            data = self._gather(target, tile, parts)
            self.progress(len(data))
            yield data

    def _tiles(self, target: TargetTensor, base: int):
        itemsize = target.dtype.itemsize
        sizes = target.box.sizes
        for tile_local in contiguous_tiles(sizes, itemsize, self.budget):
            tile = Box(tuple(o + t for o, t in zip(target.box.offsets, tile_local.offsets)), tile_local.sizes)
            dest = base + _linear(tile_local.offsets, sizes) * itemsize
            parts = [(p, p.region.intersect(tile) if tile.ndim else tile) for p in target.pieces]
            yield tile, dest, [(p, r) for p, r in parts if r is not None]

    def _scratch(self, nbytes: int) -> np.ndarray:
        """One reused tile buffer: no page faults for a fresh buffer per tile, and never two
        tiles in memory at once. Its bytes are only valid until the next tile."""
        if self._buffer is None or self._buffer.size < nbytes:
            self._buffer = None  # free the old one before allocating the bigger one
            self._buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        return self._buffer[:nbytes]

    def _gather(self, target: TargetTensor, tile: Box, parts) -> memoryview:
        """Read every piece of `tile` into the tile buffer (casting if asked); return its bytes."""
        source = target.source_dtype or target.dtype
        buffer = self._scratch(tile.volume * source.itemsize).view(source.np).reshape(tile.sizes)
        for piece, region in parts:
            loc = self._location(piece, target)
            view = buffer[region.relative_to(tile).slices()] if region.ndim else buffer
            read_region(self.files, loc, region.relative_to(piece.chunk.box), view)
        if source != target.dtype:
            buffer = np.require(cast(buffer, source, target.dtype), requirements="C")
        return memoryview(buffer.reshape(-1).view(np.uint8))

    def _direct(self, parts, tile: Box, target: TargetTensor, fd: int, dest: int) -> bool:
        """Copy a tile in the kernel when each of its pieces is one contiguous byte run both in
        its source chunk and in the tile (e.g. row shards of a whole tensor); else do nothing."""
        itemsize = target.dtype.itemsize
        runs = []
        for piece, region in parts:
            loc = self._location(piece, target)
            local = region.relative_to(piece.chunk.box)
            in_tile = region.relative_to(tile)
            if (loc.strides is not None or not _contiguous_in(local, piece.chunk.box.sizes)
                    or not _contiguous_in(in_tile, tile.sizes)):
                return False
            runs.append((loc.path, loc.offset + _linear(local.offsets, piece.chunk.box.sizes) * itemsize,
                         dest + _linear(in_tile.offsets, tile.sizes) * itemsize, region.volume * itemsize))
        for path, start, at, count in runs:
            _copy_range(self.files.fd(path), fd, count, start, at)
            self._written(fd, at, count)
        return True


def safetensors_header(target: TargetFile, metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The header bytes of a target file and each tensor's data offset (relative to the buffer)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offsets, position = [], 0
    for t in target.tensors:
        header[t.key] = {"dtype": t.dtype.safetensors, "shape": list(t.box.sizes),
                         "data_offsets": [position, position + t.nbytes]}
        offsets.append(position)
        position += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def write_target_file(path: Path, target: TargetFile, index: CheckpointIndex, *, budget: int,
                      progress: Progress, metadata: dict[str, str] | None = None, sync: bool = True) -> None:
    """Write one safetensors file of the plan: header first, then every tensor in place.

    With `sync`, writeback starts range by range as the data is copied; the caller fsyncs the
    file (see `execute`), which then has only the tail left to wait for.
    """
    head, offsets = safetensors_header(target, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, len(head) + target.nbytes)
        os.pwrite(fd, head, 0)
        with OpenFiles() as files:
            writer = TileCopier(index, files, fd, budget, progress, writeback=sync)
            for t, offset in zip(target.tensors, offsets):
                writer.write(t, len(head) + offset)
        if sync:
            start_writeback(fd)  # the header and anything left
    finally:
        os.close(fd)


def write_values(path: Path, values: list[tuple[str, bytes]]) -> None:
    """The non-tensor values, concatenated in plan order (their offsets are in the metadata)."""
    with open(path, "wb") as f:
        for _fqn, payload in values:
            f.write(payload)


def execute(plan: Plan, index: CheckpointIndex, out_dir: Path, *, jobs: int | None = None,
            max_memory: int = DEFAULT_MAX_MEMORY, progress: Progress | None = None,
            file_metadata: dict[str, str] | None = None, sync: bool = True) -> None:
    """Write every tensor file and the values file of `plan` into `out_dir` (metadata excluded);
    with `sync`, all of them are on disk when this returns."""
    jobs = max(1, jobs or default_jobs())
    lock = threading.Lock()

    def report(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    budget = max(1, max_memory // jobs)
    written = [out_dir / f.name for f in plan.files]
    if plan.values and plan.values_rank in plan.producing:
        write_values(out_dir / f"_rank{plan.values_rank}_.bytes", plan.values)
        written.append(out_dir / f"_rank{plan.values_rank}_.bytes")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(write_target_file, out_dir / f.name, f, index, budget=budget,
                               progress=report, metadata=file_metadata, sync=sync) for f in plan.files]
        for future in futures:
            future.result()
    if sync:
        fsync_files(written)
