"""Whether torch.save records hold tensors, from their zip directories alone.

PyTorch DCP stores every non-tensor value as a torch.save record; the few that hold tensors
(nested objects stored whole) must be read as tensors. Telling them apart must cost almost
nothing for a checkpoint with thousands of plain values: a record is a standalone zip, and one
that holds a tensor names a storage member `<prefix>/data/<key>` in its central directory, so
the end record and the directory are read (one `pread` for a small record), never the pickle.
"""

from __future__ import annotations

import struct
from pathlib import Path

from hpckpt.core.codecs.torch_zip import ZIP_MAGIC
from hpckpt.core.io.read import open_data_file
from hpckpt.core.storage.readers import handle_of, handle_size, pread
from hpckpt.core.storage.urls import as_path

_SMALL = 64 * 1024  # a record up to this size is read whole, in one call


def records_with_storages(path: "Path | str", ranges: list[tuple[int, int]]) -> list[bool]:
    """For each `(start, length)` record of `path`: may its zip hold a storage member
    (`<prefix>/data/<key>`: a tensor)? Reads only the end record and central directory (two
    `pread`s). False when it surely holds none, or is no zip record (raw bytes); True also when
    the directory is one this scan does not parse (zip64 sizes), so that the caller loads it.

    Raises:
        MissingFileError: `path` cannot be opened.
    """
    with open_data_file(as_path(path)) as file:
        fd = handle_of(file)
        size = handle_size(fd)
        return [0 <= start and 0 <= length and start + length <= size and _may_hold_storage(fd, start, length)
                for start, length in ranges]


_END = struct.Struct("<4s4xHHIIH")  # end of central directory: signature, entries, size, offset, comment
_ENTRY = struct.Struct("<4s24xHHH12x")  # central directory entry: signature, name/extra/comment lengths


def _may_hold_storage(fd: int, start: int, length: int) -> bool:
    if length < _END.size:
        return False
    whole = pread(fd, length, start) if length <= _SMALL else None  # a value's record: one read

    def read(size: int, at: int) -> bytes:
        return whole[at : at + size] if whole is not None else pread(fd, size, start + at)

    if read(len(ZIP_MAGIC), 0) != ZIP_MAGIC:
        return False
    magic, _on_disk, count, cd_size, cd_offset, comment = _END.unpack(read(_END.size, length - _END.size))
    if magic != b"PK\x05\x06" or comment or cd_offset + cd_size > length - _END.size:
        return True  # zip64 or unusual: let the full parse decide
    directory, pos = read(cd_size, cd_offset), 0
    for _ in range(count):
        if len(directory) < pos + _ENTRY.size:
            return True
        magic, name_len, extra_len, comment_len = _ENTRY.unpack_from(directory, pos)
        parts = directory[pos + _ENTRY.size : pos + _ENTRY.size + name_len].split(b"/")
        if magic != b"PK\x01\x02" or (len(parts) == 3 and parts[1] == b"data"):
            return True
        pos += _ENTRY.size + name_len + extra_len + comment_len
    return False
