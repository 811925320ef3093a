"""Reading torch.save zip records without torch: tensors become `TensorRecord`s, never arrays.

A torch.save file is an uncompressed zip: `<prefix>/data.pkl` (a pickle whose persistent ids name
storages), `<prefix>/data/<key>` (raw little-endian storage bytes) and small records such as
`byteorder`. PyTorch DCP embeds one such zip per item at a byte range of a `.distcp` file, so
everything here works on a window `[start, start + length)` of a larger file and reports absolute
offsets in that outer file. Only the central directory, the local headers and `data.pkl` are read:
tensor bytes stay on disk until a reader asks for a `Location`.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpckpt.core import dtypes
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import CorruptDataError, HpckptError, UnsafePickleError
from hpckpt.core.read import open_data_file
from hpckpt.core.torch_records import BytesIOState, TensorRecord, span_elements, without_bytes_io
from hpckpt.core.unpickle import Resolver, SafeUnpickler, safe_global

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
            return os.pread(self._fd, size, self._start + offset)
        data = b"".join(self._block(i) for i in range(first, last + 1))
        skip = offset - first * self.BLOCK
        return data[skip : skip + size]

    def _block(self, i: int) -> bytes:
        if i not in self._blocks:
            if len(self._blocks) >= 4:
                self._blocks.pop(next(iter(self._blocks)))
            begin = i * self.BLOCK
            self._blocks[i] = os.pread(self._fd, min(self.BLOCK, self._length - begin), self._start + begin)
        return self._blocks[i]


# --- the archive ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Storage:
    """A storage the pickle referred to: its dtype (None: untyped) and where its bytes are."""

    dtype: DType | None
    data_offset: int  # absolute, in the outer file
    nbytes: int


@dataclass(frozen=True)
class _StorageType:
    """What `torch.FloatStorage` & co. resolve to: only their element type matters here."""

    dtype: DType | None


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
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
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

# Storage classes torch.save names: the legacy typed storages of the table's `torch_storage`
# column (quantized ones included, so that they are refused as a dtype, not as an unsafe pickle),
# and UntypedStorage, whose tensors name their dtype in `_rebuild_tensor_v3`.
def _storage_types() -> dict[tuple[str, str], _StorageType]:
    table = {("torch", d.torch_storage): _StorageType(d) for d in dtypes.all_dtypes() if d.torch_storage}
    for module in ("torch", "torch.storage"):
        table[(module, "UntypedStorage")] = _StorageType(None)
    return table


def _rebuild_qtensor(storage, storage_offset, size, stride, *_ignored) -> TensorRecord:
    """`torch._utils._rebuild_qtensor`: kept as a record of its quantized dtype, which every
    format refuses; its bytes are not checked (quint4x2 packs two values per byte)."""
    if not isinstance(storage, _Storage) or storage.dtype is None or storage.dtype.refusal is None:
        raise CorruptDataError("_rebuild_qtensor on a storage that is not a quantized one")
    shape, strides = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    offset = storage.data_offset + int(storage_offset) * storage.dtype.itemsize
    return TensorRecord(storage.dtype, shape, strides, offset, storage.nbytes)


# The quantization schemes a quantized tensor's parameters name (kept as their names).
_QSCHEMES = ("per_tensor_affine", "per_channel_affine", "per_tensor_symmetric",
             "per_channel_symmetric", "per_channel_affine_float_qparams")


class _TensorType:
    """Stand-in for `torch.Tensor`/`torch.nn.Parameter` as the type argument of a rebuild."""


def _tensor(storage: _Storage, storage_offset: int, size: Any, stride: Any, dtype: DType | None) -> TensorRecord:
    """Build a TensorRecord and check that the view it describes lies inside its storage."""
    if not isinstance(storage, _Storage):
        raise CorruptDataError(f"tensor rebuilt from {type(storage).__name__}, not from a storage")
    dtype = dtype or storage.dtype
    if dtype is None:
        raise CorruptDataError("tensor on an untyped storage without a dtype")
    shape, strides = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    if len(shape) != len(strides) or min(shape + strides + (storage_offset,), default=0) < 0:
        raise CorruptDataError(f"tensor view size={shape} stride={strides} offset={storage_offset} is invalid")
    end = (storage_offset + span_elements(shape, strides)) * dtype.itemsize
    if math.prod(shape) and end > storage.nbytes:
        raise CorruptDataError(
            f"tensor view size={shape} stride={strides} offset={storage_offset} needs {end} bytes "
            f"of a {storage.nbytes}-byte storage"
        )
    return TensorRecord(dtype, shape, strides, storage.data_offset + storage_offset * dtype.itemsize, storage.nbytes)


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> TensorRecord:
    """`torch._utils._rebuild_tensor(_v2)`: requires_grad, hooks and metadata do not matter here."""
    return _tensor(storage, storage_offset, size, stride, None)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_ignored) -> TensorRecord:
    """`torch._utils._rebuild_tensor_v3`: an untyped storage plus an explicit dtype (float8, uint16...)."""
    if not isinstance(dtype, DType):
        raise CorruptDataError(f"_rebuild_tensor_v3 got dtype {dtype!r}")
    return _tensor(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data, *_ignored) -> Any:
    """A Parameter is its data tensor; requires_grad, hooks and Python state are dropped."""
    return data


def _rebuild_from_type_v2(func, new_type, args, state) -> Any:
    """A tensor with Python attributes: rebuild the plain tensor, drop the attributes."""
    if new_type is not _TensorType:
        raise UnsafePickleError(f"refusing tensor subclass {new_type!r}")
    return func(*args)


def _bytes(*args: Any) -> bytes:
    """`bytes()`, which protocol 2 pickles `b""` as; never of a size (`bytes(10**12)`)."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise UnsafePickleError("refusing bytes() of a size: only bytes() and bytes(bytes) are allowed")
    return bytes(*args)


def _device(*args: Any) -> str:
    """`torch.device('cpu')` inside a saved value: keep the device as its string."""
    return ":".join(str(a) for a in args)


# (an allow-list table like core/unpickle.py's: these are the globals only torch.save records name)
_RECORD_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("torch", "device"): _device,
    ("_io", "BytesIO"): BytesIOState,
    ("io", "BytesIO"): BytesIOState,
    ("builtins", "bytes"): _bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_qtensor"): _rebuild_qtensor,
    **{("torch", q): q for q in _QSCHEMES},
    **_storage_types(),
}


def record_global(module: str, name: str) -> Any:
    """Resolver for torch.save pickles: tensor rebuilds and storage types, then `safe_global`."""
    try:
        return _RECORD_GLOBALS[(module, name)]
    except KeyError:
        return safe_global(module, name)


class _RecordUnpickler(SafeUnpickler):
    """The safe unpickler plus torch's persistent ids, which name storages in the archive."""

    def __init__(self, archive: _Archive, resolver: Resolver):
        super().__init__(io.BytesIO(archive.read("data.pkl")), resolver=resolver)
        self._archive = archive
        self._storages: dict[str, _Storage] = {}
        self.saw_bytes_io = False

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        self.saw_bytes_io |= found is BytesIOState
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CorruptDataError(f"{self._archive.where}: unexpected persistent id {pid!r}")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CorruptDataError(f"{self._archive.where}: persistent id names {storage_type!r}, not a storage type")
        key = str(key)
        if key not in self._storages:
            self._storages[key] = self._storage(storage_type.dtype, key, numel)
        return self._storages[key]

    def _storage(self, dtype: DType | None, key: str, numel: Any) -> _Storage:
        info = self._archive.info(f"data/{key}")
        expected = int(numel) * (dtype.itemsize if dtype else 1)
        if expected != info.file_size:
            raise CorruptDataError(
                f"{self._archive.where}: storage {key!r} should hold {expected} bytes, member has {info.file_size}"
            )
        return _Storage(dtype, self._archive.data_offset(info), info.file_size)


_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                  AttributeError, MemoryError, UnicodeDecodeError, OverflowError, RecursionError)


def _unpickle(archive: _Archive, resolver: Resolver) -> Any:
    """Unpickle data.pkl; every failure becomes a typed error naming the record."""
    try:
        unpickler = _RecordUnpickler(archive, resolver)
        tree = unpickler.load()
        return without_bytes_io(tree) if unpickler.saw_bytes_io else tree
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
    path = Path(path)
    where = _describe(path, start, length)
    with open_data_file(path) as file:
        fd = file.fileno()
        size = os.fstat(fd).st_size
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
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.pread(fd, len(ZIP_MAGIC), start) == ZIP_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)

