"""Streaming writer of torch.save files, without torch, for tensors of any size in bounded memory.

`consolidate --format pt` and `convert --to pt` copy tensors that may not fit in memory, so the
file is produced the way it is laid out on disk: the pickle `data.pkl` first (it needs only
dtypes and shapes), then each storage `data/<key>` streamed from the caller's pieces, then the
central directory. The archive mirrors what torch 2.13's PyTorchStreamWriter (miniz) writes, record
for record, because torch's loader relies on that layout beyond the zip spec:

- records `data.pkl`, `.format_version` ("1"), `.storage_alignment` ("64"), `byteorder`
  ("little"), `data/0..N-1` (keys in pickle order), `version` ("3\\n"), `.data/serialization_id`;
- every record stored, name prefixed by `<archive_name>/`, its data 64-byte aligned by a local
  extra field `"FB" + u16 n + "Z" * n` placed after the zip64 extra field (if any);
- a non-empty record has general-purpose bit 3 set, zero CRC and sizes in its local header, and
  a data descriptor after its data (24 bytes when the record needs zip64, else 16): CRC and sizes
  come after the data, so nothing is patched and no seek is needed;
- a zip64 extra field holds the sizes when a record has >= 0xFFFFFFFF bytes and the offset when
  its local header starts at >= 0xFFFFFFFF; the zip64 end record and locator are always written.

`torch.load(..., mmap=True)` with `calculate_storage_offsets` (and fake/meta loading) computes
every storage offset from this layout instead of reading the local headers, so any deviation
(e.g. no data descriptors) would make torch read the wrong bytes silently.

The file is written under a temporary name in the destination directory and renamed into place by
`close()`: any failure removes it, so `path` is only ever absent, untouched or complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import os
import pickle
import secrets
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from hpckpt.core import dtypes
from hpckpt.core.dtypes import DType
from hpckpt.core.torch_zip import contiguous_strides

#: A record's size or header offset at or above this needs zip64 fields (miniz's rule).
#: Module-level so that tests can lower it to exercise the zip64 path without 4 GiB files.
ZIP64_LIMIT = 0xFFFFFFFF
STORAGE_ALIGNMENT = 64
FORMAT_VERSION = b"1"  # `.format_version`: torch may compute storage offsets from the layout
FILE_VERSION = b"3\n"  # `version`: what torch 2.13 writes for a plain torch.save
COPY_CHUNK_BYTES = 8 << 20  # buffer of `write_tensor_from` and of the read-back CRC

# Element types torch saves through the legacy typed storages (`_rebuild_tensor_v2`); every
# other dtype (uint16/32/64, float8) goes through UntypedStorage and `_rebuild_tensor_v3`.
_TYPED_STORAGES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage", "complex64": "ComplexFloatStorage",
}

# --- zip structures -------------------------------------------------------------------------------

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
class _Member:
    """One zip record: what the central directory needs once its data has been written."""

    name: bytes
    offset: int  # of the local header
    size: int
    crc: int = 0


def _zip64_fields(size: int, offset: int) -> list[int]:
    """The values that do not fit 32-bit fields, in zip64 extra-field order."""
    fields = [size, size] if size >= ZIP64_LIMIT else []
    return fields + [offset] if offset >= ZIP64_LIMIT else fields


def _zip64_extra(fields: list[int]) -> bytes:
    return struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""


def _u32(value: int) -> int:
    """A 32-bit field: the real value, or the marker that sends readers to the zip64 data."""
    return _U32_MAX if value >= ZIP64_LIMIT else value


def _flags(member: _Member) -> int:
    return _FLAG_UTF8 | (_FLAG_DESCRIPTOR if member.size else 0)


def _local_header(member: _Member) -> bytes:
    """Local header whose extra field pads the data to STORAGE_ALIGNMENT, as torch does."""
    zip64 = _zip64_extra(_zip64_fields(member.size, member.offset))
    data_start = member.offset + _LOCAL.size + len(member.name) + len(zip64) + 4
    pad = -data_start % STORAGE_ALIGNMENT
    extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    fixed = _LOCAL.pack(_SIG_LOCAL, 0, _flags(member), 0, 0, 0, 0, 0, 0, len(member.name), len(extra))
    return fixed + member.name + extra


def _descriptor(member: _Member) -> bytes:
    """Data descriptor after a non-empty record: CRC and sizes known only once data is written."""
    if not member.size:
        return b""
    if _zip64_fields(member.size, member.offset):
        return _DESCRIPTOR64.pack(_SIG_DESCRIPTOR, member.crc, member.size, member.size)
    return _DESCRIPTOR32.pack(_SIG_DESCRIPTOR, member.crc, member.size, member.size)


def _central_header(member: _Member) -> bytes:
    extra = _zip64_extra(_zip64_fields(member.size, member.offset))
    size = _u32(member.size)
    fixed = _CENTRAL.pack(_SIG_CENTRAL, 0, 0, _flags(member), 0, 0, 0, member.crc, size, size,
                          len(member.name), len(extra), 0, 0, 0, 0, _u32(member.offset))
    return fixed + member.name + extra


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """Zip64 end record and locator (torch always writes them), then the classic end record."""
    end64 = _END64.pack(_SIG_END64, _END64.size - 12, 0x031E, 45, 0, 0, count, count, cd_size, cd_offset)
    locator = _LOCATOR64.pack(_SIG_LOCATOR64, 0, cd_offset + cd_size, 1)
    count16 = min(count, 0xFFFF)
    end = _END.pack(_SIG_END, 0, 0, count16, count16, _u32(cd_size), _u32(cd_offset), 0)
    return end64 + locator + end


# --- the pickle ------------------------------------------------------------------------------------


class PickleBuilder:
    """Protocol-2 opcodes written by hand: the stock Pickler would import torch to name its globals.

    Only opcodes torch's weights_only unpickler implements are used (no BINBYTES, no FRAME); bytes
    go through `_codecs.encode` as protocol 2 does. Globals and constant strings are memoized.
    """

    def __init__(self) -> None:
        self.body = bytearray()
        self._memo: dict[tuple[str, str], int] = {}

    def checkpoint(self) -> tuple[int, int]:
        return len(self.body), len(self._memo)

    def rollback(self, mark: tuple[int, int]) -> None:
        """Undo a value that failed half-way, so the builder stays consistent."""
        size, memo_size = mark
        del self.body[size:]
        self._memo = {k: i for k, i in self._memo.items() if i < memo_size}

    def _memoized(self, key: tuple[str, str], emit: Any) -> None:
        """Emit once and remember; later uses fetch it from the memo (smaller pickles)."""
        index = self._memo.get(key)
        if index is not None:
            self._memo_op(pickle.BINGET, pickle.LONG_BINGET, index)
            return
        emit()
        self._memo[key] = index = len(self._memo)
        self._memo_op(pickle.BINPUT, pickle.LONG_BINPUT, index)

    def _memo_op(self, short: bytes, long: bytes, index: int) -> None:
        self.body += short + bytes([index]) if index < 256 else long + struct.pack("<I", index)

    def global_(self, module: str, name: str) -> None:
        line = f"{module}\n{name}\n".encode("ascii")
        self._memoized(("global", f"{module}.{name}"), lambda: self.body.extend(pickle.GLOBAL + line))

    def const(self, text: str) -> None:
        self._memoized(("str", text), lambda: self.string(text))

    def string(self, text: str) -> None:
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw) > _U32_MAX:
            raise ValueError("string longer than 4 GiB")
        self.body += pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw

    def integer(self, value: int) -> None:
        if 0 <= value < 0x100:
            self.body += pickle.BININT1 + bytes([value])
        elif 0 <= value < 0x10000:
            self.body += pickle.BININT2 + struct.pack("<H", value)
        elif -0x80000000 <= value < 0x80000000:
            self.body += pickle.BININT + struct.pack("<i", value)
        else:
            raw = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
            if len(raw) > 255:
                raise ValueError(f"integer of {len(raw)} bytes: torch's weights_only loader reads at most 255")
            self.body += pickle.LONG1 + bytes([len(raw)]) + raw

    def tuple_of(self, items: Iterable[Any], emit: Any) -> None:
        """A tuple whose items `emit` writes; the short forms torch's pickles use too."""
        items = list(items)
        if not items:
            self.body += pickle.EMPTY_TUPLE
            return
        short = len(items) <= 3
        if not short:
            self.body += pickle.MARK
        for item in items:
            emit(item)
        self.body += (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[len(items) - 1] if short else pickle.TUPLE

    def call(self, module: str, name: str, args: list[Any], emit: Any) -> None:
        """`module.name(*args)`: a global, a tuple of arguments, REDUCE."""
        self.global_(module, name)
        self.tuple_of(args, emit)
        self.body += pickle.REDUCE

    def tensor(self, dtype: DType, shape: tuple[int, ...], key: str) -> None:
        """`_rebuild_tensor_v2/v3(storage, 0, shape, strides, False, OrderedDict()[, dtype])`."""
        typed = _TYPED_STORAGES.get(dtype.name)
        self.global_("torch._utils", "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3")
        self.body += pickle.MARK
        self._storage_pid(dtype, shape, key, typed)
        self.integer(0)
        self.tuple_of(shape, self.integer)
        self.tuple_of(contiguous_strides(shape), self.integer)
        self.body += pickle.NEWFALSE
        self.call("collections", "OrderedDict", [], None)
        if not typed:
            self.global_("torch", dtype.name)
        self.body += pickle.TUPLE + pickle.REDUCE

    def _storage_pid(self, dtype: DType, shape: tuple[int, ...], key: str, typed: str | None) -> None:
        """Persistent id `('storage', storage type, key, 'cpu', numel)`; untyped numel is bytes."""
        numel = math.prod(shape)
        self.body += pickle.MARK
        self.const("storage")
        if typed:
            self.global_("torch", typed)
        else:
            self.global_("torch.storage", "UntypedStorage")
        self.string(key)
        self.const("cpu")
        self.integer(numel if typed else numel * dtype.itemsize)
        self.body += pickle.TUPLE + pickle.BINPERSID

    def value(self, value: Any, where: str, active: frozenset[int] = frozenset()) -> None:
        """A plain value that `torch.load(weights_only=True)` accepts; anything else is refused."""
        kind = type(value)
        if kind in _SCALARS:
            _SCALARS[kind](self, value)
            return
        emit = _CONTAINERS.get(kind)
        if emit is None:
            raise TypeError(f"{where}: cannot save a {kind.__module__}.{kind.__qualname__}; "
                            "torch.load(weights_only=True) accepts plain Python values only")
        if id(value) in active:
            raise ValueError(f"{where}: the value contains itself")
        emit(self, value, where, active | {id(value)})

    def _tuple(self, value: tuple, where: str, active: frozenset[int]) -> None:
        self.tuple_of(range(len(value)), lambda i: self.value(value[i], f"{where}[{i}]", active))

    def _list(self, value: list, where: str, active: frozenset[int]) -> None:
        self.body += pickle.EMPTY_LIST
        if value:
            self.body += pickle.MARK
            for i, item in enumerate(value):
                self.value(item, f"{where}[{i}]", active)
            self.body += pickle.APPENDS

    def _dict_items(self, value: dict, where: str, active: frozenset[int]) -> None:
        if not value:
            return
        self.body += pickle.MARK
        for key, item in value.items():
            self.value(key, f"{where} key {key!r}", active)
            self.value(item, f"{where}[{key!r}]", active)
        self.body += pickle.SETITEMS

    def _dict(self, value: dict, where: str, active: frozenset[int]) -> None:
        self.body += pickle.EMPTY_DICT
        self._dict_items(value, where, active)

    def _ordered_dict(self, value: OrderedDict, where: str, active: frozenset[int]) -> None:
        self.call("collections", "OrderedDict", [], None)
        self._dict_items(value, where, active)

    def _set(self, value: set, where: str, active: frozenset[int]) -> None:
        self.global_("builtins", "set")
        self._list(list(value), where, active)
        self.body += pickle.TUPLE1 + pickle.REDUCE

    def _bytes(self, value: bytes) -> None:
        """`_codecs.encode(latin-1 text, 'latin1')`: protocol 2's spelling of bytes."""
        self.global_("_codecs", "encode")
        self.string(value.decode("latin-1"))
        self.const("latin1")
        self.body += pickle.TUPLE2 + pickle.REDUCE

    def _bytearray(self, value: bytearray) -> None:
        self.global_("builtins", "bytearray")
        self._bytes(bytes(value))
        self.body += pickle.TUPLE1 + pickle.REDUCE

    def _complex(self, value: complex) -> None:
        self.call("builtins", "complex", [value.real, value.imag], self._float)

    def _float(self, value: float) -> None:
        self.body += pickle.BINFLOAT + struct.pack(">d", value)

    def _bool(self, value: bool) -> None:
        self.body += pickle.NEWTRUE if value else pickle.NEWFALSE

    def _none(self, _value: None) -> None:
        self.body += pickle.NONE


# Exact types only: a subclass (IntEnum, defaultdict...) would load back as something else.
_SCALARS = {
    type(None): PickleBuilder._none, bool: PickleBuilder._bool, int: PickleBuilder.integer,
    float: PickleBuilder._float, complex: PickleBuilder._complex, str: PickleBuilder.string,
    bytes: PickleBuilder._bytes, bytearray: PickleBuilder._bytearray,
}
_CONTAINERS = {
    tuple: PickleBuilder._tuple, list: PickleBuilder._list, dict: PickleBuilder._dict,
    OrderedDict: PickleBuilder._ordered_dict, set: PickleBuilder._set,
}


# --- the writer ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    key: str
    nbytes: int


def archive_name_for(path: "Path | str") -> str:
    """The record prefix torch.save(obj, path) uses: the file name without its last suffix.

    torch falls back to "archive" for a non-ASCII name (it then writes through a Python stream).
    """
    name = Path(path).name
    stem = name[: name.rfind(".")] if "." in name else name
    return stem if stem and stem.isascii() else "archive"


def _check_archive_name(name: str) -> None:
    if not isinstance(name, str) or not name or any(c in name for c in "/\\\0"):
        raise ValueError(f"invalid archive name {name!r}: it must be non-empty, without '/', '\\\\' or NUL")


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


def _as_bytes(data: Any) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, memoryview, numpy array)."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("tensor bytes must come in C-contiguous buffers")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _is_buffer(data: Any) -> bool:
    try:
        memoryview(data)
    except TypeError:
        return False
    return True


class TorchSaveWriter:
    """Write a dict {name: tensor or plain value} as a torch.save file, streaming tensor bytes.

    Declare every entry first (`add_tensor`, `add_value`, in the order the dict should have);
    then give the bytes of each declared tensor in declaration order, raw little-endian and
    row-major, in pieces of any size (`begin_tensor`/`write_bytes`/`end_tensor`, or
    `write_tensor`, or `write_tensor_from` a file); then `close()`. Used as a context manager,
    the file is completed on a clean exit and discarded on an exception. Any error raised while
    writing discards the file too: the writer is then unusable.

    Memory: the pickle and one small record per tensor (O(number of entries)), plus the piece
    being written; tensor bytes are never gathered.
    """

    def __init__(self, path: "Path | str", archive_name: str | None = None, *, fsync: bool = True,
                 root: str = "dict", sink: BinaryIO | None = None):
        if root not in ("dict", "single"):
            raise ValueError(f"root must be 'dict' or 'single', not {root!r}")
        self.path = Path(path)
        self.archive_name = archive_name_for(self.path) if archive_name is None else archive_name
        _check_archive_name(self.archive_name)
        self._prefix = f"{self.archive_name}/"
        self._fsync = fsync
        self._pickle = PickleBuilder()
        self._names: set[str] = set()
        self._tensors: list[_Tensor] = []
        self._next = 0  # index in _tensors of the next tensor to stream
        self._state = "declaring"  # -> "streaming" -> "closed", or "failed" from any state
        # root="single": the archive holds one object (a tensor or a value, declared once under any
        # name), as `torch.save(tensor)` writes; PyTorch DCP stores every item like that.
        self._root = root
        # sink: an open, readable file to append the archive to at its position (several archives
        # in one file, as a `.distcp`); the caller owns it: nothing is renamed, fsynced or removed.
        self._sink = sink
        self._file: BinaryIO | None = None
        self._tmp: Path | None = None
        self._base = 0  # where the archive starts in the file: zip offsets are relative to it
        self._pos = 0
        self._members: list[_Member] = []
        self._open: _Member | None = None  # record whose data is being written
        self._written = 0
        # Records filled in place whose CRC a second thread is computing: (member, descriptor
        # position, future CRC). Their descriptors are patched in by close().
        self._pending: list[tuple[_Member, int, Future]] = []

    # --- declaring -------------------------------------------------------------------------------

    def add_tensor(self, name: str, dtype: "DType | str", shape: Iterable[int]) -> None:
        """Declare the next tensor; its bytes are given later, in declaration order."""
        self._declare(name)
        dtype, shape = dtypes.dtype(dtype), _check_shape(name, shape)
        tensor = _Tensor(name, str(len(self._tensors)), math.prod(shape) * dtype.itemsize)
        self._entry(name, lambda: self._pickle.tensor(dtype, shape, tensor.key))
        self._tensors.append(tensor)

    def add_value(self, name: str, value: Any) -> None:
        """Declare a plain value: None, bool, int, float, complex, str, bytes, bytearray, and
        tuples, lists, sets, dicts and OrderedDicts of them (what weights_only=True loads)."""
        self._declare(name)
        self._entry(name, lambda: self._pickle.value(value, name))

    def _declare(self, name: str) -> None:
        if self._state != "declaring":
            raise RuntimeError(f"cannot declare {name!r}: declarations end when writing starts")
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

    # --- streaming -------------------------------------------------------------------------------

    @property
    def next_tensor(self) -> str | None:
        """Name of the tensor whose bytes are expected next (None when all are written)."""
        return self._tensors[self._next].name if self._next < len(self._tensors) else None

    def begin_tensor(self, name: str) -> None:
        """Start the bytes of `name`, which must be the next declared tensor."""
        with self._failing():
            self._start_if_needed()
            if self._open is not None:
                raise RuntimeError(f"begin_tensor({name!r}) while {self._open_name()!r} is unfinished")
            if name != self.next_tensor:
                raise ValueError(f"tensor {name!r} given out of order: expected {self.next_tensor!r}")
            tensor = self._tensors[self._next]
            self._begin_member(f"data/{tensor.key}", tensor.nbytes)

    def write_bytes(self, data: Any) -> None:
        """Append a piece (any C-contiguous buffer) to the current tensor."""
        with self._failing():
            if self._open is None or self._state != "streaming":
                raise RuntimeError("write_bytes() outside begin_tensor()/end_tensor()")
            piece = _as_bytes(data)
            if self._written + len(piece) > self._open.size:
                raise ValueError(f"tensor {self._open_name()!r}: {self._written + len(piece)} bytes given, "
                                 f"only {self._open.size} expected")
            self._member_bytes(piece)

    def end_tensor(self) -> None:
        """Finish the current tensor; its byte count must be numel * itemsize exactly."""
        with self._failing():
            if self._open is None or self._state != "streaming":
                raise RuntimeError("end_tensor() without begin_tensor()")
            if self._written != self._open.size:
                raise ValueError(f"tensor {self._open_name()!r}: {self._written} bytes given, "
                                 f"{self._open.size} expected")
            self._end_member()
            self._next += 1

    def write_tensor(self, name: str, data: Any) -> None:
        """The whole tensor from one buffer or an iterable of buffers (e.g. a generator)."""
        with self._failing():
            self.begin_tensor(name)
            for piece in ([data] if _is_buffer(data) else data):
                self.write_bytes(piece)
            self.end_tensor()

    def write_tensor_from(self, name: str, source: BinaryIO, offset: int = 0, *,
                          chunk_bytes: int = COPY_CHUNK_BYTES) -> None:
        """The tensor's bytes copied from `source` (seekable, with readinto) at `offset`,
        through one reused buffer of `chunk_bytes`."""
        with self._failing():
            self.begin_tensor(name)
            remaining = self._open.size
            buffer = memoryview(bytearray(max(1, min(chunk_bytes, remaining))))
            source.seek(offset)
            while remaining:
                n = source.readinto(buffer[: min(len(buffer), remaining)])
                if not n:
                    raise EOFError(f"tensor {name!r}: source ended {remaining} bytes early")
                self.write_bytes(buffer[:n])
                remaining -= n
            self.end_tensor()

    def write_tensor_in_place(self, name: str, fill: Callable[[int, int], None]) -> None:
        """The tensor's bytes written by `fill(fd, offset)` straight into the file, `size` bytes at
        `offset` (with `pwrite` or `copy_file_range`: no copy through this process).

        The CRC is then computed by reading the range back on a second thread, while the caller
        fills the next tensor; `close()` waits for it and patches the data descriptor.
        """
        with self._failing():
            self.begin_tensor(name)
            member = self._open
            self._file.flush()
            fd, start = self._file.fileno(), self._base + self._pos
            if member.size:
                fill(fd, start)
                if os.fstat(fd).st_size < start + member.size:
                    raise ValueError(f"tensor {name!r}: fill() wrote less than its {member.size} bytes")
            self._pos += member.size
            self._file.seek(self._base + self._pos)
            self._written = member.size
            if member.size:
                self._pending.append((member, self._pos, _crc_pool().submit(_crc_of_range, fd, start, member.size)))
            self._end_member()
            self._next += 1

    def _open_name(self) -> str:
        return self._tensors[self._next].name

    def _settle_checksums(self) -> None:
        """Wait for the read-back CRCs and write the data descriptors that were left blank."""
        if not self._pending:
            return
        self._file.flush()
        for member, position, crc in self._pending:
            member.crc = crc.result()
            os.pwrite(self._file.fileno(), _descriptor(member), self._base + position)
        self._pending = []

    # --- finishing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Write the trailing records and the central directory, then move the file into place."""
        if self._state == "closed":
            return
        with self._failing():
            self._start_if_needed()
            if self._open is not None:
                raise ValueError(f"tensor {self._open_name()!r} is unfinished")
            if self.next_tensor is not None:
                missing = len(self._tensors) - self._next
                raise ValueError(f"{missing} declared tensor(s) have no bytes, from {self.next_tensor!r}")
            self._settle_checksums()
            self._record("version", FILE_VERSION)
            self._record(".data/serialization_id", self._serialization_id())
            self._write_central_directory()
            self._file.flush()
            if self._sink is not None:
                self._state = "closed"
                return
            if self._fsync:
                os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
            self._state = "closed"
        if self._fsync:
            _fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Discard everything written so far; `path` is left as it was."""
        if self._state != "closed":
            self._discard()

    def __enter__(self) -> "TorchSaveWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # A writer dropped without close() must not leave its temporary file behind.
        try:
            self.abort()
        except Exception:
            pass

    # --- internals -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Run a write step; on any error discard the file, so no partial file can survive."""
        if self._state in ("failed", "closed"):
            raise RuntimeError(f"the writer of {self.path} is {self._state}")
        try:
            yield
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        self._state = "failed"
        if self._pending:  # nothing may still read the file once it is gone
            for _member, _position, crc in self._pending:
                crc.cancel()
            wait([crc for _member, _position, crc in self._pending])
            self._pending = []
        if self._sink is not None:
            return  # the caller's file: it discards what it holds
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                self._tmp.unlink()

    def _start_if_needed(self) -> None:
        """First write: create the temporary file and write data.pkl and the small records."""
        if self._state != "declaring":
            return
        self._state = "streaming"
        if self._sink is not None:
            self._file, self._base = self._sink, self._sink.tell()
        elif self.path.is_dir():
            raise IsADirectoryError(f"{self.path} is a directory")
        else:
            self._tmp = self.path.parent / f".{self.path.name[:200]}.{secrets.token_hex(6)}.partial"
            self._file = open(self._tmp, "xb+")  # readable: in-place CRCs read back
        self._record("data.pkl", self._pickle_bytes())
        self._pickle = None  # the declarations are on disk; free them
        self._record(".format_version", FORMAT_VERSION)
        self._record(".storage_alignment", str(STORAGE_ALIGNMENT).encode("ascii"))
        self._record("byteorder", b"little")

    def _pickle_bytes(self) -> bytes:
        body = self._pickle.body
        if self._root == "single":
            if not body:
                raise ValueError("a single-object archive needs its one entry declared")
            return pickle.PROTO + b"\x02" + body + pickle.STOP
        items = pickle.MARK + body + pickle.SETITEMS if body else b""
        return pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + items + pickle.STOP

    def _emit(self, data: Any) -> None:
        self._file.write(data)
        self._pos += len(data)

    def _begin_member(self, name: str, size: int) -> None:
        self._open = _Member((self._prefix + name).encode("utf-8"), self._pos, size)
        self._written = 0
        self._emit(_local_header(self._open))

    def _member_bytes(self, piece: memoryview) -> None:
        self._open.crc = zlib.crc32(piece, self._open.crc)
        self._emit(piece)
        self._written += len(piece)

    def _end_member(self) -> None:
        self._emit(_descriptor(self._open))
        self._members.append(self._open)
        self._open = None

    def _record(self, name: str, data: bytes) -> None:
        """A small record written in one go."""
        self._begin_member(name, len(data))
        self._member_bytes(memoryview(data))
        self._end_member()

    def _serialization_id(self) -> bytes:
        """40 digits like torch's: a hash of the record names, then one of their CRCs.

        torch combines C++ std::hash values, which cannot be reproduced; the id only has to be
        a fixed-length, deterministic fingerprint of the records.
        """
        names, crcs = hashlib.blake2b(digest_size=8), hashlib.blake2b(digest_size=8)
        for member in self._members:
            names.update(member.name + b"\0")
            crcs.update(struct.pack("<I", member.crc))
        first, second = (int.from_bytes(h.digest(), "little") for h in (names, crcs))
        return f"{first:020d}{second:020d}".encode("ascii")

    def _write_central_directory(self) -> None:
        start = self._pos
        for member in self._members:
            self._emit(_central_header(member))
        self._emit(_end_records(len(self._members), start, self._pos - start))


_CRC_POOL: ThreadPoolExecutor | None = None


def _crc_pool() -> ThreadPoolExecutor:
    """One CRC thread for the process, shared by every writer: a PyTorch DCP output holds
    hundreds of small archives, each its own writer."""
    global _CRC_POOL
    if _CRC_POOL is None:
        _CRC_POOL = ThreadPoolExecutor(1, thread_name_prefix="hpckpt-crc")
    return _CRC_POOL


def _crc_of_range(fd: int, offset: int, size: int) -> int:
    """CRC-32 of `size` bytes at `offset` of `fd`, read through one reused buffer (zlib.crc32
    releases the GIL, so this runs beside the copying thread)."""
    buffer = bytearray(min(size, COPY_CHUNK_BYTES))
    view, crc, done = memoryview(buffer), 0, 0
    while done < size:
        n = os.preadv(fd, [view[: min(len(view), size - done)]], offset + done)
        if n <= 0:
            raise EOFError(f"{size - done} bytes missing at offset {offset + done}")
        crc = zlib.crc32(view[:n], crc)
        done += n
    return crc


def _fsync_dir(directory: Path) -> None:
    """Persist the rename; best effort (some file systems refuse fsync on directories)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
