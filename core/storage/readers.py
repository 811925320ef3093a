"""Ranged reads from either kind of file through one call: a handle is a local file descriptor
(an int, read with `preadv`) or an `ObjectReader` (read with ranged GETs). Code that reads byte
ranges takes a handle and calls `read_at`, `handle_size` and `close_handle`; code that wants a
file object gets `ObjectFile`, a seekable raw file over ranged GETs (buffer it)."""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from hpckpt.core.storage.object_path import ObjectPath
    from hpckpt.core.storage.object_store import ObjectInfo


class ObjectReader:
    """An object opened for ranged reads: its size and tag are fixed when opened (from the
    listing or a HEAD), so a read past its end is a short read, as on a truncated file, and a
    read of an object replaced since is an error (`core.storage.object_store`)."""

    __slots__ = ("path", "info")

    def __init__(self, path: "ObjectPath", info: "ObjectInfo"):
        self.path, self.info = path, info

    @property
    def size(self) -> int:
        return self.info.size

    def read_into(self, view: memoryview, offset: int) -> int:
        return self.path.store.read_into(self.path.key, offset, view, self.info)


Handle = Union[int, ObjectReader]


def read_at(handle: Handle, view: memoryview, offset: int) -> int:
    """Read into `view` from `offset`; returns the bytes read (0 at the end)."""
    if isinstance(handle, int):
        return os.preadv(handle, [view], offset)
    return handle.read_into(view, offset)


def handle_size(handle: Handle) -> int:
    return os.fstat(handle).st_size if isinstance(handle, int) else handle.size


def close_handle(handle: Handle) -> None:
    if isinstance(handle, int):
        os.close(handle)


class ObjectFile(io.RawIOBase):
    """A read-only, seekable raw file over an object's ranged GETs; wrap it in
    `io.BufferedReader` so that small reads share one request."""

    def __init__(self, reader: ObjectReader):
        super().__init__()
        self.reader, self._pos = reader, 0
        self.name = str(reader.path)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        n = self.reader.read_into(view, self._pos) if len(view) else 0
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.reader.size}[whence]
        if base + offset < 0:
            raise OSError(f"{self.name}: seek before the start")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def pread(handle: Handle, nbytes: int, offset: int) -> bytes:
    """`os.pread` for either kind of handle: up to `nbytes` (fewer at the end of the file)."""
    if isinstance(handle, int):
        return os.pread(handle, nbytes, offset)
    buffer = bytearray(max(0, nbytes))
    return bytes(buffer[:handle.read_into(memoryview(buffer), offset)]) if nbytes > 0 else b""


def handle_of(file) -> Handle:
    """The handle under a file object from `core.safety.input_files.open_file`."""
    raw = getattr(file, "raw", file)
    return raw.reader if isinstance(raw, ObjectFile) else file.fileno()


def file_size(file) -> int:
    return handle_size(handle_of(file))
