"""Read any box of any tensor into numpy with ranged reads (`pread`), never whole files.

A region of a stored chunk is fetched with one read of its byte span when that span fits the
read budget (then gathered with a strided view), else it is split along its outermost dimension
and each part is read on its own. So a row shard costs one read, and a column slice of a huge
chunk costs one read per row instead of reading the chunk whole.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hpckpt.core.errors import CorruptDataError, GeometryError
from hpckpt.core.geometry.box import Box, full_box
from hpckpt.core.index import BufferLocation, CheckpointIndex, Location, TensorEntry
from hpckpt.core.safety import input_files
from hpckpt.core.storage.readers import Handle, close_handle, read_at

DEFAULT_READ_BUDGET = 64 * 1024 * 1024


def open_data_file(path: Path, what: str = "data file") -> BinaryIO:
    """Open a checkpoint's data file for reading (`core.safety.input_files`): a missing or unreadable one
    is a MissingFileError; a directory, FIFO or device where the file should be a CorruptDataError
    (`what` names what was expected)."""
    return input_files.open_file(path, what)


class OpenFiles:
    """A small LRU of read-only handles (file descriptors, or objects of a store), so reading many
    chunks reopens nothing."""

    def __init__(self, limit: int = 64):
        self._fds: OrderedDict[Path, Handle] = OrderedDict()
        self._limit = limit
        self.bytes_read = 0  # by `read_region`: what a load reports as read from storage

    def fd(self, path: Path) -> Handle:
        fd = self._fds.pop(path, None)
        if fd is None:
            fd = input_files.open_handle(path)  # once per file: the LRU keeps it
            while len(self._fds) >= self._limit:
                _, old = self._fds.popitem(last=False)
                close_handle(old)
        self._fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            close_handle(fd)
        self._fds.clear()

    def __enter__(self) -> "OpenFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pread_exact(fd: Handle, nbytes: int, offset: int, path: Path, into: memoryview | None = None) -> memoryview:
    """Read exactly `nbytes` at `offset`; a short read means the file is truncated."""
    buf = into if into is not None else memoryview(bytearray(nbytes))
    done = 0
    while done < nbytes:
        n = read_at(fd, buf[done:nbytes], offset + done)
        if n == 0:
            raise CorruptDataError(
                f"{path}: truncated: needed bytes [{offset}, {offset + nbytes}) but the file ends at {offset + done}"
            )
        done += n
    return buf


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def read_region(files: OpenFiles, loc: Location | BufferLocation, region: Box, out: np.ndarray,
                budget: int = DEFAULT_READ_BUDGET) -> None:
    """Copy `region` (in the chunk's local coordinates) of the chunk at `loc` into `out`."""
    if region.is_empty:
        return
    if isinstance(loc, BufferLocation):
        out[...] = loc.array[region.slices()] if region.ndim else loc.array
        return
    strides = loc.strides if loc.strides is not None else _c_strides(loc.stored_shape)
    itemsize = loc.stored_dtype.itemsize
    start = loc.offset + sum(o * s for o, s in zip(region.offsets, strides)) * itemsize
    files.bytes_read += _read_strided(files.fd(loc.path), loc.path, start, region.sizes, strides, itemsize,
                                      np.dtype(loc.stored_dtype.numpy_storage), out, budget)


def _read_strided(fd: Handle, path: Path, start: int, sizes: tuple[int, ...], strides: tuple[int, ...],
                  itemsize: int, np_dtype: np.dtype, out: np.ndarray, budget: int) -> int:
    """Fill `out`; returns the bytes read."""
    span = (sum((z - 1) * s for z, s in zip(sizes, strides)) + 1) * itemsize
    needed = itemsize
    for z in sizes:
        needed *= z
    dense_in_order = all(z <= 1 or s == c for z, s, c in zip(sizes, strides, _c_strides(sizes)))
    if span == needed and dense_in_order and out.flags.c_contiguous:  # (a permutation is dense too)
        pread_exact(fd, span, start, path, memoryview(out.reshape(-1).view(np.uint8)))
        return span
    if span <= budget or not sizes:
        raw = np.frombuffer(pread_exact(fd, span, start, path), dtype=np_dtype)
        out[...] = np.lib.stride_tricks.as_strided(
            raw, shape=sizes, strides=tuple(s * itemsize for s in strides), writeable=False
        )
        return span
    # Too wide for one read: cut along the dim with the largest stride (the outermost in storage,
    # not necessarily dim 0: for a transposed view it is the last), in blocks whose span fits.
    d = max(range(len(sizes)), key=lambda i: (sizes[i] > 1, strides[i]))
    rest = (span // itemsize) - (sizes[d] - 1) * strides[d]
    block = max(1, (budget // itemsize - rest) // max(strides[d], 1) + 1)
    done = 0
    for j in range(0, sizes[d], block):
        k = min(block, sizes[d] - j)
        index = (slice(None),) * d + (slice(j, j + k),)
        done += _read_strided(fd, path, start + j * strides[d] * itemsize, sizes[:d] + (k,) + sizes[d + 1:], strides,
                      itemsize, np_dtype, out[index], budget)
    return done


def read_box(index: CheckpointIndex, entry: TensorEntry, box: Box | None = None,
             files: OpenFiles | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Return `box` (default: the whole tensor) of `entry`, assembled from its stored chunks.

    bfloat16 and float8 come back as raw unsigned integers of the same width (bit-exact).

    Raises:
        GeometryError: part of the box is covered by no stored chunk.
    """
    box = box or full_box(entry.shape)
    if out is None:
        out = np.empty(box.sizes, dtype=entry.dtype.np)
    own_files = files is None
    files = files or OpenFiles()
    try:
        covered = 0
        seen: set[Box] = set()
        for chunk in entry.chunks:
            if chunk.box in seen:
                continue  # an identical replica: read one copy
            overlap = chunk.box.intersect(box)
            if overlap is None:
                continue
            seen.add(chunk.box)
            loc = index.locate(chunk, entry)
            dest = out[overlap.relative_to(box).slices()] if overlap.ndim else out
            read_region(files, loc, overlap.relative_to(chunk.box), dest)
            covered += overlap.volume
        if covered < box.volume:
            raise GeometryError(
                f"{entry.fqn}: stored chunks cover {covered} of the {box.volume} elements of {box}"
            )
    finally:
        if own_files:
            files.close()
    return out
