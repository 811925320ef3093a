"""Reading torch.save zip records without torch: tensors become `TensorRecord`s, never arrays.

A torch.save file is an uncompressed zip: `<prefix>/data.pkl` (a pickle whose persistent ids name
storages), `<prefix>/data/<key>` (raw little-endian storage bytes) and small records such as
`byteorder`. PyTorch DCP embeds one such zip per item at a byte range of a `.distcp` file, so
everything here works on a window `[start, start + length)` of a larger file and reports absolute
offsets in that outer file. Only the central directory, the local headers and `data.pkl` are read:
tensor bytes stay on disk until a reader asks for a `Location`, which carries its storage's
CRC-32 from the zip directory, so that every copy from it is checked (`core.io.checksums`). What the
pickle's globals stand for is `core.safety.torch_globals`.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

from hpckpt.core.codecs.torch_records import TensorRecord
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import CorruptDataError, HpckptError
from hpckpt.core.io.read import open_data_file
from hpckpt.core.safety import input_files
from hpckpt.core.safety.allow_list import Resolver
from hpckpt.core.safety.torch_globals import Storage, StorageType, record_global
from hpckpt.core.safety.unpickle import SafeUnpickler
from hpckpt.core.storage.readers import close_handle, handle_of, handle_size, pread as read_range, read_at
from hpckpt.core.storage.urls import as_path

__all__ = ["ZIP_MAGIC", "TensorRecord", "is_zip_record", "load_record"]

ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, (skipped fields), name length, extra length


# --- a window on a file, so that zipfile sees only one record ----------------------------------


class _FileWindow(io.RawIOBase):
    """Read-only, seekable view of `[start, start + length)` of an open file, via `os.pread`.

    zipfile looks for the end-of-central-directory record from the end of its file object; giving
    it this window makes it parse exactly one embedded record and never touch the bytes around it.
    zipfile reads the directory, local headers and data.pkl in a dozen small reads at the two
    ends of the record: small reads are served from a few cached blocks, so parsing a record
    costs about two `pread`s instead of a dozen.
    """

    BLOCK = 64 * 1024

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0
        self._blocks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the record")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        """At most what the window holds from here: a size a zip record declares (its central
        directory's) is never allocated whole, as RawIOBase.read would before reading."""
        left = max(0, self._length - self._pos)
        data = self.pread(left if size is None or size < 0 else min(size, left), self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.pread(len(buffer), self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    @property
    def length(self) -> int:
        return self._length

    def pread(self, size: int, offset: int) -> bytes:
        """Read up to `size` bytes at `offset` relative to the window, without moving the cursor."""
        size = max(0, min(size, self._length - offset))
        if size == 0:
            return b""
        first, last = offset // self.BLOCK, (offset + size - 1) // self.BLOCK
        if last - first > 1:  # a large read: straight from the file
            return read_range(self._fd, size, self._start + offset)
        data = b"".join(self._block(i) for i in range(first, last + 1))
        skip = offset - first * self.BLOCK
        return data[skip : skip + size]

    def _block(self, i: int) -> bytes:
        if i not in self._blocks:
            if len(self._blocks) >= 4:
                self._blocks.pop(next(iter(self._blocks)))
            begin = i * self.BLOCK
            self._blocks[i] = read_range(self._fd, min(self.BLOCK, self._length - begin), self._start + begin)
        return self._blocks[i]


# --- the archive ----------------------------------------------------------------------------------


class _Archive:
    """One parsed zip record: member lookup and the absolute offset of each member's data."""

    def __init__(self, zf: zipfile.ZipFile, window: _FileWindow, start: int, where: str):
        self.zf, self.window, self.start, self.where = zf, window, start, where
        self.prefix = self._find_prefix()

    def _find_prefix(self) -> str:
        pickles = [n for n in self.zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise CorruptDataError(f"{self.where}: torch.save record has {len(pickles)} data.pkl members, expected 1")
        return pickles[0][: -len("data.pkl")]

    def info(self, name: str) -> zipfile.ZipInfo:
        try:
            return self.zf.getinfo(self.prefix + name)
        except KeyError:
            raise CorruptDataError(f"{self.where}: torch.save record has no member {self.prefix + name!r}") from None

    def has(self, name: str) -> bool:
        return (self.prefix + name) in self.zf.NameToInfo

    def read(self, name: str) -> bytes:
        try:
            return self.zf.read(self.info(name))
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
            # (zipfile raises NotImplementedError and RuntimeError for flag bits it does not read:
            # patched data, encryption; torch never sets them)
            raise CorruptDataError(f"{self.where}: cannot read member {self.prefix + name!r}: {exc}") from exc

    def data_offset(self, info: zipfile.ZipInfo) -> int:
        """Absolute offset of a member's bytes, from its local header (its extra field pads them)."""
        header = self.window.pread(_LOCAL_HEADER.size, info.header_offset)
        if len(header) < _LOCAL_HEADER.size:
            raise CorruptDataError(f"{self.where}: local header of {info.filename!r} is truncated")
        magic, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if magic != ZIP_MAGIC:
            raise CorruptDataError(f"{self.where}: bad local header signature for {info.filename!r}")
        relative = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if relative + info.file_size > self.window.length:
            raise CorruptDataError(
                f"{self.where}: member {info.filename!r} ends at byte {relative + info.file_size}, "
                f"past the end of the record ({self.window.length} bytes)"
            )
        return self.start + relative


def _check_stored(zf: zipfile.ZipFile, where: str) -> None:
    """torch writes every member uncompressed; anything else is not a torch.save record."""
    for info in zf.infolist():
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptDataError(f"{where}: member {info.filename!r} is compressed; torch.save never compresses")


def _check_byteorder(archive: _Archive) -> None:
    """Storage bytes are read as little-endian; a big-endian record would be read wrong silently."""
    if not archive.has("byteorder"):
        return  # older torch wrote no byteorder record and only little-endian data
    order = archive.read("byteorder").decode("ascii", "replace").strip()
    if order != "little":
        raise CorruptDataError(f"{archive.where}: byteorder record is {order!r}; only 'little' is supported")


# --- unpickling data.pkl --------------------------------------------------------------------------

class _RecordUnpickler(SafeUnpickler):
    """The safe unpickler plus torch's persistent ids, which name storages in the archive."""

    def __init__(self, archive: _Archive, resolver: Resolver):
        super().__init__(io.BytesIO(archive.read("data.pkl")), resolver=resolver)
        self._archive = archive
        self._storages: dict[str, Storage] = {}

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptDataError(f"{self._archive.where}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, StorageType):
            raise CorruptDataError(f"{self._archive.where}: persistent id names {storage_type!r}, not a storage type")
        key = str(key)
        if key not in self._storages:
            self._storages[key] = self._storage(storage_type.dtype, key, numel)
        return self._storages[key]

    def _storage(self, dtype: DType | None, key: str, numel: Any) -> Storage:
        info = self._archive.info(f"data/{key}")
        expected = int(numel) * (dtype.itemsize if dtype else 1)
        if expected != info.file_size:
            raise CorruptDataError(
                f"{self._archive.where}: storage {key!r} should hold {expected} bytes, member has {info.file_size}"
            )
        return Storage(dtype, self._archive.data_offset(info), info.file_size, info.CRC)


_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                  AttributeError, MemoryError, UnicodeDecodeError, OverflowError, RecursionError)


def _unpickle(archive: _Archive, resolver: Resolver) -> Any:
    """Unpickle data.pkl; every failure becomes a typed error naming the record."""
    try:
        return _RecordUnpickler(archive, resolver).load()  # (an io.BytesIO read as its bytes)
    except HpckptError as exc:
        if not exc.message.startswith(archive.where):
            exc.message = f"{archive.where}: {exc.message}"
            exc.args = (exc.message,)
        raise
    except _PICKLE_ERRORS as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise CorruptDataError(f"{archive.where}: data.pkl is not a valid pickle ({problem})") from exc


# --- public entry points --------------------------------------------------------------------------


def _describe(path: Path, start: int, length: int | None) -> str:
    if start == 0 and length is None:
        return str(path)
    return f"{path} [bytes {start}..{'end' if length is None else start + length})"


def load_record(path: "Path | str", start: int = 0, length: int | None = None, *,
                resolver: Resolver = record_global) -> Any:
    """Parse the torch.save zip at `[start, start + length)` of `path` (to the end when None).

    Returns the unpickled object tree with every tensor replaced by a `TensorRecord`; plain
    values come back as Python values. Nothing but the zip directory, local headers and data.pkl
    is read.

    Raises:
        MissingFileError: `path` cannot be opened.
        CorruptDataError: the range is outside the file, the zip is truncated or malformed, a
            member is compressed or missing, or the record is not little-endian.
        UnsafePickleError: data.pkl names a global outside the allow-list.
    """
    path = as_path(path)
    where = _describe(path, start, length)
    with open_data_file(path) as file:
        fd = handle_of(file)
        size = handle_size(fd)
        length = size - start if length is None else length
        if start < 0 or length < 0 or start + length > size:
            raise CorruptDataError(f"{where}: byte range lies outside the {size}-byte file")
        window = _FileWindow(fd, start, length)
        try:
            zf = zipfile.ZipFile(window)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, NotImplementedError) as exc:
            raise CorruptDataError(f"{where}: not a complete zip record ({exc})") from exc
        with zf:
            _check_stored(zf, where)
            archive = _Archive(zf, window, start, where)
            _check_byteorder(archive)
            return _unpickle(archive, resolver)


def is_zip_record(path: "Path | str", start: int = 0) -> bool:
    """Cheap check: does a zip local header start at `start`? (False when unreadable.)"""
    try:
        fd = input_files.open_handle(as_path(path))
    except (OSError, HpckptError):
        return False
    try:
        head = memoryview(bytearray(len(ZIP_MAGIC)))
        return read_at(fd, head, start) == len(ZIP_MAGIC) and head == ZIP_MAGIC
    except OSError:
        return False
    finally:
        close_handle(fd)

