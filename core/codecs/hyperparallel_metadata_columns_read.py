"""Reading back, as arrays, the `.metadata` that `hyperparallel_metadata_columns` writes.

Any unpickler builds three objects, two dicts and four tuples per chunk of a HyperParallel
`.metadata`: 1.6 s and ~950 MiB for 633,700 chunks, whatever checks surround it
(docs/benchmarks.md). The pickle hpckpt writes at scale has a fixed shape: a preamble that puts
every constant in the memo, then fixed-width records whose only variable bytes are 4-byte
integers and 4-byte memo references. `read_columns` recognises exactly that shape and reads the
records' integers with numpy, building no object per chunk.

It is a recogniser, not an unpickler: every byte is either matched against what the writer
emits (each memo reference resolved to the constant the preamble put there) or read as the
integer or string the opcode carries; frames may only split where the writer splits them. Any
other file (another writer's pickle, a damaged or crafted one, names or boxes repeated so that
the unpickled dicts would collapse them) gives None, and the caller unpickles it as before. What
it accepts is therefore what the safe unpickler builds from the same bytes
(tests/test_metadata_columns_read.py compares the two on generated and on mutated files).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpckpt.core.codecs.hyperparallel_metadata import HP_METADATA_MODULE, HP_STORAGE_MODULE
from hpckpt.core.codecs.hyperparallel_metadata_columns import tuple_ops

_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U64 = struct.Struct("<Q").unpack_from

MARK, POP_MARK, STOP, GLOBAL, BINUNICODE = 0x28, 0x31, 0x2E, 0x63, 0x58
LONG_BINPUT, LONG_BINGET, FRAME, SETITEMS = 0x72, 0x6A, 0x95, 0x75
BININT1, BININT2, BININT, LONG1 = 0x4B, 0x4D, 0x4A, 0x8A
EMPTY_TUPLE, TUPLE, TUPLE1, TUPLE2, TUPLE3 = 0x29, 0x74, 0x85, 0x86, 0x87
NONE = 0x4E

_CLASSES = {
    (HP_METADATA_MODULE, "Metadata"), (HP_METADATA_MODULE, "TensorStorageMetadata"),
    (HP_METADATA_MODULE, "TensorProperties"), (HP_METADATA_MODULE, "ChunkStorageMetadata"),
    (HP_METADATA_MODULE, "BytesStorageMetadata"), (HP_METADATA_MODULE, "MetadataIndex"),
    (HP_STORAGE_MODULE, "StorageInfo"),
}
_BATCH_ROWS = 1 << 16  # records compared at once: bounds the temporaries (a few MiB)


class _NotColumns(Exception):
    """The bytes are not the columns writer's shape: the caller unpickles them."""


@dataclass(frozen=True)
class TensorRecords:
    """One tensor's entry, its chunks in chunk-list order."""

    fqn: str
    dtype: str  # as the metadata spells it
    shape: tuple[int, ...]
    offsets: np.ndarray  # int64 [chunks, ndim]
    sizes: np.ndarray
    files: np.ndarray  # memo index of each chunk's relative_path (see ColumnsMetadata.strings)
    keys: np.ndarray  # memo index of each chunk's tensor_key


@dataclass(frozen=True)
class ValueRecord:
    fqn: str
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class ColumnsMetadata:
    tensors: list[TensorRecords]
    values: list[str]  # the BytesStorageMetadata entries, in order
    value_storage: list[ValueRecord]  # storage_data's entries that are not chunks, in order
    strings: np.ndarray  # object array: the memo's strings (None where the memo holds a class)
    planner_data: Any
    version: str
    file_refs: np.ndarray  # the memo indexes of the files the tensors' records name

    def chunk_files(self, t: TensorRecords, which: Any = None) -> list[str]:
        idx = t.files if which is None else t.files[np.asarray(which, np.int64)]
        return self.strings[idx].tolist()

    def data_files(self) -> set[str]:
        """Every relative_path storage_data names."""
        return set(self.strings[self.file_refs].tolist()) | {v.file for v in self.value_storage}


def read_columns(data: bytes) -> ColumnsMetadata | None:
    """The metadata in `data` as arrays, or None when `data` is not in the columns writer's shape."""
    try:
        return _Recogniser(data).read()
    except Exception:  # noqa: BLE001 - whatever stopped the recogniser, the unpickler's path decides
        return None


class _Template:
    """A record's bytes with 4-byte slots: fixed bytes compared, slots read, many rows at once."""

    def __init__(self, parts: list[bytes | None]):
        """`parts`: constant bytes, None for a 4-byte slot (its opcode is in the constant before)."""
        raw, self.slots = bytearray(), []
        for part in parts:
            if part is None:
                self.slots.append(len(raw))
                raw += b"\0\0\0\0"
            else:
                raw += part
        self.width = len(raw)
        self.bytes = bytes(raw)

    def read(self, rows: np.ndarray, raw: bytearray) -> np.ndarray:
        """The slots of `rows` ([n, width] uint8, a view of all of `raw`) as int64 [n, slots];
        every other byte must be the template's. The slots are zeroed in `raw` on the way, so the
        comparison is one of `raw` against the template repeated (a memcmp)."""
        slots = []
        for at in self.slots:
            slots.append(rows[:, at:at + 4].copy().view("<i4"))  # a copy: the bytes are zeroed next
            rows[:, at:at + 4] = 0
        if raw != self.bytes * len(rows):
            raise _NotColumns("a record differs from the writer's")
        if not slots:
            return np.zeros((len(rows), 0), np.int64)
        return np.concatenate(slots, axis=1).astype(np.int64)


class _Recogniser:
    def __init__(self, data: bytes):
        self.data = data
        self.p = 0
        self.next_frame = 0  # where the current frame ends (the next FRAME opcode is due)
        self.memo: list[Any] = []
        self._refs: dict[str, bytes] = {}
        self._templates: dict[tuple, _Template] = {}

    # --- bytes -------------------------------------------------------------------------------
    def unit(self) -> None:
        """A place where the writer may start a frame: take the FRAME opcode that ends the last one."""
        if self.p == self.next_frame:
            if self.p == len(self.data):
                return
            if self.data[self.p] != FRAME:
                raise _NotColumns("no frame where one is due")
            length = _U64(self.data, self.p + 1)[0]
            self.p += 9
            self.next_frame = self.p + length
            if length == 0 or self.next_frame > len(self.data):
                raise _NotColumns("a frame past the end")
        elif self.p > self.next_frame:
            raise _NotColumns("a frame boundary inside a record")

    def expect(self, const: bytes) -> None:
        if not self.data.startswith(const, self.p):
            raise _NotColumns("bytes differ from the writer's")
        self.p += len(const)

    def ref(self) -> int:
        """A LONG_BINGET: the memo index."""
        if self.data[self.p] != LONG_BINGET:
            raise _NotColumns("not a memo reference")
        index = _U32(self.data, self.p + 1)[0]
        self.p += 5
        if index >= len(self.memo):
            raise _NotColumns("a memo index past the preamble")
        return index

    def string_ref(self) -> str:
        value = self.memo[self.ref()]
        if type(value) is not str:
            raise _NotColumns("a class where a string is due")
        return value

    def string(self) -> str:
        if self.data[self.p] != BINUNICODE:
            raise _NotColumns("not a string")
        n = _U32(self.data, self.p + 1)[0]
        end = self.p + 5 + n
        if end > len(self.data):
            raise _NotColumns("a string past the end")
        value = self.data[self.p + 5:end].decode("utf-8", "surrogatepass")
        self.p = end
        return value

    def integer(self) -> int:
        d, p, op = self.data, self.p, self.data[self.p]
        if op == BININT1:
            self.p += 2
            return d[p + 1]
        if op == BININT2:
            self.p += 3
            return d[p + 1] | d[p + 2] << 8
        if op == BININT:
            self.p += 5
            return _I32(d, p + 1)[0]
        if op == LONG1:
            n = d[p + 1]
            self.p += 2 + n
            return int.from_bytes(d[p + 2:p + 2 + n], "little", signed=True)
        raise _NotColumns("not an integer")

    def int_tuple(self) -> tuple:
        """A tuple of ints as PickleBuilder writes one (or of ints and strings: a key path)."""
        d, p = self.data, self.p
        op = d[p]
        if op == EMPTY_TUPLE:
            self.p = p + 1
            return ()
        marked = op == MARK
        p += marked
        items: list = []
        while True:  # (one loop over the items, not a call each: key paths are many)
            op = d[p]
            if op == BINUNICODE:
                end = p + 5 + _U32(d, p + 1)[0]
                if end > len(d):
                    raise _NotColumns("a string past the end")
                items.append(d[p + 5:end].decode("utf-8", "surrogatepass"))
                p = end
            elif op == BININT1:
                items.append(d[p + 1])
                p += 2
            elif op in (BININT2, BININT, LONG1):
                self.p = p
                items.append(self.integer())
                p = self.p
            else:
                break
        if marked and op == TUPLE:
            self.p = p + 1
            return tuple(items)
        if not marked and 1 <= len(items) <= 3 and op == (TUPLE1, TUPLE2, TUPLE3)[len(items) - 1]:
            self.p = p + 1
            return tuple(items)
        raise _NotColumns("not a tuple")

    # --- the file ----------------------------------------------------------------------------
    def read(self) -> ColumnsMetadata:
        if not self.data.startswith(b"\x80\x04"):
            raise _NotColumns("not protocol 4")
        self.p = self.next_frame = 2
        self.unit()
        self.preamble()
        return self.metadata()

    def preamble(self) -> None:
        """MARK, (constant, LONG_BINPUT n) for n = 0, 1, ..., POP_MARK."""
        self.expect(b"(")
        d, memo = self.data, self.memo
        while True:
            self.unit()
            op = d[self.p]
            if op == POP_MARK:
                self.p += 1
                break
            if op == BINUNICODE:
                value: Any = self.string()
            elif op == GLOBAL:
                first = d.index(b"\n", self.p + 1)
                second = d.index(b"\n", first + 1)
                value = (d[self.p + 1:first].decode("ascii"), d[first + 1:second].decode("ascii"))
                if value not in _CLASSES:
                    raise _NotColumns("a global the writer does not use")
                self.p = second + 1
            else:
                raise _NotColumns("not a constant")
            self.unit()
            if d[self.p] != LONG_BINPUT or _U32(d, self.p + 1)[0] != len(memo):
                raise _NotColumns("the preamble's memo is not in order")
            memo.append(value)
            self.p += 5
        self.first: dict = {}
        for i, value in enumerate(memo):
            self.first.setdefault(value, i)

    def s(self, name: str) -> bytes:
        """The memo reference the writer emits for the string `name`."""
        found = self._refs.get(name)
        if found is None:
            found = self._refs[name] = self._get(name)
        return found

    def g(self, cls: str) -> bytes:
        module = HP_STORAGE_MODULE if cls == "StorageInfo" else HP_METADATA_MODULE
        return self._get((module, cls))

    def _get(self, key: Any) -> bytes:
        index = self.first.get(key)
        if index is None:
            raise _NotColumns(f"the preamble lacks {key!r}")
        return bytes([LONG_BINGET]) + struct.pack("<I", index)

    def obj(self, cls: str) -> bytes:
        return self.g(cls) + b")\x81}("

    def metadata(self) -> ColumnsMetadata:
        s = self.s
        self.unit()
        self.expect(self.g("Metadata") + b")\x81}(")
        self.unit()
        self.expect(s("state_dict_metadata") + b"}(")
        tensor_head = self.obj("TensorStorageMetadata") + s("properties") + self.obj("TensorProperties") + s("dtype")
        tensor_mid = s("requires_grad") + b"\x89" + s("memory_format") + b"Nub" + s("size")
        tensor_chunks = s("chunks") + b"]("
        value_entry = self.g("BytesStorageMetadata") + b")\x81"
        tensors: list[tuple] = []  # (fqn index, dtype, shape, block start, rows)
        values: list[str] = []
        names: set[int] = set()
        while True:
            self.unit()
            if self.data[self.p] == SETITEMS:
                self.p += 1
                break
            fqn = self.ref()
            if type(self.memo[fqn]) is not str or fqn in names:
                raise _NotColumns("a name that is not a string, or one given twice")
            names.add(fqn)
            if self.data.startswith(value_entry, self.p):
                self.p += len(value_entry)
                values.append(self.memo[fqn])
                continue
            self.expect(tensor_head)
            dtype = self.string_ref()
            self.expect(tensor_mid)
            shape = self.int_tuple()
            if any(type(n) is not int or n < 0 for n in shape):
                raise _NotColumns("a shape that is not non-negative ints")
            self.expect(tensor_chunks)
            self.unit()
            start, rows = self.block(self._chunk_template(len(shape)).width)
            tensors.append((fqn, dtype, shape, start, rows))
            self.unit()
            self.expect(b"eub")
        if len({self.memo[f] for f, *_ in tensors} | set(values)) != len(tensors) + len(values):
            raise _NotColumns("a name given twice")
        self.unit()
        self.expect(s("storage_data") + b"}(")
        storage_starts = []
        for fqn, _dtype, shape, _start, rows in tensors:
            self.unit()
            storage_starts.append(self.p)
            self.p += rows * self._storage_template(len(shape)).width
            if self.p > self.next_frame:
                raise _NotColumns("storage records past their frame")
        value_storage = self.value_storage({self.memo[f] for f, *_ in tensors})
        self.unit()
        self.expect(b"u")
        self.unit()
        self.expect(s("version"))
        version = self.string()
        self.unit()
        self.expect(s("planner_data"))
        planner = self.planner_data()
        self.unit()
        self.expect(b"ub.")
        if self.p != len(self.data) or self.next_frame != len(self.data):
            raise _NotColumns("bytes after the end")
        records, file_refs = self.records(tensors, storage_starts)
        strings = np.array([v if type(v) is str else None for v in self.memo] + [None], dtype=object)[:-1]
        return ColumnsMetadata(records, values, value_storage, strings, planner, version, file_refs)

    def block(self, width: int) -> tuple[int, int]:
        """The chunk records from here to the `APPENDS SETITEMS BUILD` after the last: (start, rows)."""
        start, limit, d = self.p, self.next_frame, self.data
        end = d.find(b"eub", start, limit)
        while end >= 0 and (end - start) % width:
            end = d.find(b"eub", end + 1, limit)
        if end < 0:  # the records fill their frame; the trailer starts the next
            if (limit - start) % width:
                raise _NotColumns("chunk records of the wrong width")
            end = limit
        self.p = end
        return start, (end - start) // width

    def value_storage(self, tensor_names: set[str]) -> list[ValueRecord]:
        """storage_data's entries of values: `MetadataIndex(fqn, (), None): StorageInfo(file, offset, length, None)`."""
        s = self.s
        head = self.obj("MetadataIndex") + s("fqn")
        middle = s("offset") + b")" + s("index") + b"Nub" + self.obj("StorageInfo") + s("relative_path")
        out, seen = [], set()
        while True:
            self.unit()
            if not self.data.startswith(head, self.p):
                break
            self.p += len(head)
            fqn = self.string_ref()
            self.expect(middle)
            file = self.string_ref()
            self.expect(s("offset"))
            offset = self.integer()
            self.expect(s("length"))
            length = self.integer()
            self.expect(s("tensor_key") + b"Nub")
            if fqn in seen or fqn in tensor_names:
                raise _NotColumns("a storage_data key given twice")
            seen.add(fqn)
            out.append(ValueRecord(fqn, file, offset, length))
        return out

    def planner_data(self) -> Any:
        """None, or a dict of name -> key path (a tuple of strings and ints), as the writer puts it."""
        d = self.data
        if d[self.p] == NONE:
            self.p += 1
            return None
        self.expect(b"}")
        out: dict = {}
        if d[self.p] != MARK:
            return out
        self.p += 1
        while d[self.p] != SETITEMS:
            key = self.string()
            if key in out:
                raise _NotColumns("a planner_data key given twice")
            out[key] = self.int_tuple()
        self.p += 1
        return out

    # --- records -----------------------------------------------------------------------------
    def _chunk_template(self, ndim: int) -> _Template:
        found = self._templates.get(("chunk", ndim))
        if found is not None:
            return found
        before, after = tuple_ops(ndim)
        parts: list[bytes | None] = [self.obj("ChunkStorageMetadata")]
        for name in ("offsets", "sizes"):
            parts.append(self.s(name) + before)
            for _ in range(ndim):
                parts += [b"J", None]
            parts.append(after)
        parts.append(b"ub")
        return self._cached(("chunk", ndim), parts)

    def _storage_template(self, ndim: int) -> _Template:
        found = self._templates.get(("storage", ndim))
        if found is not None:
            return found
        s = self.s
        before, after = tuple_ops(ndim)
        parts: list[bytes | None] = [self.obj("MetadataIndex") + s("fqn") + b"j", None, s("offset") + before]
        for _ in range(ndim):
            parts += [b"J", None]
        parts += [after + s("index") + b"J", None, b"ub" + self.obj("StorageInfo") + s("relative_path") + b"j", None,
                  s("offset") + b"K\0" + s("length") + b"J\xff\xff\xff\xff" + s("tensor_key") + b"j", None, b"ub"]
        return self._cached(("storage", ndim), parts)

    def _cached(self, key: tuple, parts: list) -> _Template:
        self._templates[key] = _Template(parts)
        return self._templates[key]

    def records(self, tensors: list[tuple], storage_starts: list[int]) -> tuple[list[TensorRecords], np.ndarray]:
        """Every tensor's chunk and storage records, read a dimension count at a time."""
        is_string = np.array([type(v) is str for v in self.memo], bool)
        by_ndim: dict[int, list[int]] = {}
        for i, (_fqn, _dtype, shape, _start, _rows) in enumerate(tensors):
            by_ndim.setdefault(len(shape), []).append(i)
        columns: dict[int, tuple] = {}
        file_refs: list[np.ndarray] = [np.zeros(0, np.int64)]
        for ndim, members in by_ndim.items():
            chunk = self._read_rows(self._chunk_template(ndim), [(tensors[i][3], tensors[i][4]) for i in members])
            storage = self._read_rows(self._storage_template(ndim), [(storage_starts[i], tensors[i][4]) for i in members])
            counts = np.array([tensors[i][4] for i in members], np.int64)
            firsts = np.cumsum(counts) - counts
            owner = np.repeat(np.arange(len(members)), counts)
            offsets, sizes = chunk[:, :ndim], chunk[:, ndim:]
            fqn_index = np.array([tensors[i][0] for i in members], np.int64)
            if (offsets < 0).any() or (sizes < 0).any():
                raise _NotColumns("a negative offset or size")
            if not (np.array_equal(storage[:, 0], fqn_index[owner]) and np.array_equal(storage[:, 1:1 + ndim], offsets)
                    and np.array_equal(storage[:, 1 + ndim], np.arange(len(owner)) - firsts[owner])):
                raise _NotColumns("storage records that do not follow the chunks")
            files, keys = storage[:, 2 + ndim], storage[:, 3 + ndim]
            for refs in (files, keys):
                if refs.size and ((refs < 0).any() or (refs >= len(self.memo)).any() or not is_string[refs].all()):
                    raise _NotColumns("a file or key that is not a string of the preamble")
            last = last_of_equal(owner, offsets)
            if last is not None:  # storage_data's key is the name and offsets: one entry, the last, for them all
                files, keys = files[last], keys[last]
            columns[ndim] = (members, firsts, counts, offsets, sizes, files, keys)
            file_refs.append(np.unique(files))
        out: list[TensorRecords | None] = [None] * len(tensors)
        for members, firsts, counts, offsets, sizes, files, keys in columns.values():
            for i, a, n in zip(members, firsts.tolist(), counts.tolist()):
                fqn, dtype, shape, _start, _rows = tensors[i]
                b = a + n
                out[i] = TensorRecords(self.memo[fqn], dtype, shape, offsets[a:b], sizes[a:b], files[a:b], keys[a:b])
        return out, np.unique(np.concatenate(file_refs))  # type: ignore[return-value]

    def _read_rows(self, template: _Template, blocks: list[tuple[int, int]]) -> np.ndarray:
        """The slots of every record of `blocks` ((start, rows) each), in order: the blocks'
        bytes joined (one C-level pass), a batch of blocks at a time."""
        w, view, parts, batch, pending = template.width, memoryview(self.data), [], [], 0
        for start, rows in blocks:
            batch.append(view[start:start + rows * w])
            pending += rows
            if pending >= _BATCH_ROWS:
                parts.append(self._read_batch(template, batch))
                batch, pending = [], 0
        if batch:
            parts.append(self._read_batch(template, batch))
        return np.concatenate(parts) if parts else np.zeros((0, len(template.slots)), np.int64)

    @staticmethod
    def _read_batch(template: _Template, pieces: list[memoryview]) -> np.ndarray:
        raw = bytearray().join(pieces)
        rows = np.frombuffer(raw, np.uint8).reshape(len(raw) // template.width, template.width)
        return template.read(rows, raw)


def last_of_equal(owner: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """For each row, the last row of the same owner at the same offsets (None: no two alike).

    Chunks of a tensor that start at the same offsets (the empty chunks of ranks past a
    tensor's rows, replicas stored twice) share one `storage_data` key, as `MetadataIndex`
    compares by name and offsets: the unpickled dict keeps the last entry's file and key for all
    of them, and so does this. Rows are grouped by a hash first; the groups are then checked
    exactly (a collision gives None for the whole file: the unpickler's path then reads it)."""
    if len(owner) < 2:
        return None
    ordered = _last_of_runs(owner, offsets)
    if ordered is not None:
        return ordered if len(ordered) else None
    first, inverse = box_groups(owner, offsets)
    if len(first) == len(owner):
        return None
    last = np.zeros(len(first), np.int64)
    np.maximum.at(last, inverse, np.arange(len(owner)))
    return last[inverse]


def box_groups(owner: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows grouped by owner and offsets: (a row of each group, each row's group), by a hash,
    then checked exactly (a collision raises: the unpickler's path then reads the file)."""
    mixed = owner.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for d in range(offsets.shape[1]):
        mixed = (mixed ^ offsets[:, d].astype(np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
    _, first, inverse = np.unique(mixed, return_index=True, return_inverse=True)
    lead = first[inverse]
    if not (np.array_equal(owner[lead], owner) and np.array_equal(offsets[lead], offsets)):
        raise _NotColumns("a hash collision")
    return first, inverse


def _last_of_runs(owner: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """`last_of_equal` without sorting, where each owner's rows are in non-decreasing order of
    offsets (as a layout lists its boxes; the empty chunks past a tensor's end come last, alike):
    equal rows are then runs. An empty array: no two alike; None: not in order."""
    same = owner[1:] == owner[:-1]
    undecided, less, equal = same.copy(), np.zeros(len(same), bool), same.copy()
    for d in range(offsets.shape[1]):
        a, b = offsets[:-1, d], offsets[1:, d]
        less |= undecided & (a < b)
        if (undecided & (a > b)).any():
            return None
        undecided &= a == b
        equal &= a == b
    if not equal.any():
        return np.zeros(0, np.int64)
    # each row's run ends at the first row after it that is not equal to its predecessor
    ends = np.flatnonzero(~np.append(equal, False))  # positions whose next row starts a new run
    return ends[np.searchsorted(ends, np.arange(len(owner)))]

