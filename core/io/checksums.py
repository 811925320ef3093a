"""CRC-32s of byte ranges of files, streamed through one reused buffer per thread.

Zip-based outputs need the CRC-32 of what was written; sources whose format records a CRC-32
(a torch.save storage's zip member, a MindSpore `.ckpt` trailer) are checked against it before
their data is trusted. Every such sum is taken here, in bounded memory (`CRC_BLOCK_BYTES` per
thread, whatever the range's size).
"""

from __future__ import annotations

import threading
from pathlib import Path

from hpckpt.core.errors import CorruptDataError
from hpckpt.core.io.crc import crc32
from hpckpt.core.io.output import Extent
from hpckpt.core.io.read import open_data_file
from hpckpt.core.storage.readers import handle_of, read_at

CRC_BLOCK_BYTES = 8 * 1024 * 1024
_BUFFERS = threading.local()


def crc_of(fd: int, extents, path: Path | str = "file", crc: int = 0) -> int:
    """CRC-32 of the bytes at `extents` (objects with `offset` and `nbytes`) of `fd`, in order,
    continuing from `crc`.

    Raises:
        CorruptDataError: the file ends before a range does.
    """
    total = sum(e.nbytes for e in extents)
    size = max(1, min(total, CRC_BLOCK_BYTES))
    buffer = getattr(_BUFFERS, "buffer", None)
    if buffer is None or len(buffer) < size or len(buffer) > CRC_BLOCK_BYTES:
        buffer = _BUFFERS.buffer = bytearray(size)  # reused: a fresh one would page-fault in every time
    view = memoryview(buffer)
    for extent in extents:
        done = 0
        while done < extent.nbytes:
            n = read_at(fd, view[: min(len(view), extent.nbytes - done)], extent.offset + done)
            if n <= 0:
                raise CorruptDataError(f"{path}: truncated: {extent.nbytes - done} bytes missing at offset "
                                       f"{extent.offset + done}")
            crc = crc32(view[:n], crc)
            done += n
    return crc


def crc_of_range(fd: int, offset: int, nbytes: int, path: Path | str = "file", crc: int = 0) -> int:
    return crc_of(fd, (Extent(offset, nbytes),), path, crc)


def check_source(path: Path, offset: int, nbytes: int, crc: int) -> None:
    """Raises CorruptDataError when the bytes a source's format vouches for hash otherwise."""
    with open_data_file(path) as f:
        got = crc_of_range(handle_of(f), offset, nbytes, path)
    if got != crc:
        raise CorruptDataError(f"{path}: the {nbytes} bytes at offset {offset} hash to CRC-32 {got:#010x}, its "
                               f"zip directory records {crc:#010x}",
                               hint="the file is damaged, or changed during the run")
