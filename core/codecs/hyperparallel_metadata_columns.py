"""HyperParallel's `.metadata` pickle for plans of millions of chunks, written from columns.

`dumps_metadata` builds one Python object per chunk and per storage entry (six, with their
tuples and dicts) and hands them to the stock pickler: 1,024 FSDP ranks x 1,000 tensors (a
million chunks) took 32 s and 2 GiB. Here every chunk record and storage entry has a fixed
width, so a tensor's records are written at once from its arrays (numpy), in bounded time per
chunk and a few copies of the output's size in memory.

The pickle is protocol 4 (framed) and loads, through HyperParallel's classes or hpckpt's safe unpickler,
into exactly what `dumps_metadata` gives for the same plan (tests/test_metadata_columns.py): the
same classes, field values and entries. Its bytes differ: every constant (the classes, the
field names, the names of tensors and files) is put in the memo once, in a preamble that is
popped from the stack, and each record refers to them by 4-byte memo indexes; integers are
4-byte. A plan with an integer past 2**31 - 1 is not for this path (`fits`).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hpckpt.core.codecs.hyperparallel_metadata import HP_METADATA_MODULE, HP_STORAGE_MODULE
from hpckpt.core.codecs.pickle_builder import PickleBuilder

_INT32 = 2**31 - 1


@dataclass(frozen=True)
class TensorColumns:
    """One tensor's entry: its chunks in chunk-list order, the file (its writer's rank) and the
    key in that file of each."""

    fqn: str
    dtype: str  # as the metadata spells it ("torch.float32", "Float32")
    shape: tuple[int, ...]
    offsets: np.ndarray  # [chunks, ndim]
    sizes: np.ndarray
    ranks: np.ndarray  # the rank whose file holds each chunk
    index: np.ndarray  # each chunk's position in the chunk list (MetadataIndex.index)
    keys: Sequence[str] | None = None  # each chunk's key in its file; None: the fqn for every one


@dataclass(frozen=True)
class ValueColumns:
    fqn: str
    file: str
    offset: int
    length: int


def fits(tensors: Iterable[TensorColumns]) -> bool:
    """Every integer of these tensors' records fits the 4-byte form."""
    for t in tensors:
        for a in (t.offsets, t.sizes, t.index):
            if a.size and (int(a.max()) > _INT32 or int(a.min()) < 0):
                return False
        if any(s > _INT32 for s in t.shape):
            return False
    return True


class _Writer:
    """Opcodes into a list of byte strings, with the memo of constants."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.memo: dict[tuple[str, object], int] = {}

    def emit(self, data: bytes) -> None:
        self.parts.append(data)

    def get(self, kind: str, value: object) -> bytes:
        return pickle.LONG_BINGET + struct.pack("<I", self.memo[(kind, value)])

    def remember(self, kind: str, value: object) -> None:
        """In the preamble: push the constant and put it in the memo (popped with the mark)."""
        if (kind, value) in self.memo:
            return
        if kind == "global":
            module, name = value  # type: ignore[misc]
            self.emit(pickle.GLOBAL + f"{module}\n{name}\n".encode("ascii"))
        else:
            self.emit(_encoded(str(value)))
        index = self.memo[(kind, value)] = len(self.memo)
        self.emit(pickle.LONG_BINPUT + struct.pack("<I", index))

    def obj(self, cls: str, fields: Sequence[tuple[str, bytes]]) -> bytes:
        """An instance of the memoized class `cls` with `__dict__` = fields (encoded values)."""
        head = self.get("global", _CLASSES[cls]) + pickle.EMPTY_TUPLE + pickle.NEWOBJ
        if not fields:
            return head
        body = b"".join(self.get("str", name) + value for name, value in fields)
        return head + pickle.EMPTY_DICT + pickle.MARK + body + pickle.SETITEMS + pickle.BUILD


_CLASSES = {
    "Metadata": (HP_METADATA_MODULE, "Metadata"),
    "TensorStorageMetadata": (HP_METADATA_MODULE, "TensorStorageMetadata"),
    "TensorProperties": (HP_METADATA_MODULE, "TensorProperties"),
    "ChunkStorageMetadata": (HP_METADATA_MODULE, "ChunkStorageMetadata"),
    "BytesStorageMetadata": (HP_METADATA_MODULE, "BytesStorageMetadata"),
    "MetadataIndex": (HP_METADATA_MODULE, "MetadataIndex"),
    "StorageInfo": (HP_STORAGE_MODULE, "StorageInfo"),
}
_NAMES = ("state_dict_metadata", "planner_data", "storage_data", "version", "properties", "size", "chunks", "dtype",
          "requires_grad", "memory_format", "offsets", "sizes", "fqn", "offset", "index", "relative_path", "length",
          "tensor_key")


def _encoded(value: object) -> bytes:
    """A plain value (a string, an int, planner data: names and key paths) as opcodes, by the
    project's one hand-written pickler; it must not touch the memo, which is this module's."""
    builder = PickleBuilder()
    builder.value(value, "metadata")
    if builder.checkpoint()[1]:
        raise TypeError(f"planner data holds a value that needs a global: {value!r:.80}")
    return bytes(builder.body)


def tuple_ops(ndim: int) -> tuple[bytes, bytes]:
    """What goes before and after `ndim` pushed integers to make them a tuple."""
    if ndim == 0:
        return pickle.EMPTY_TUPLE, b""
    if ndim <= 3:
        return b"", (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[ndim - 1]
    return pickle.MARK, pickle.TUPLE


class _Record:
    """A fixed-width record: constant bytes with 4-byte integer slots, filled for many rows at once."""

    def __init__(self) -> None:
        self.template = bytearray()
        self.slots: list[int] = []

    def const(self, data: bytes) -> None:
        self.template += data

    def int_slot(self, opcode: bytes = pickle.BININT) -> None:
        self.template += opcode
        self.slots.append(len(self.template))
        self.template += b"\0\0\0\0"

    def fill(self, columns: Sequence[np.ndarray], n: int) -> bytes:
        """`n` records, slot i taking `columns[i]`."""
        rows = np.tile(np.frombuffer(bytes(self.template), np.uint8), (n, 1))
        for at, values in zip(self.slots, columns):
            rows[:, at:at + 4] = np.ascontiguousarray(values, "<i4").view(np.uint8).reshape(n, 4)
        return rows.tobytes()


def dumps_metadata_columns(tensors: Sequence[TensorColumns], values: Sequence[ValueColumns], files: Sequence[str], *,
                           planner_data: object, version: str) -> bytes:
    """The `.metadata` of these tensors (in order) and values; `files[r]` is the file of rank r's
    chunks. Check `fits` first."""
    w = _Writer()
    w.emit(pickle.MARK)
    for cls in _CLASSES.values():
        w.remember("global", cls)
    for name in _NAMES:
        w.remember("str", name)
    for t in tensors:
        w.remember("str", t.fqn)
        w.remember("str", t.dtype)
        for key in t.keys or ():
            w.remember("str", key)
    for v in values:
        w.remember("str", v.fqn)
        w.remember("str", v.file)
    for name in files:
        w.remember("str", name)
    w.emit(pickle.POP_MARK)
    file_memo = np.array([w.memo[("str", name)] for name in files], np.int64)

    # Metadata(state_dict_metadata={...}, storage_data={...}, version=..., planner_data=...)
    w.emit(w.get("global", _CLASSES["Metadata"]) + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK)
    w.emit(w.get("str", "state_dict_metadata") + pickle.EMPTY_DICT + pickle.MARK)
    for t in tensors:
        _tensor_entry(w, t)
    for v in values:
        w.emit(w.get("str", v.fqn) + w.obj("BytesStorageMetadata", ()))
    w.emit(pickle.SETITEMS)
    w.emit(w.get("str", "storage_data") + pickle.EMPTY_DICT + pickle.MARK)
    for t in tensors:
        _storage_entries(w, t, file_memo)
    for v in values:
        key = w.obj("MetadataIndex", [("fqn", w.get("str", v.fqn)), ("offset", pickle.EMPTY_TUPLE),
                                      ("index", pickle.NONE)])
        info = w.obj("StorageInfo", [("relative_path", w.get("str", v.file)), ("offset", _encoded(v.offset)),
                                     ("length", _encoded(v.length)), ("tensor_key", pickle.NONE)])
        w.emit(key + info)
    w.emit(pickle.SETITEMS)
    w.emit(w.get("str", "version") + _encoded(version))
    w.emit(w.get("str", "planner_data") + _encoded(planner_data))
    w.emit(pickle.SETITEMS + pickle.BUILD + pickle.STOP)
    return _framed(w.parts)


FRAME_BYTES = 1 << 20


def _framed(parts: list[bytes]) -> bytes:
    """Protocol 4 with the parts (whole opcodes each) in frames of about `FRAME_BYTES`: an
    unpickler reading from a file then takes a frame at a time instead of a read per opcode
    (2-3x faster for hpckpt's reader, which unpickles from a BytesIO)."""
    out, pending, size = [pickle.PROTO + bytes([4])], [], 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            out.append(pickle.FRAME + struct.pack("<Q", size))
            out.extend(pending)
            pending, size = [], 0
    for part in parts:
        if size + len(part) > FRAME_BYTES:
            flush()
        pending.append(part)
        size += len(part)
    flush()
    return b"".join(out)


def _tensor_entry(w: _Writer, t: TensorColumns) -> None:
    """`fqn: TensorStorageMetadata(properties, size, chunks=[ChunkStorageMetadata...])`."""
    properties = w.obj("TensorProperties", [("dtype", w.get("str", t.dtype)), ("requires_grad", pickle.NEWFALSE),
                                            ("memory_format", pickle.NONE)])
    size = _encoded(tuple(int(s) for s in t.shape))
    w.emit(w.get("str", t.fqn) + w.get("global", _CLASSES["TensorStorageMetadata"]) + pickle.EMPTY_TUPLE +
           pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK + w.get("str", "properties") + properties +
           w.get("str", "size") + size + w.get("str", "chunks") + pickle.EMPTY_LIST + pickle.MARK)
    ndim = len(t.shape)
    before, after = tuple_ops(ndim)
    record = _Record()
    record.const(w.get("global", _CLASSES["ChunkStorageMetadata"]) + pickle.EMPTY_TUPLE + pickle.NEWOBJ +
                 pickle.EMPTY_DICT + pickle.MARK)
    for name in ("offsets", "sizes"):
        record.const(w.get("str", name) + before)
        for _ in range(ndim):
            record.int_slot()
        record.const(after)
    record.const(pickle.SETITEMS + pickle.BUILD)
    columns = [t.offsets[:, d] for d in range(ndim)] + [t.sizes[:, d] for d in range(ndim)]
    w.emit(record.fill(columns, len(t.index)))
    w.emit(pickle.APPENDS + pickle.SETITEMS + pickle.BUILD)


def _storage_entries(w: _Writer, t: TensorColumns, file_memo: np.ndarray) -> None:
    """`MetadataIndex(fqn, offset, index): StorageInfo(file, 0, -1, key)` for each chunk."""
    ndim = len(t.shape)
    before, after = tuple_ops(ndim)
    record = _Record()
    record.const(w.get("global", _CLASSES["MetadataIndex"]) + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT +
                 pickle.MARK + w.get("str", "fqn") + w.get("str", t.fqn) + w.get("str", "offset") + before)
    for _ in range(ndim):
        record.int_slot()
    record.const(after + w.get("str", "index"))
    record.int_slot()
    record.const(pickle.SETITEMS + pickle.BUILD)
    record.const(w.get("global", _CLASSES["StorageInfo"]) + pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT +
                 pickle.MARK + w.get("str", "relative_path"))
    record.int_slot(pickle.LONG_BINGET)
    record.const(w.get("str", "offset") + pickle.BININT1 + b"\0" + w.get("str", "length") + pickle.BININT +
                 struct.pack("<i", -1) + w.get("str", "tensor_key"))
    record.int_slot(pickle.LONG_BINGET)
    record.const(pickle.SETITEMS + pickle.BUILD)
    if t.keys is None:
        keys = np.full(len(t.index), w.memo[("str", t.fqn)], np.int64)
    else:
        keys = np.array([w.memo[("str", k)] for k in t.keys], np.int64)
    columns = [t.offsets[:, d] for d in range(ndim)] + [t.index, file_memo[t.ranks], keys]
    w.emit(record.fill(columns, len(t.index)))
