"""The CRC trailer of a `.ckpt`, checked as MindSpore checks it, in bounded memory.

MindSpore (`_exec_save`, `_parse_ckpt_proto`): the CRC-32 (`binascii.crc32`, start 0, the same
function as `zlib.crc32`) of every serialized one-Value `Checkpoint`, in file order, i.e. of every
byte before the 17-byte trailer `b"crc_num"` + the CRC as 10 bytes big-endian.

The file is streamed in `core.io.checksums.CRC_BLOCK_BYTES` blocks (one buffer, whatever the
file's size); the CRC is zlib-ng's (`core.io.crc`, 23 GB/s on one core).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from hpckpt.core.codecs.mindspore_ckpt.scan import _open, _trailer
from hpckpt.core.errors import CorruptDataError
from hpckpt.core.io import checksums
from hpckpt.core.storage.readers import file_size, handle_of
from hpckpt.core.storage.urls import as_path

def verify_crc(path: Path | str) -> bool:
    """Check the CRC trailer by streaming the file; False when there is no trailer.

    Raises:
        CorruptDataError: the CRC-32 of the bytes before the trailer differs from the stored one.
    """
    path = as_path(path)
    with _open(path) as f:
        size = file_size(f)
        proto_end, stored = _trailer(f, size)
        if stored is None:
            return False
        if hasattr(os, "posix_fadvise"):
            if isinstance(handle_of(f), int):
                os.posix_fadvise(f.fileno(), 0, proto_end, os.POSIX_FADV_SEQUENTIAL)
        computed = checksums.crc_of_range(handle_of(f), 0, proto_end, path)
    if computed != stored:
        raise CorruptDataError(
            f"{path}: CRC-32 mismatch: the trailer says {stored:#010x}, the {proto_end} bytes "
            f"before it hash to {computed:#010x}",
            hint="the file is damaged (MindSpore's load_checkpoint(crc_check=True) refuses it too): "
                 "copy it again from where it was saved",
        )
    return True


class CrcGate:
    """A file's CRC trailer, checked once, on the first read of its data, before any of it is
    used (every later call returns at once, or raises the same error again). Thread-safe: the
    engine's workers locate chunks concurrently, and the first one checks while the others wait.
    A file without a trailer passes."""

    def __init__(self, path: Path, has_crc: bool):
        self.path = path
        self._passed = not has_crc
        self._failure: CorruptDataError | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """Raises CorruptDataError when the trailer does not match the bytes before it."""
        if self._passed:
            return
        with self._lock:
            if self._failure is None and not self._passed:
                try:
                    verify_crc(self.path)
                except CorruptDataError as exc:
                    self._failure = exc
                else:
                    self._passed = True
        if self._failure is not None:
            raise self._failure
