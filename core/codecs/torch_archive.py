"""torch.save archives laid out up front, so that the engine can fill their tensors in place.

A torch.save file is a zip archive, and torch's loader relies on the exact layout torch 2.13's
PyTorchStreamWriter (miniz) writes, beyond the zip spec; this module reproduces it record for
record:

- records `data.pkl`, `.format_version` ("1"), `.storage_alignment` ("64"), `byteorder`
  ("little"), `data/0..N-1` (keys in pickle order), `version` ("3\\n"), `.data/serialization_id`;
- every record stored, name prefixed by `<archive_name>/`, its data 64-byte aligned by a local
  extra field `"FB" + u16 n + "Z" * n` placed after the zip64 extra field (if any);
- a non-empty record has general-purpose bit 3 set, zero CRC and sizes in its local header, and
  a data descriptor after its data (24 bytes when the record needs zip64, else 16);
- a zip64 extra field holds the sizes when a record has >= 0xFFFFFFFF bytes and the offset when
  its local header starts at >= 0xFFFFFFFF; the zip64 end record and locator are always written.

`torch.load(..., mmap=True)` computes every storage offset from this layout instead of reading
the local headers, so any deviation would make torch read the wrong bytes silently.

Every position follows from the declarations (names, dtypes, shapes, values), so `layout(base)`
gives each tensor's byte range before any data exists. What depends on the data (the CRC-32 in
each tensor's descriptor, the serialization id, the central directory) comes from `finish(crcs)`.
"""

from __future__ import annotations

import hashlib
import math
import operator
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from hpckpt.core import dtypes
from hpckpt.core.codecs.pickle_builder import PickleBuilder
from hpckpt.core.dtypes import DType
from hpckpt.core.io.crc import crc32
from hpckpt.core.storage.urls import as_path

#: A record's size or header offset at or above this needs zip64 fields (miniz's rule).
#: Module-level so that tests can lower it to exercise the zip64 path without 4 GiB files.
ZIP64_LIMIT = 0xFFFFFFFF
STORAGE_ALIGNMENT = 64
FORMAT_VERSION = b"1"  # `.format_version`: torch may compute storage offsets from the layout
FILE_VERSION = b"3\n"  # `version`: what torch 2.13 writes for a plain torch.save
SERIALIZATION_ID_BYTES = 40

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_DESCRIPTOR32 = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_SIG_LOCAL, _SIG_CENTRAL, _SIG_DESCRIPTOR = 0x04034B50, 0x02014B50, 0x08074B50
_SIG_END64, _SIG_LOCATOR64, _SIG_END = 0x06064B50, 0x07064B50, 0x06054B50
_FLAG_DESCRIPTOR, _FLAG_UTF8 = 0x0008, 0x0800
_U32_MAX = 0xFFFFFFFF


@dataclass
class _Record:
    """One zip record: its name, where its local header starts (relative to the archive) and
    its data (None: a tensor the engine fills; its CRC arrives in `finish`)."""

    name: bytes
    offset: int
    size: int
    data: bytes | None
    crc: int = 0
    data_offset: int = 0
    key: str | None = None  # tensors: the storage key


def _zip64_fields(size: int, offset: int) -> list[int]:
    """The values that do not fit 32-bit fields, in zip64 extra-field order."""
    fields = [size, size] if size >= ZIP64_LIMIT else []
    return fields + [offset] if offset >= ZIP64_LIMIT else fields


def _zip64_extra(fields: list[int]) -> bytes:
    return struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""


def _u32(value: int) -> int:
    """A 32-bit field: the real value, or the marker that sends readers to the zip64 data."""
    return _U32_MAX if value >= ZIP64_LIMIT else value


def _flags(record: _Record) -> int:
    return _FLAG_UTF8 | (_FLAG_DESCRIPTOR if record.size else 0)


def _local_header(record: _Record) -> bytes:
    """Local header whose extra field pads the data to STORAGE_ALIGNMENT, as torch does."""
    zip64 = _zip64_extra(_zip64_fields(record.size, record.offset))
    data_start = record.offset + _LOCAL.size + len(record.name) + len(zip64) + 4
    pad = -data_start % STORAGE_ALIGNMENT
    extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    fixed = _LOCAL.pack(_SIG_LOCAL, 0, _flags(record), 0, 0, 0, 0, 0, 0, len(record.name), len(extra))
    return fixed + record.name + extra


def _descriptor(record: _Record) -> bytes:
    """Data descriptor after a non-empty record: its CRC and sizes."""
    if not record.size:
        return b""
    if _zip64_fields(record.size, record.offset):
        return _DESCRIPTOR64.pack(_SIG_DESCRIPTOR, record.crc, record.size, record.size)
    return _DESCRIPTOR32.pack(_SIG_DESCRIPTOR, record.crc, record.size, record.size)


def _central_header(record: _Record) -> bytes:
    extra = _zip64_extra(_zip64_fields(record.size, record.offset))
    size = _u32(record.size)
    fixed = _CENTRAL.pack(_SIG_CENTRAL, 0, 0, _flags(record), 0, 0, 0, record.crc, size, size,
                          len(record.name), len(extra), 0, 0, 0, 0, _u32(record.offset))
    return fixed + record.name + extra


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """Zip64 end record and locator (torch always writes them), then the classic end record."""
    end64 = _END64.pack(_SIG_END64, _END64.size - 12, 0x031E, 45, 0, 0, count, count, cd_size, cd_offset)
    locator = _LOCATOR64.pack(_SIG_LOCATOR64, 0, cd_offset + cd_size, 1)
    count16 = min(count, 0xFFFF)
    end = _END.pack(_SIG_END, 0, 0, count16, count16, _u32(cd_size), _u32(cd_offset), 0)
    return end64 + locator + end


def archive_name_for(path: "Path | str") -> str:
    """The record prefix torch.save(obj, path) uses: the file name without its last suffix.

    torch falls back to "archive" for a non-ASCII name (it then writes through a Python stream).
    """
    name = as_path(path).name
    stem = name[: name.rfind(".")] if "." in name else name
    return stem if stem and stem.isascii() else "archive"


def _check_shape(name: str, shape: Any) -> tuple[int, ...]:
    """Non-negative ints (numpy ints are fine; bools are not sizes)."""
    dims = []
    for n in shape:
        try:
            size = operator.index(n)
        except TypeError:
            size = -1
        if isinstance(n, bool) or size < 0:
            raise ValueError(f"{name}: shape {shape!r} must be a sequence of non-negative ints")
        dims.append(size)
    return tuple(dims)


class TorchArchive:
    """A torch.save archive of a dict {name: tensor or plain value} (`root="dict"`, what
    `torch.save(state_dict)` writes) or of one object (`root="single"`, each PyTorch DCP record).

    Declare every entry first (`add_tensor`, `add_value`, in the order the dict should have),
    then `layout(base)` fixes every byte position for an archive starting at file offset `base`:
    `fixed` (bytes known now), `tensor_extent(key)` (where each tensor's data goes) and `size`.
    `finish(crcs)` gives the bytes that depend on the tensors' CRC-32s.
    """

    def __init__(self, archive_name: str = "archive", *, root: str = "dict"):
        if root not in ("dict", "single"):
            raise ValueError(f"root must be 'dict' or 'single', not {root!r}")
        if not isinstance(archive_name, str) or not archive_name or any(c in archive_name for c in "/\\\0"):
            raise ValueError(f"invalid archive name {archive_name!r}: it must be non-empty, without '/', '\\\\' or NUL")
        self._prefix = f"{archive_name}/".encode("utf-8")
        self._root = root
        self._pickle = PickleBuilder()
        self._names: set[str] = set()
        self._tensors: list[tuple[str, int]] = []  # (key, nbytes)
        self._records: list[_Record] = []
        self._by_key: dict[str, _Record] = {}  # tensors' records: `tensor_extent` once per tensor
        self.base = 0
        self.size = 0

    def add_tensor(self, name: str, dtype: "DType | str", shape: Iterable[int]) -> str:
        """Declare the next tensor; returns its storage key (its bytes go to `tensor_extent`)."""
        self._declare(name)
        dtype, shape = dtypes.dtype(dtype), _check_shape(name, shape)
        key = str(len(self._tensors))
        self._entry(name, lambda: self._pickle.tensor(dtype, shape, key))
        self._tensors.append((key, math.prod(shape) * dtype.itemsize))
        return key

    def add_value(self, name: str, value: Any) -> None:
        """Declare a plain value: None, bool, int, float, complex, str, bytes, bytearray, and
        tuples, lists, sets, dicts and OrderedDicts of them (what weights_only=True loads)."""
        self._declare(name)
        self._entry(name, lambda: self._pickle.value(value, name))

    def _declare(self, name: str) -> None:
        if self._records:
            raise RuntimeError(f"cannot declare {name!r}: the archive is laid out already")
        if type(name) is not str:
            raise TypeError(f"entry names must be str, not {type(name).__name__}")
        if name in self._names:
            raise ValueError(f"entry {name!r} is declared twice")
        if self._root == "single" and self._names:
            raise ValueError(f"cannot declare {name!r}: a single-object archive holds one entry")

    def _entry(self, name: str, emit: Any) -> None:
        """Append `name: <emit>` to the top-level dict, or nothing if emitting fails."""
        mark = self._pickle.checkpoint()
        try:
            if self._root == "dict":
                self._pickle.string(name)
            emit()
        except BaseException:
            self._pickle.rollback(mark)
            raise
        self._names.add(name)

    def _pickle_bytes(self) -> bytes:
        body = self._pickle.body
        if self._root == "single":
            if not body:
                raise ValueError("a single-object archive needs its one entry declared")
            return pickle.PROTO + b"\x02" + body + pickle.STOP
        items = pickle.MARK + body + pickle.SETITEMS if body else b""
        return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + items + pickle.STOP

    def layout(self, base: int = 0) -> None:
        """Fix every record's position for an archive that starts at byte `base` of its file."""
        small = [("data.pkl", self._pickle_bytes()), (".format_version", FORMAT_VERSION),
                 (".storage_alignment", str(STORAGE_ALIGNMENT).encode("ascii")), ("byteorder", b"little")]
        entries = ([(name, len(data), data, None) for name, data in small]
                   + [(f"data/{key}", nbytes, None, key) for key, nbytes in self._tensors]
                   + [("version", len(FILE_VERSION), FILE_VERSION, None),
                      (".data/serialization_id", SERIALIZATION_ID_BYTES, None, None)])
        self.base, position = base, 0
        for name, size, data, key in entries:
            record = _Record(self._prefix + name.encode("utf-8"), position, size, data, key=key)
            record.crc = crc32(data) if data is not None else 0
            record.data_offset = position + len(_local_header(record))
            position = record.data_offset + size + len(_descriptor(record))
            self._records.append(record)
        self._by_key = {r.key: r for r in self._records if r.key is not None}
        self._directory_at = position
        directory = sum(len(_central_header(r)) for r in self._records)
        self.size = position + directory + _END64.size + _LOCATOR64.size + _END.size
        self._pickle = None  # the declarations are in data.pkl now; free them

    @property
    def fixed(self) -> list[tuple[int, bytes]]:
        """`(file offset, bytes)` known before any tensor data: headers, small records and their
        descriptors."""
        out = []
        for r in self._records:
            out.append((self.base + r.offset, _local_header(r)))
            if r.data is not None:
                out.append((self.base + r.data_offset, r.data + _descriptor(r)))
        return out

    def tensor_extent(self, key: str) -> tuple[int, int]:
        """`(file offset, nbytes)` of tensor `key`'s data."""
        record = self._by_key[key]
        return self.base + record.data_offset, record.size

    def tensor_keys(self) -> list[str]:
        return [key for key, _ in self._tensors]

    def finish(self, crcs: Mapping[str, int]) -> list[tuple[int, bytes]]:
        """The bytes that depend on the tensors' CRC-32s (`crcs[key]`), as `(file offset, bytes)`."""
        out = []
        for r in self._records:
            if r.key is not None:
                r.crc = crcs[r.key] if r.size else 0
                out.append((self.base + r.data_offset + r.size, _descriptor(r)))
        sid = self._records[-1]
        sid.data = self._serialization_id(self._records[:-1])
        sid.crc = crc32(sid.data)
        out.append((self.base + sid.data_offset, sid.data + _descriptor(sid)))
        directory = b"".join(_central_header(r) for r in self._records)
        out.append((self.base + self._directory_at,
                    directory + _end_records(len(self._records), self._directory_at, len(directory))))
        return out

    @staticmethod
    def _serialization_id(records: list[_Record]) -> bytes:
        """40 digits like torch's: a hash of the record names, then one of their CRCs.

        torch combines C++ std::hash values, which cannot be reproduced; the id only has to be
        a fixed-length, deterministic fingerprint of the records.
        """
        names, crcs = hashlib.blake2b(digest_size=8), hashlib.blake2b(digest_size=8)
        for record in records:
            names.update(record.name + b"\0")
            crcs.update(struct.pack("<I", record.crc))
        first, second = (int.from_bytes(h.digest(), "little") for h in (names, crcs))
        return f"{first:020d}{second:020d}".encode("ascii")
