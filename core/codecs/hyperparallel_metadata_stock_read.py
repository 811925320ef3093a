"""Reading, as arrays, the `.metadata` HyperParallel itself writes (the stock pickler, protocol 4).

The safe unpickler builds about ten objects per chunk of such a file: 2.2 s and ~1 GiB for the
640,000 chunks of a 64-rank, 10,000-tensor checkpoint (docs/benchmarks.md). Nearly all of its
bytes are two records the stock pickler repeats with the same opcodes once per chunk: a
`ChunkStorageMetadata` in a tensor's `chunks` list, and a `MetadataIndex: StorageInfo` pair in
`storage_data`. `read_stock_columns` reads those records with numpy, all at once, and gives the
rest of the file (the skeleton: a few opcodes per tensor) to the safe unpickler, each run of
records replaced by a marker. The lists and dicts the skeleton unpickles into then say where
every record was.

Why what it accepts is what the safe unpickler builds from the same bytes:
- Frames are taken off first (`_deframe`); every place one was cut must be an opcode boundary.
- A walk over the skeleton (`_Walk`) goes opcode by opcode, so a run of records starts where an
  opcode starts; every byte of a run is matched against the record's opcodes (`_Rows`), its
  memo references resolved to what the skeleton's unpickler put there (read back at its end).
- A marker does to the unpickler's stack what its records did (one object per record) or, where
  the run is all of one batch between MARK and APPENDS or SETITEMS, what those opcodes make of
  it. The runs' memo entries are not made (millions of MEMOIZEs, most of the unpickler's time):
  every memo reference the skeleton keeps is renumbered to the entries that are (`renumbered`),
  and the few strings and tuples of a run it refers to are pushed and memoised by the marker.
  Markers are integers offset by a random 60-bit number, so no byte of the file can forge one;
  the walk refuses any other reference into a run's memo entries, a DUP, a POP and any PUT, so
  no marker is copied or dropped. Each marker must then be found exactly once, in order, in a
  tensor's chunk list or as a storage_data key.
- Anything else (another opcode, a record the walk did not take, two keys the unpickled dict
  would collapse, a storage entry that is not exactly one chunk's) gives None: the caller then
  unpickles the file as before (tests/test_metadata_stock_read.py compares the two, on
  generated, real and mutated files).
"""

from __future__ import annotations

import bisect
import copy
import os
import secrets
import struct
import threading
from typing import Any

import numpy as np

from hpckpt.core.codecs.hyperparallel_metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorProperties,
    TensorStorageMetadata,
    check_hp_metadata,
)
from hpckpt.core.codecs.hyperparallel_metadata_columns_read import (
    ColumnsMetadata,
    TensorRecords,
    ValueRecord,
    box_groups,
    last_of_equal,
)
from hpckpt.core.codecs.metadata_schema import dtype_spelling
from hpckpt.core.codecs.pickle_builder import PickleBuilder
from hpckpt.core.safety.unpickle import METADATA, loads

_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from

FRAME, MEMOIZE, MARK, STOP = 0x95, 0x94, 0x28, 0x2E
BINGET, LONG_BINGET, STACK_GLOBAL = 0x68, 0x6A, 0x93
SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 = 0x8C, 0x58, 0x8D
BININT1, BININT2, BININT, LONG1, NONE = 0x4B, 0x4D, 0x4A, 0x8A, 0x4E
APPENDS, SETITEMS = 0x65, 0x75
OBJECT = b")\x81\x94}\x94("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK: an object's start
MAX_DIMS = 8  # a record with more dimensions is left to the unpickler
#: The walk steps through what the records leave, in Python (~0.5 us an opcode, the C unpickler
#: ~0.03): a file that leaves it more than an opcode per this many bytes (beyond 20,000) goes to
#: the unpickler whole (the 64 x 10,000 checkpoint leaves one per ~700 bytes), as one where
#: under 90% of a kind's records in its first MiB match theirs (if there are _FEW).
WALK_BYTES_PER_OPCODE = 256
_FEW = 100
#: Smaller files are unpickled whole: there the numpy passes cost more than the objects (a 10 KiB
#: `.metadata`: 5 ms against 1 ms; 187 KiB, 64 ranks: 18 ms against 33 ms, index included).
STOCK_FROM_BYTES = 64 << 10
_PAD = 64  # zero bytes after the body: a record read past its end reads zeros (then fails)

# Argument bytes of the opcodes the stock pickler writes for a Metadata (-1: a length prefix).
_ARGS = dict.fromkeys(b"()}]N\x88\x89\x85\x86\x87tusbaeR\x81\x93\x94.", 0)
_ARGS.update({BININT1: 1, BININT2: 2, BININT: 4, BINGET: 1, LONG_BINGET: 4, 0x47: 8, FRAME: 8})
_ARGS.update(dict.fromkeys((SHORT_BINUNICODE, BINUNICODE, BINUNICODE8, LONG1, 0x43, 0x42), -1))
_LENGTH = {SHORT_BINUNICODE: (1, "<B"), BINUNICODE: (4, "<I"), BINUNICODE8: (8, "<Q"), LONG1: (1, "<B"),
           0x43: (1, "<B"), 0x42: (4, "<I")}
_TABLE = [None] * 256
for _op, _n in _ARGS.items():
    _TABLE[_op] = _n
_STRING_PUSH = {SHORT_BINUNICODE, BINUNICODE, BINUNICODE8}

_CHUNK, _STORAGE, _HEADER = 0, 1, 2  # records: a chunk, a storage pair, a tensor's head (kept)
_CHAIN_BIT = 1 << 40  # a marker for a whole run (else for one record)
_NEEDS = {
    _HEADER: ((b"TensorStorageMetadata", b"TensorProperties"), (b"properties", b"dtype", b"requires_grad",
                                                                 b"memory_format", b"size", b"chunks")),
    _CHUNK: ((b"ChunkStorageMetadata",), (b"offsets", b"sizes")),
    _STORAGE: ((b"MetadataIndex", b"StorageInfo"), (b"fqn", b"offset", b"index", b"relative_path", b"length",
                                                    b"tensor_key")),
}
_CLASSES = {b"ChunkStorageMetadata": ChunkStorageMetadata, b"MetadataIndex": MetadataIndex,
            b"StorageInfo": StorageInfo, b"TensorStorageMetadata": TensorStorageMetadata,
            b"TensorProperties": TensorProperties}


_TUPLE_FIELDS = {_CHUNK: ("offsets", "sizes"), _STORAGE: ("offsets",)}  # tuples a record pushes or shares
_WANTED = {name for classes, names in _NEEDS.values() for name in classes + names}


class _NotStock(Exception):
    """Not (only) what the stock pickler writes for a Metadata: the caller unpickles the file."""


def read_stock_columns(data: bytes, where: str = ".metadata") -> ColumnsMetadata | None:
    """The metadata in `data` as arrays, or None where the safe unpickler must read it."""
    try:
        return _StockReader(data, where).read()
    except Exception:  # noqa: BLE001 - whatever stopped it, the unpickler's path decides (and reports)
        return None


def _ref(index: int) -> bytes:
    """The memo reference the stock pickler writes for `index`."""
    return bytes((BINGET, index)) if index < 256 else bytes((LONG_BINGET,)) + struct.pack("<I", index)


def _words(arr: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The 8 bytes at each of `at`, little-endian (`arr` padded): one gather from a view of
    `arr` as an unaligned u8 at every byte (a third faster than gathering 8-byte rows)."""
    windows = np.ndarray(shape=(len(arr) - 7,), dtype="<u8", buffer=arr, strides=(1,))
    return windows[at]


def _mask(n: int) -> np.uint64:
    return np.uint64((1 << (8 * n)) - 1)


def _word(const: bytes) -> np.uint64:
    return np.uint64(int.from_bytes(const, "little"))


def _deframe(data: bytes) -> tuple[bytes, int, list[int]]:
    """The opcodes without the FRAME headers: (body + padding, body length, where each cut was).

    The C unpickler takes a FRAME opcode wherever an opcode may start and only checks that its
    bytes are there; the stock pickler writes one frame after another from the third byte on."""
    if len(data) < 3 or data[0] != 0x80 or data[1] not in (4, 5):
        raise _NotStock("not protocol 4 or 5")
    view, n, p = memoryview(data), len(data), 2
    parts, cuts, size = [], [], 0
    while p < n and data[p] == FRAME:
        if p + 9 > n:
            raise _NotStock("a cut frame header")
        length = _U64(data, p + 1)[0]
        if p + 9 + length > n:
            raise _NotStock("a frame past the end")
        if parts:
            cuts.append(size)
        parts.append(view[p + 9:p + 9 + length])
        size += length
        p += 9 + length
    if p < n:
        if parts:
            cuts.append(size)
        parts.append(view[p:])
        size += n - p
    parts.append(bytes(_PAD))
    return b"".join(parts), size, cuts


class _Rows:
    """Records read at once: `p` each one's position in the body, `ok` whether it still matches,
    `memo` how many memo entries it has made so far. Bytes are read eight at a time (one
    gather a field, not one a byte)."""

    def __init__(self, arr: np.ndarray, size: int, p: np.ndarray, memo: int):
        self.arr, self.size = arr, size
        self.p = p.astype(np.int64)
        self.ok = np.ones(len(p), bool)
        self.memo = np.full(len(p), memo, np.int64)

    def _settle(self) -> None:
        """Keep reads inside the padded body: a row past its end reads zeros, which no record's
        opcodes are, so it fails the next byte it is matched against."""
        np.minimum(self.p, self.size, out=self.p)

    def byte(self, k: int = 0) -> np.ndarray:
        return self.arr[self.p + k]

    def word(self, k: int = 0) -> np.ndarray:
        """The 8 bytes at each row's p + k, little-endian."""
        return _words(self.arr, self.p + k)

    def expect(self, const: bytes) -> None:
        for k in range(0, len(const), 8):
            piece = const[k:k + 8]
            self.ok &= (self.word(k) & _mask(len(piece))) == _word(piece)
        self.p += len(const)
        self._settle()

    def memoize(self, where: np.ndarray | None = None) -> None:
        """A MEMOIZE (where `where`)."""
        if where is None:
            self.ok &= self.byte() == MEMOIZE
            self.p += 1
            self.memo += 1
        else:
            self.ok &= ~where | (self.byte() == MEMOIZE)
            self.p += where
            self.memo += where
        self._settle()

    def _le(self, start: int, nbytes: int) -> np.ndarray:
        return (self.word(start) & _mask(nbytes)).astype(np.int64)

    def integer(self, where: np.ndarray | None = None) -> np.ndarray:
        """An int (BININT1, BININT2, BININT, or LONG1 of up to 8 bytes)."""
        rows = self.ok if where is None else self.ok & where
        w = self.word()
        op = (w & np.uint64(0xFF)).astype(np.uint8)
        k, m, j, long1 = op == BININT1, op == BININT2, op == BININT, op == LONG1
        self.ok &= ~rows | k | m | j | long1
        arg = (w >> np.uint64(8)).astype(np.int64)
        width = np.where(k, 2, np.where(m, 3, 5))
        four = arg & 0xFFFFFFFF
        value = np.where(k, arg & 0xFF, np.where(m, arg & 0xFFFF, four - ((four >> 31) << 32)))
        if (rows & long1).any():
            nbytes = arg & 0xFF
            self.ok &= ~(rows & long1) | (nbytes <= 8)
            n = nbytes.clip(1, 8).astype(np.uint64)
            shift = np.uint64(64) - n * np.uint64(8)
            raw = self.word(2) << shift  # its bytes at the top, then shifted back with the sign
            signed = raw.view(np.int64) >> shift.astype(np.int64)
            value = np.where(long1, np.where(nbytes == 0, 0, signed), value)
            width = np.where(long1, 2 + nbytes, width)
        self.p += np.where(rows, width, 0)
        self._settle()
        return value

    def int_tuple(self, where: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A tuple of ints as the stock pickler writes it (in rows `where`): () unmemoised; 1-3
        items and TUPLEn; more between MARK and TUPLE. Returns (values [rows, most items read],
        count)."""
        act = self.ok if where is None else self.ok & where
        op = self.byte()
        empty, marked = act & (op == 0x29), act & (op == MARK)
        self.p += empty | marked
        columns = []
        count = np.zeros(len(self.p), np.int64)
        active = act & ~empty
        for d in range(MAX_DIMS + 1):
            op = self.byte()
            more = active & ((op == BININT1) | (op == BININT2) | (op == BININT) | (op == LONG1))
            if not more.any():
                break
            if d == MAX_DIMS:
                self.ok &= ~more
                break
            columns.append(np.where(more, self.integer(more), 0))
            count += more
            active = more
        close = self.byte()
        short = np.where(count == 1, close == 0x85, np.where(count == 2, close == 0x86, close == 0x87))
        valid = empty | np.where(marked, (count > 3) & (close == 0x74), (count >= 1) & (count <= 3) & short)
        self.ok &= ~act | valid
        self.p += act & ~empty
        self.memoize(act & ~empty)
        values = np.stack(columns, axis=1) if columns else np.zeros((len(self.p), 0), np.int64)
        return values, count

    def tuple_field(self) -> tuple[np.ndarray, ...]:
        """A tuple of ints pushed, or a memo reference to one (a tuple shared with another
        record). Returns (values, count, the reference or -1, the memo slot it was put in (in
        the record's count) or -1, the record's memo entries before the field (only read where
        there is a reference))."""
        op = self.byte()
        h, j = op == BINGET, op == LONG_BINGET
        shared = h | j
        if not shared.any():  # (most files: every tuple its own)
            values, count = self.int_tuple()
            return values, count, np.full(len(op), -1, np.int32), np.where(count > 0, self.memo - 1, -1), count
        ref = np.where(h, self.byte(1).astype(np.int64), np.where(j, self._le(1, 4), -1))
        at = self.memo.copy()
        self.p += np.where(h, 2, np.where(j, 5, 0))
        values, count = self.int_tuple(~shared)
        slot = np.where(~shared & (count > 0), self.memo - 1, -1)
        self._settle()
        return values, count, ref, slot, at

    def string(self, none: bool = False) -> tuple[np.ndarray, ...]:
        """A str pushed (then memoised) or a memo reference (or None, if `none`): (kind: 0 pushed,
        1 reference, 2 None; start, length of a pushed one; memo index: its place in the record's
        (its own) or the one referred to; the record's memo entries before it)."""
        op = self.byte()
        short, long, h, j = op == SHORT_BINUNICODE, op == BINUNICODE, op == BINGET, op == LONG_BINGET
        is_none = (op == NONE) if none else np.zeros(len(op), bool)
        self.ok &= short | long | h | j | is_none
        b1 = self.byte(1).astype(np.int64)
        four = self._le(1, 4)
        length = np.where(short, b1, np.where(long, four, 0))
        start = self.p + np.where(short, 2, 5)
        ref = np.where(h, b1, four)
        pushed = short | long
        kind = np.where(pushed, 0, np.where(is_none, 2, 1))
        self.p = np.where(pushed, start + length, self.p + np.where(h, 2, np.where(j, 5, 1)))
        self._settle()
        at = self.memo.copy()
        memo = np.where(pushed, self.memo, ref)
        self.memoize(pushed)
        return kind, start, length, memo, at


class _Walk:
    """The opcodes of the skeleton, one at a time: what the memo holds (as far as needed to
    learn the records' references), where runs of records start, and what to hand the unpickler."""

    def __init__(self, reader: _StockReader):
        self.r = reader
        self.strings: dict[int, bytes] = {}  # memo index -> a str pushed there (while learning)
        self.first_string: dict[bytes, int] = {}
        self.first_global: dict[bytes, int] = {}
        self.learning = True

    def run(self) -> None:
        r = self.r
        d, size, table = r.body, r.size, _TABLE
        cuts, ci = r.cuts + [size + 1], 0
        p = memo = 0
        prev = -1
        last2: list[bytes | None] = [None, None]
        pushed: bytes | None = None
        glob: bytes | None = None
        keep_from = 0
        segments = r.segments
        chain_at = r.chain_at
        refs_at = r.refs_at
        stop = None
        steps, budget = 0, 20_000 + size // WALK_BYTES_PER_OPCODE
        while p < size:
            steps += 1
            if steps > budget:
                raise _NotStock("the records leave too much to step through")
            if cuts[ci] <= p:
                if cuts[ci] < p:
                    raise _NotStock("a frame cut inside an opcode")
                while cuts[ci] == p:
                    ci += 1
            op = d[p]
            n = table[op]
            if n is None:
                raise _NotStock(f"opcode {op:#x}")
            if op == BINGET or op == LONG_BINGET:
                if chain_at and p in chain_at:
                    kind, chain = chain_at[p]
                    if kind == _HEADER:  # a tensor's head, up to its chunks: kept, walked at once
                        end = r.enter_header(chain, memo)
                        memo += r.chain_memo(kind, chain)
                        while cuts[ci] < end:
                            r.inner_cuts.append(cuts[ci])
                            ci += 1
                        p, prev = end, MARK
                        continue
                    if keep_from < p:
                        segments.append(("bytes", keep_from, p))
                    end = r.enter_chain(kind, chain, memo, prev == MARK)
                    memo += r.chain_memo(kind, chain)
                    while cuts[ci] < end:  # cuts inside the run: checked with its records
                        r.inner_cuts.append(cuts[ci])
                        ci += 1
                    r.closing.append((kind, chain, end))
                    p = keep_from = end
                    prev = -2
                    continue
                index = d[p + 1] if op == BINGET else _U32(d, p + 1)[0]
                if index >= memo:
                    raise _NotStock("a memo reference ahead of the memo")
                refs_at.append(p)
                if r.in_run_memo(index):
                    r.run_refs.add(index)  # must be a string a record pushed: the marker pushes it too
                if self.learning:
                    last2 = [last2[1], self.strings.get(index)]
                p += 1 + n
            elif n >= 0:
                if op == MEMOIZE:
                    if self.learning:
                        if prev in _STRING_PUSH:
                            self.strings[memo] = pushed
                            if pushed in _WANTED and pushed not in self.first_string:
                                self.first_string[pushed] = memo
                                self.learn(memo, p)
                        elif prev == STACK_GLOBAL and glob in _WANTED and glob not in self.first_global:
                            self.first_global[glob] = memo
                            self.learn(memo, p)
                    memo += 1
                elif op == STOP:
                    stop = p
                    break
                elif op == FRAME:
                    raise _NotStock("a frame not where the last one ended")
                elif op == STACK_GLOBAL:
                    glob = last2[1] if last2[0] is not None else None
                p += 1 + n
            else:
                width, fmt = _LENGTH[op]
                length = struct.unpack_from(fmt, d, p + 1)[0]
                end = p + 1 + width + length
                if end > size:
                    raise _NotStock("an argument past the end")
                if op in _STRING_PUSH and self.learning:
                    pushed = bytes(d[p + 1 + width:end])
                    last2 = [last2[1], pushed]
                p = end
            prev = op
        r.forget_objects()
        if stop is None or stop + 1 != size:
            raise _NotStock("no STOP at the end")
        if cuts[ci] <= size:
            raise _NotStock("a frame cut after the STOP")
        if keep_from < stop:
            segments.append(("bytes", keep_from, stop))
        for (kind, chain), base in r.chain_base.items():
            r.runs[kind]["chain_base"][chain] = base
        r.finish_rows()
        r.check_closing()
        r.check_header_refs()

    def learn(self, memo: int, p: int) -> None:
        """Once the classes and field names of a record are in the memo, find its runs ahead."""
        for kind in (_HEADER, _CHUNK, _STORAGE):
            if kind in self.r.refs:
                continue
            classes, names = _NEEDS[kind]
            found = [self.first_global.get(c) for c in classes] + [self.first_string.get(s) for s in names]
            if None not in found:
                self.r.refs[kind] = dict(zip(classes + names, found))
                self.r.find_runs(kind, p + 1)
        if len(self.r.refs) == 3:
            self.learning = False
            self.r.forget_objects()


class _StockReader:
    def __init__(self, data: bytes, where: str):
        self.data, self.where = data, where
        self.body, self.size, self.cuts = _deframe(data)
        self.arr = np.frombuffer(self.body, np.uint8)
        self.refs: dict[int, dict[bytes, int]] = {}
        self.runs: dict[int, dict[str, np.ndarray]] = {}  # per kind: record and chain columns
        self.chain_at: dict[int, tuple[int, int]] = {}  # body position -> (kind, chain)
        self.segments: list[Any] = []  # ("bytes", start, end) of the skeleton, or ("run", kind, chain)
        self.entered: list[tuple[int, int, int, bool]] = []  # (kind, chain, memo base, after MARK)
        self.closing: list[tuple[int, int, int]] = []
        self.inner_cuts: list[int] = []
        self.refs_at: list[int] = []  # where the skeleton's memo references are (BINGET, LONG_BINGET)
        self.run_refs: set[int] = set()  # memo entries of runs the skeleton refers to
        self.chain_base: dict[tuple[int, int], int] = {}
        self.chain_lists: dict[int, tuple[list, list]] = {}  # per kind: each run's end and memo entries
        self.spliced: dict[int, bytes] = {}  # memo index -> the opcodes that put its string there
        self.spliced_order: list[int] = []  # (its keys, sorted, once complete)
        self.run_memo_lo: list[int] = []
        self.run_memo_hi: list[int] = []
        self._objects: tuple | None = None
        self._tuple_sources: tuple | None = None

    # --- finding runs ------------------------------------------------------------------------
    def objects(self, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where each `OBJECT` sequence starts (its EMPTY_TUPLE) in body[lo:hi] (all of it cached),
        with the 8 bytes before and after each (a class reference, a field name's): NEWOBJ bytes
        found a block at a time (no mask as large as the file), each compared as one word."""
        whole = lo == 0 and hi is None
        if whole and self._objects is not None:
            return self._objects
        end = self.size if hi is None else min(hi, self.size)
        middle = lo + (end - lo) // 2
        if middle - lo >= HALVES_FROM * 64:
            at = np.concatenate(_both_if_two(lambda: self._object_starts(lo, middle),
                                             lambda: self._object_starts(middle, end)))
        else:
            at = self._object_starts(lo, end)
        out = (at, _words(self.arr, at - 8), _words(self.arr, at + len(OBJECT)))
        if whole:
            self._objects = out
        return out

    def forget_objects(self) -> None:
        """Every kind's runs are found: the objects' positions (~46 MiB at 633,700 chunks) go."""
        self._objects = None

    def _object_starts(self, lo: int, hi: int) -> np.ndarray:
        """Where an `OBJECT` sequence starts in body[lo:hi] (it may run past `hi`)."""
        block, found = 1 << 22, []
        mask = np.empty(block, bool)
        for at in range(lo, hi, block):
            part = self.arr[at:min(at + block, hi)]
            np.equal(part, 0x81, out=mask[:len(part)])
            found.append(np.flatnonzero(mask[:len(part)]) + (at - 1))
        at = np.concatenate(found) if found else np.zeros(0, np.int64)
        at = at[at >= 8]
        return at[_words(self.arr, at) & _mask(len(OBJECT)) == _word(OBJECT)]

    def _starting(self, head: bytes, after: bytes, start: int, window: int | None = None) -> np.ndarray:
        """Positions of `head + OBJECT + after` at or after `start` (head, after: up to 8 bytes),
        up to `start + window` if given."""
        at, before, following = self.objects() if window is None else self.objects(start, start + window)
        keep = (before >> np.uint64(8 * (8 - len(head)))) == _word(head)
        keep &= (following & _mask(len(after))) == _word(after)
        keep &= at >= start + len(head)
        return at[keep] - len(head)

    def find_runs(self, kind: int, start: int) -> None:
        refs = {k: _ref(v) for k, v in self.refs[kind].items()}
        head, after, read = {
            _CHUNK: (b"ChunkStorageMetadata", b"offsets", self._chunk_rows),
            _HEADER: (b"TensorStorageMetadata", b"properties", self._header_rows),
            _STORAGE: (b"MetadataIndex", b"fqn", self._storage_rows),
        }[kind]
        # The first MiB's records first: where most are of another shape (every chunk's sizes one
        # shared tuple...), the walk would step through them all and the unpickler is faster.
        sample = self._starting(refs[head], refs[after], start, window=1 << 20)
        if len(sample) >= _FEW:
            matched = read(sample, refs)
            if (matched["ok"] & (matched["end"] < self.size)).sum() < 0.9 * len(sample):
                raise _NotStock("most records are of another shape")
        starts = self._starting(refs[head], refs[after], start)
        rows = _in_halves(lambda part: _compact(read(part, refs)), starts)
        ok = rows.pop("ok") & (rows["end"] < self.size)  # rows that are not records stay (not copied), in no run
        cols = rows
        cols["start"] = starts
        s, e = starts, cols["end"]
        memo = np.where(ok, cols["memo"], 0)
        linked = np.zeros(len(s), bool)
        linked[1:] = ok[:-1] & ok[1:] & (e[:-1] == s[1:])
        opens = ok & ~linked
        first = np.flatnonzero(opens)
        last = np.flatnonzero(ok & ~np.append(linked[1:], False))
        count = last - first + 1
        chain_of = np.cumsum(opens) - 1
        chain_of[~ok] = -1
        cumulative = np.cumsum(memo)
        before = (cumulative - memo)[first]
        ends = cumulative[last] if len(last) else np.zeros(0, np.int64)
        cols["chain_of"] = chain_of
        cols["within"] = cumulative - memo - np.where(ok, before[chain_of.clip(0)] if len(first) else 0, 0)
        cols["chain_first"], cols["chain_count"], cols["chain_memo"] = first, count, ends - before
        cols["chain_base"] = np.full(len(first), -1, np.int64)  # memo index at the run's start, once entered
        self.chain_lists[kind] = (e[last].tolist(), (ends - before).tolist())
        self.runs[kind] = cols
        for chain, at in enumerate(s[first].tolist()):
            self.chain_at[at] = (kind, chain)

    def finish_rows(self) -> None:
        """Each record's memo index at its start (-1: its run was not entered)."""
        for cols in self.runs.values():
            chain = cols["chain_of"]
            base = cols["chain_base"][chain.clip(0)] if len(cols["chain_base"]) else np.full(len(chain), -1)
            cols["row_base"] = np.where((chain >= 0) & (base >= 0), base + cols["within"], -1)

    def _chunk_rows(self, starts: np.ndarray, refs: dict[bytes, bytes]) -> dict[str, np.ndarray]:
        head = len(refs[b"ChunkStorageMetadata"]) + len(OBJECT) + len(refs[b"offsets"])
        rows = _Rows(self.arr, self.size, starts + head, 2)
        offsets, n1, offsets_ref, offsets_slot, offsets_at = rows.tuple_field()
        rows.expect(refs[b"sizes"])
        sizes, n2, sizes_ref, sizes_slot, sizes_at = rows.tuple_field()
        rows.expect(b"ub")
        rows.ok &= (offsets_ref >= 0) | (sizes_ref >= 0) | (n1 == n2)  # (shared ones: once resolved)
        return {"ok": rows.ok, "end": rows.p, "memo": rows.memo, "ndim": n1, "offsets": offsets, "sizes": sizes,
                "sizes_ndim": n2, "offsets_ref": offsets_ref, "offsets_slot": offsets_slot, "offsets_at": offsets_at,
                "sizes_ref": sizes_ref, "sizes_slot": sizes_slot, "sizes_at": sizes_at}

    def _header_rows(self, starts: np.ndarray, refs: dict[bytes, bytes]) -> dict[str, np.ndarray]:
        """`TensorStorageMetadata(TensorProperties(dtype, requires_grad, memory_format), size, [`
        up to the MARK its chunks follow."""
        head = len(refs[b"TensorStorageMetadata"]) + len(OBJECT) + len(refs[b"properties"])
        rows = _Rows(self.arr, self.size, starts + head, 2)
        rows.expect(refs[b"TensorProperties"] + OBJECT + refs[b"dtype"])
        rows.memo += 2
        dtype_pos = rows.p.copy()
        dtype = rows.string()
        rows.expect(refs[b"requires_grad"])
        flag = rows.byte()
        rows.ok &= (flag == 0x88) | (flag == 0x89)
        rows.p += 1
        rows.expect(refs[b"memory_format"])
        format_pos = rows.p.copy()
        memory_format = rows.string(none=True)
        rows.expect(b"ub" + refs[b"size"])
        size_pos = rows.p.copy()
        size_ref = rows.tuple_field()[2]  # (a shape shared with another tensor: a memo reference)
        rows.expect(refs[b"chunks"] + b"]")
        rows.memoize()
        rows.expect(b"(")
        out = {"ok": rows.ok, "end": rows.p, "memo": rows.memo, "size_kind": (size_ref >= 0).astype(np.int64),
               "size_memo": size_ref, "dtype_pos": dtype_pos, "format_pos": format_pos, "size_pos": size_pos}
        for name, (kind, _start, _length, memo, _at) in (("dtype", dtype), ("format", memory_format)):
            out.update({f"{name}_kind": kind, f"{name}_memo": memo})
        return out

    def enter_header(self, chain: int, memo: int) -> int:
        self.chain_base[(_HEADER, chain)] = memo
        return self.chain_lists[_HEADER][0][chain]

    def check_header_refs(self) -> None:
        """What the heads refer to (a dtype, a memory format, a shape) is not a run's memo entry."""
        cols = self.runs.get(_HEADER)
        if cols is None or not self.run_memo_lo:
            return
        used = cols["row_base"] >= 0
        for name in ("dtype", "format", "size"):
            if self.in_runs(cols[f"{name}_memo"][used & (cols[f"{name}_kind"] == 1)]).any():
                raise _NotStock("a tensor's head refers into a run")

    def _storage_rows(self, starts: np.ndarray, refs: dict[bytes, bytes]) -> dict[str, np.ndarray]:
        head = len(refs[b"MetadataIndex"]) + len(OBJECT) + len(refs[b"fqn"])
        rows = _Rows(self.arr, self.size, starts + head, 2)
        fqn = rows.string()
        rows.expect(refs[b"offset"])
        offsets, ndim, offsets_ref, offsets_slot, offsets_at = rows.tuple_field()
        rows.expect(refs[b"index"])
        index = rows.integer()
        rows.expect(b"ub")
        key_memo = rows.memo.copy()
        rows.expect(refs[b"StorageInfo"] + OBJECT + refs[b"relative_path"])
        rows.memo += 2
        path = rows.string()
        rows.expect(refs[b"offset"])
        rows.integer()
        rows.expect(refs[b"length"])
        rows.integer()
        rows.expect(refs[b"tensor_key"])
        key = rows.string(none=True)
        rows.expect(b"ub")
        out = {"ok": rows.ok, "end": rows.p, "memo": rows.memo, "key_memo": key_memo, "ndim": ndim,
               "offsets": offsets, "index": index, "offsets_ref": offsets_ref, "offsets_slot": offsets_slot,
               "offsets_at": offsets_at}
        for name, (kind, start, length, memo, at) in (("fqn", fqn), ("path", path), ("key", key)):
            out.update({f"{name}_kind": kind, f"{name}_start": start, f"{name}_length": length,
                        f"{name}_memo": memo, f"{name}_at": at})
        return out

    # --- the walk's bookkeeping --------------------------------------------------------------
    def enter_chain(self, kind: int, chain: int, memo: int, after_mark: bool) -> int:
        ends, totals = self.chain_lists[kind]
        total = totals[chain]
        self.entered.append((kind, chain, memo, after_mark))
        self.chain_base[(kind, chain)] = memo
        self.segments.append(("run", kind, chain))
        if total:
            if self.run_memo_lo and memo < self.run_memo_hi[-1]:
                raise _NotStock("runs out of order")
            self.run_memo_lo.append(memo)
            self.run_memo_hi.append(memo + total)
        return ends[chain]

    def chain_memo(self, kind: int, chain: int) -> int:
        return self.chain_lists[kind][1][chain]

    def in_runs(self, indexes: np.ndarray) -> np.ndarray:
        """`in_run_memo` of many memo indexes at once."""
        lo, hi = np.array(self.run_memo_lo, np.int64), np.array(self.run_memo_hi, np.int64)
        at = np.searchsorted(lo, indexes, "right") - 1
        return (at >= 0) & (indexes < hi[at.clip(0)]) if len(lo) else np.zeros(len(indexes), bool)

    def in_run_memo(self, index: int) -> bool:
        lo = self.run_memo_lo
        if not lo or index < lo[0]:
            return False
        return index < self.run_memo_hi[bisect.bisect_right(lo, index) - 1]

    def check_closing(self) -> None:
        """A run is one marker where it is all of a batch: MARK before it, APPENDS (chunks) or
        SETITEMS (storage pairs) right after; else a marker per record. And every frame cut
        inside a run is between two of a record's opcodes."""
        self.whole = {}
        for (kind, chain, _memo, after_mark), (_k, _c, end) in zip(self.entered, self.closing):
            self.whole[(kind, chain)] = after_mark and self.body[end] == (APPENDS if kind == _CHUNK else SETITEMS)
        for cut in self.inner_cuts:
            self._check_cut(cut)

    def _check_cut(self, cut: int) -> None:
        for cols in self.runs.values():
            s = cols["start"]
            i = int(np.searchsorted(s, cut, "right")) - 1
            if i >= 0 and cols["end"][i] > cut and cols["row_base"][i] >= 0:
                if cut not in _opcode_starts(self.body, int(s[i]), int(cols["end"][i])):
                    raise _NotStock("a frame cut inside a record's opcode")
                return
        raise _NotStock("a frame cut in no record")

    # --- the skeleton ------------------------------------------------------------------------
    def read(self) -> ColumnsMetadata:
        _Walk(self).run()
        if _CHUNK not in self.runs and _STORAGE not in self.runs:
            raise _NotStock("no runs of records")
        nonce = (secrets.randbits(59) | (1 << 59)) << 1
        self._strings_referred()
        self.spliced_order = sorted(self.spliced)
        needed = self._needed_refs()
        pieces: list[Any] = [b"\x80\x04", b""]  # (the frame's header, below)
        kept_at, kept_end, kept_to = [], [], []  # each piece of the body kept: where, and where in the skeleton
        body, out = memoryview(self.body), 2
        for what, a, b in self.segments:
            if what == "run":
                piece = self._markers(a, b, nonce)
            else:
                piece = body[a:b]
                kept_at.append(a)
                kept_end.append(b)
                kept_to.append(out)
            pieces.append(piece)
            out += len(piece)
        pieces.append(b"(" + b"".join(_ref(i) for i in self.renumbered(np.array(needed, np.int64)).tolist()) + b"t\x86.")
        # One frame around it all: the C unpickler then reads the file once, not once an opcode.
        size = sum(len(piece) for piece in pieces) - 2
        pieces[1] = bytes((FRAME,)) + struct.pack("<Q", size)
        head = len(pieces[1])
        skeleton = bytearray(b"".join(pieces))
        del pieces, body
        self._renumber_refs(skeleton, np.array(kept_at, np.int64), np.array(kept_end, np.int64),
                            np.array(kept_to, np.int64) + head)
        loaded = loads(skeleton, what=self.where, kind=METADATA)
        if type(loaded) is not tuple or len(loaded) != 2 or type(loaded[0]) is not Metadata:
            raise _NotStock("the skeleton is not a Metadata")
        metadata, values = loaded
        memo_values = dict(zip(needed, values))
        self._check_refs(memo_values)
        return _Assembly(self, metadata, memo_values, nonce).columns()

    def renumbered(self, indexes: np.ndarray) -> np.ndarray:
        """The memo indexes the skeleton's unpickler gives what the file put at `indexes`: the
        runs' memo entries are not made there, but for those the skeleton refers to (`spliced`),
        so every entry after a run moves down by the run's entries it drops."""
        if not self.run_memo_lo or not len(indexes):
            return indexes
        lo, hi = np.array(self.run_memo_lo, np.int64), np.array(self.run_memo_hi, np.int64)
        before = np.cumsum(hi - lo) - (hi - lo)  # entries of the runs before each run
        k = np.searchsorted(lo, indexes, "right") - 1
        at = k.clip(0)
        dropped = np.where(k >= 0, before[at] + np.minimum(indexes, hi[at]) - lo[at], 0)
        kept = np.searchsorted(np.array(self.spliced_order, np.int64), indexes)  # spliced ones below
        return indexes - dropped + kept

    def _renumber_refs(self, skeleton: bytearray, kept_at: np.ndarray, kept_end: np.ndarray,
                       kept_to: np.ndarray) -> None:
        """Every memo reference in the kept pieces of the body (the walk's, and the tensors'
        heads' to a dtype, a memory format or a shape) rewritten for the skeleton's memo; an index
        only decreases, so each keeps its opcode and width."""
        at = [np.array(self.refs_at, np.int64)]
        cols = self.runs.get(_HEADER)
        if cols is not None:
            used = cols["row_base"] >= 0
            for name in ("dtype", "format", "size"):
                at.append(cols[f"{name}_pos"][used & (cols[f"{name}_kind"] == 1)])
            fixed = np.array(sorted(self.refs[_HEADER].values()), np.int64)
            if not np.array_equal(self.renumbered(fixed), fixed):
                raise _NotStock("a tensor's head refers to a name met after a run")
        where = np.sort(np.concatenate(at))
        if not len(where):
            return
        piece = np.searchsorted(kept_at, where, "right") - 1
        if (piece < 0).any() or (where + 1 >= kept_end[piece.clip(0)]).any():
            raise _NotStock("a reference outside the kept bytes")
        to = kept_to[piece] + (where - kept_at[piece])
        arr = np.frombuffer(skeleton, np.uint8)
        op = arr[to]
        short, long = op == BINGET, op == LONG_BINGET
        if not (short | long).all():
            raise _NotStock("a reference that is not one")
        four = to[long, None] + 1 + np.arange(4)  # (a LONG_BINGET's index: four bytes, little-endian)
        old = np.zeros(len(to), np.int64)
        old[short] = arr[to[short] + 1]
        old[long] = arr[four].copy().view("<u4")[:, 0]
        new = self.renumbered(old)
        arr[to[short] + 1] = new[short]
        arr[four] = new[long].astype("<u4").view(np.uint8).reshape(-1, 4)

    def _needed_refs(self) -> list[int]:
        """Memo indexes the runs' records refer to outside the runs (their classes, field names,
        and strings the skeleton pushed): read back from the skeleton's unpickler at its end."""
        wanted = set()
        for refs in self.refs.values():
            wanted.update(refs.values())
        cols = self.runs.get(_STORAGE)
        if cols is not None:
            used = cols["row_base"] >= 0
            for name in ("fqn", "path", "key"):
                is_ref = used & (cols[f"{name}_kind"] == 1)
                wanted.update(_distinct(cols[f"{name}_memo"][is_ref]).tolist())
        for kind, names in _TUPLE_FIELDS.items():
            cols = self.runs.get(kind)
            for name in names if cols is not None else ():
                ref = cols[f"{name}_ref"]
                wanted.update(_distinct(ref[(cols["row_base"] >= 0) & (ref >= 0)]).tolist())
        indexes = np.array(sorted(wanted), np.int64)
        return indexes[~self.in_runs(indexes)].tolist()

    def tuple_sources(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(memo index, values, count) of every tuple an entered record pushed, by memo index."""
        if self._tuple_sources is None:
            memos, values, counts = [], [], []
            for kind, names in _TUPLE_FIELDS.items():
                cols = self.runs.get(kind)
                for name in names if cols is not None else ():
                    sel = (cols["row_base"] >= 0) & (cols[f"{name}_slot"] >= 0)
                    memos.append(cols["row_base"][sel] + cols[f"{name}_slot"][sel])
                    values.append(cols[name][sel])
                    counts.append(cols["sizes_ndim" if name == "sizes" else "ndim"][sel])
            width = max((v.shape[1] for v in values), default=0)
            memo = np.concatenate(memos) if memos else np.zeros(0, np.int64)
            order = np.argsort(memo, kind="stable")
            self._tuple_sources = (memo[order], np.concatenate([_width(v, width) for v in values])[order]
                                   if values else np.zeros((0, 0), np.int64),
                                   np.concatenate(counts)[order] if counts else np.zeros(0, np.int64))
        return self._tuple_sources

    def _strings_referred(self) -> None:
        """The skeleton refers to a few strings that records pushed (a file's name, first met
        in a record): each must be one, and its marker pushes and memoises it in the same place."""
        if not self.run_refs:
            return
        cols = self.runs.get(_STORAGE)
        used = cols["row_base"] >= 0 if cols is not None else None
        for name in ("fqn", "path", "key") if cols is not None else ():
            sel = used & (cols[f"{name}_kind"] == 0)
            memo = cols["row_base"][sel] + cols[f"{name}_memo"][sel]
            hit = np.isin(memo, np.array(sorted(self.run_refs), np.int64))
            for index, start, length in zip(memo[hit].tolist(), cols[f"{name}_start"][sel][hit].tolist(),
                                            cols[f"{name}_length"][sel][hit].tolist()):
                raw = self.body[start:start + length]
                push = (bytes((SHORT_BINUNICODE, length)) if length < 256 else
                        bytes((BINUNICODE,)) + struct.pack("<I", length))
                self.spliced[index] = push + raw + b"\x940"  # push, MEMOIZE, POP
        memo, values, counts = self.tuple_sources()
        for index in sorted(self.run_refs - set(self.spliced)):
            at = int(np.searchsorted(memo, index))
            if at < len(memo) and memo[at] == index:
                self.spliced[index] = _tuple_opcodes(values[at, :counts[at]].tolist()) + b"0"  # (memoised: POP)
        if set(self.spliced) != self.run_refs:
            raise _NotStock("a reference to a run's memo entry that is not a string or a tuple")

    def _spliced_in(self, base: int, total: int) -> list[int]:
        order = self.spliced_order
        return order[bisect.bisect_left(order, base):bisect.bisect_left(order, base + total)]

    def _markers(self, kind: int, chain: int, nonce: int) -> bytes:
        """What stands for a run in the skeleton: one marker, or one a record; no memo entries
        but the strings and tuples the skeleton refers to (`spliced`: pushed, memoised, popped
        after the marker of the record that pushed them), the others renumbered away."""
        cols = self.runs[kind]
        first, count = int(cols["chain_first"][chain]), int(cols["chain_count"][chain])
        tail = b"N" if kind == _STORAGE else b""
        base = self.chain_base[(kind, chain)]
        spliced = self._spliced_in(base, int(cols["chain_memo"][chain]))
        if self.whole[(kind, chain)]:
            ident = nonce + _CHAIN_BIT + chain
            return b"\x8a\x08" + ident.to_bytes(8, "little") + tail + b"".join(self.spliced[i] for i in spliced)
        head = 10 + len(tail)
        buf = np.empty((count, head), np.uint8)
        buf[:, 0], buf[:, 1] = LONG1, 8
        buf[:, 2:10] = (np.arange(first, first + count, dtype=np.uint64) + np.uint64(nonce)).view(np.uint8).reshape(count, 8)
        if tail:
            buf[:, 10] = NONE
        out = buf.tobytes()
        if not spliced:
            return out
        bases = cols["row_base"][first:first + count]
        pieces, done = [], 0
        for i in spliced:
            cut = int(np.searchsorted(bases, i, "right")) * head  # after its record's marker
            pieces += [out[done:cut], self.spliced[i]]
            done = cut
        return b"".join(pieces) + out[done:]

    def _check_refs(self, memo_values: dict[int, Any]) -> None:
        """The classes and field names the records were matched against are what the memo holds."""
        for refs in self.refs.values():
            for name, index in refs.items():
                value = memo_values.get(index)
                expected = _CLASSES.get(name)
                if expected is not None:
                    if value is not expected:
                        raise _NotStock(f"memo {index} is not {name!r}")
                elif type(value) is not str or value != name.decode():
                    raise _NotStock(f"memo {index} is not the field name {name!r}")


def _last_stored(owner: np.ndarray, offsets: np.ndarray, place: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each chunk, the chunk of the same tensor at the same offsets whose storage entry
    comes last in storage_data (`place`; -1: it has none), and its group's size."""
    first, group = box_groups(owner, offsets)
    latest = np.full(len(first), -1, np.int64)
    np.maximum.at(latest, group, place)
    winner = np.zeros(len(first), np.int64)
    best = place == latest[group]
    winner[group[best]] = np.flatnonzero(best)
    return winner[group], np.bincount(group)[group]


#: Fewer records (or bytes, in `objects`) are read on one thread: a second one costs ~0.1 ms.
HALVES_FROM = 50_000


def _two_cores() -> bool:
    """Whether this process may run on two cores or more (its CPU affinity, where the OS has one)."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return len(cores) >= 2


def _both(first, second) -> tuple[Any, Any]:
    """`first()` here and `second()` on a second thread at the same time: numpy lets go of the
    GIL in its loops, so two halves of a pass over the records take ~0.6 of the whole on two
    cores (the 633,700 storage records of the 64 x 10,000 checkpoint: 0.20-0.23 s -> 0.12-0.15 s)."""
    got: list[Any] = []

    def run() -> None:
        try:
            got.append((True, second()))
        except BaseException as exc:  # noqa: BLE001 - raised again below, in the caller's thread
            got.append((False, exc))

    thread = threading.Thread(target=run, name="hpckpt-stock-read", daemon=True)
    thread.start()
    try:
        mine = first()
    finally:
        thread.join()
    fine, theirs = got[0]
    if not fine:
        raise theirs
    return mine, theirs


def _both_if_two(first, second) -> tuple[Any, Any]:
    """`_both` where there are two cores, else one after the other."""
    return _both(first, second) if _two_cores() else (first(), second())


def _in_halves(read, starts: np.ndarray) -> dict[str, np.ndarray]:
    """`read(starts)`, in two halves at once where there are two cores. Every row is read on its
    own, so the halves joined are the whole; only a column of tuple items is as wide as the
    most items in its half, and is widened to the other's."""
    if len(starts) < HALVES_FROM or not _two_cores():
        return read(starts)
    half = len(starts) // 2
    first, second = _both(lambda: read(starts[:half]), lambda: read(starts[half:]))
    out = {}
    for name, a in first.items():
        b = second[name]
        if a.ndim == 2:
            width = max(a.shape[1], b.shape[1])
            a, b = _width(a, width), _width(b, width)
        out[name] = np.concatenate([a, b])
    return out


def _compact(columns: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Memo indexes, counts and kinds as int32 (a file's memo holds far fewer than 2**31 entries;
    half the memory of the columns kept for all records)."""
    narrow = ("memo", "_ref", "_slot", "_at", "_kind", "ndim")
    return {name: col.astype(np.int32) if col.dtype == np.int64 and col.ndim == 1 and name.endswith(narrow) else col
            for name, col in columns.items()}


def _tuple_opcodes(items: list[int]) -> bytes:
    """The opcodes that push `items` as a tuple (then MEMOIZE, as the stock pickler does)."""
    builder = PickleBuilder()
    builder.tuple_of(items, builder.integer)
    return bytes(builder.body) + (b"\x94" if items else b"")


def _opcode_starts(body: bytes, start: int, end: int) -> set[int]:
    """Where the opcodes of body[start:end] start (one record: a few dozen)."""
    out, p = set(), start
    while p < end:
        out.add(p)
        op = body[p]
        n = _TABLE[op]
        if n is None:
            raise _NotStock("a record with an unknown opcode")
        if n >= 0:
            p += 1 + n
        else:
            width, fmt = _LENGTH[op]
            p += 1 + width + struct.unpack_from(fmt, body, p + 1)[0]
    return out


class _Assembly:
    """The records put back where the skeleton's markers say, checked as the unpickler's index would be."""

    def __init__(self, reader: _StockReader, metadata: Metadata, memo_values: dict[int, Any], nonce: int):
        self.r, self.metadata, self.memo_values, self.nonce = reader, metadata, memo_values, nonce
        self.strings: list[Any] = [None]
        self.string_ids: dict[Any, int] = {None: 0}
        self._pushed_cache: tuple[np.ndarray, _Places] | None = None
        self._skeleton_cache: tuple[_Places, np.ndarray] | None = None
        self._tuples_cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def string_id(self, value: Any) -> int:
        found = self.string_ids.get(value)
        if found is None:
            found = self.string_ids[value] = len(self.strings)
            self.strings.append(value)
        return found

    def _rows(self, kind: int, items: list) -> tuple[np.ndarray, list[tuple[int, Any]]]:
        """The record rows the markers among `items` stand for, in order, and the other items
        with their places (counted in chunks or entries, markers expanded)."""
        cols = self.r.runs.get(kind)
        parts, others, placed = [], [], 0
        for x in items:
            if type(x) is int:
                o = x - self.nonce
                if cols is None or not 0 <= o < 2 * _CHAIN_BIT:
                    raise _NotStock("an int where a record was")
                if o >= _CHAIN_BIT:
                    chain = o - _CHAIN_BIT
                    if chain >= len(cols["chain_first"]):
                        raise _NotStock("a marker of no run")
                    first, count = int(cols["chain_first"][chain]), int(cols["chain_count"][chain])
                    parts.append(np.arange(first, first + count))
                    placed += count
                else:
                    parts.append(np.array([o]))
                    placed += 1
            else:
                others.append((placed, x))
                placed += 1
        rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return rows, others

    def _resolve_tuples(self) -> None:
        """Tuples a record shares (a memo reference) replaced by their values: another record's
        (pushed earlier) or one the skeleton read back; each must be a tuple of ints."""
        for kind, names in _TUPLE_FIELDS.items():
            cols = self.r.runs.get(kind)
            for name in names if cols is not None else ():
                ref = cols[f"{name}_ref"]
                rows = np.flatnonzero((cols["row_base"] >= 0) & (ref >= 0))
                if not len(rows):
                    continue
                memo, values, counts = self.r.tuple_sources()
                refs = ref[rows]
                if (refs >= cols["row_base"][rows] + cols[f"{name}_at"][rows]).any():
                    raise _NotStock("a reference to a memo entry not made yet")
                at, hit = _find(memo, refs)
                sk_memo, sk_values, sk_counts = self._skeleton_tuples()
                width = max(values.shape[1], cols[name].shape[1], sk_values.shape[1])
                got = np.zeros((len(refs), width), np.int64)
                got[hit, :values.shape[1]] = values[at[hit]]
                n = np.zeros(len(refs), np.int64)
                n[hit] = counts[at[hit]]
                missed = np.flatnonzero(~hit)
                if len(missed):  # the skeleton's tuples (read back at its end)
                    k, found = _find(sk_memo, refs[missed])
                    if not found.all():
                        raise _NotStock("a reference to something not a tuple of ints")
                    got[missed, :sk_values.shape[1]] = sk_values[k]
                    n[missed] = sk_counts[k]
                cols[name] = _width(cols[name], width).copy()
                cols[name][rows] = got
                cols["sizes_ndim" if name == "sizes" else "ndim"][rows] = n
        cc = self.r.runs.get(_CHUNK)
        if cc is not None:
            used = cc["row_base"] >= 0
            if not np.array_equal(cc["ndim"][used], cc["sizes_ndim"][used]):
                raise _NotStock("a chunk whose offsets and sizes differ in length")

    def columns(self) -> ColumnsMetadata:
        self._resolve_tuples()
        md = self.metadata
        state = md.__dict__.get("state_dict_metadata")
        storage = md.__dict__.get("storage_data")
        if type(state) is not dict or type(storage) is not dict:
            raise _NotStock("state_dict_metadata or storage_data not a dict")
        keys = list(storage)
        key_rows, real_keys = self._rows(_STORAGE, keys)
        if any(storage[k] is not None for k in keys if type(k) is int):
            raise _NotStock("a record's value is not its marker's")
        real = {k: storage[k] for _at, k in real_keys}
        self.real_at = {k: at for at, k in real_keys}  # (its place in storage_data's order)
        self.row_places = np.delete(np.arange(len(key_rows) + len(real_keys)), [at for at, _k in real_keys])
        probe = copy.copy(md)
        probe.__dict__["storage_data"] = real
        check_hp_metadata(probe, len(self.r.data), self.r.where)
        tensors, values, chunk_rows, chunk_others = [], [], [], []
        for fqn, item in state.items():
            if type(item) is TensorStorageMetadata:
                rows, others = self._rows(_CHUNK, item.chunks)
                tensors.append((fqn, item))
                chunk_rows.append(rows)
                chunk_others.append(others)
            elif type(item) is BytesStorageMetadata:
                values.append(fqn)
            else:
                raise _NotStock("an entry of another class")
        for kind, rows in ((_CHUNK, chunk_rows), (_STORAGE, [key_rows])):
            cols = self.r.runs.get(kind)
            flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
            entered = np.flatnonzero(cols["row_base"] >= 0) if cols is not None else flat[:0]
            if not np.array_equal(flat, entered):
                raise _NotStock("markers missing, repeated or out of order")
        return self._assemble(tensors, values, chunk_rows, chunk_others, key_rows, real)

    def _assemble(self, tensors, values, chunk_rows, chunk_others, key_rows, real) -> ColumnsMetadata:
        ndims, shapes = [], []
        for _fqn, item in tensors:
            size = item.size
            if not isinstance(size, (tuple, list)) or len(size) > MAX_DIMS:
                raise _NotStock("a shape that is not a short sequence")
            ndims.append(len(size))
            shapes.append(size)
        ndim_of = np.array(ndims, np.int64)
        width = max(ndims, default=0)  # columns used of the records' MAX_DIMS
        tensor_of = np.full(len(tensors), -1, np.int64)
        for t, (fqn, _item) in enumerate(tensors):
            tensor_of[t] = self.string_id(fqn)
        by_string = np.full(len(self.strings), -1, np.int64)
        by_string[tensor_of] = np.arange(len(tensors))
        if self.r.runs.get(_STORAGE) is not None:  # the string table complete first: `string_id` is for one thread
            self._pushed(self.r.runs[_STORAGE])
            self._skeleton_strings()
        # storage_data's columns (numpy) on a second core while this one spells dtypes and puts
        # the chunks' boxes in place
        (dtypes, counts, firsts, owner, offsets, sizes), storage = _both_if_two(
            lambda: self._chunk_arrays(tensors, chunk_rows, chunk_others, ndims, ndim_of, width),
            lambda: self._storage_columns(key_rows, by_string, ndim_of, width))
        total = len(offsets)
        s_t, s_i, s_off, s_file, s_key = storage
        extra_files: list[int] = []
        more: list[tuple] = []
        fqn_ids = {fqn: t for t, (fqn, _item) in enumerate(tensors)}
        for key, info in real.items():
            t = fqn_ids.get(key.fqn)
            if t is None:
                extra_files.append(self.string_id(info.relative_path))
                continue
            index, offs = key.index, key.offset
            if type(index) is not int or type(offs) is not tuple or len(offs) != ndims[t] or \
                    any(type(x) is not int for x in offs):
                raise _NotStock("a chunk's storage key of another form")
            more.append((t, index, offs + (0,) * (width - len(offs)), self.string_id(info.relative_path),
                         self.string_id(info.tensor_key), self.real_at[key]))
        s_place = self.row_places
        if more:
            t_, i_, o_, f_, k_, at_ = zip(*more)
            s_t, s_i, s_place = np.append(s_t, t_), np.append(s_i, i_), np.append(s_place, at_)
            real_rows = np.arange(len(s_t) - len(more), len(s_t))
            s_off = np.concatenate([s_off, np.array(o_, np.int64).reshape(len(o_), width)])
            s_file, s_key = np.append(s_file, f_), np.append(s_key, k_)
        else:
            real_rows = np.zeros(0, np.int64)
        if len(s_t) > total or ((s_i < 0) | (s_i >= counts[s_t])).any():
            raise _NotStock("storage entries that are not one per chunk")
        g = firsts[s_t] + s_i
        if total and len(g) and np.bincount(g, minlength=total).max() != 1:
            raise _NotStock("two storage entries for one chunk")
        files, keys = np.zeros(total, np.int64), np.zeros(total, np.int64)
        files[g], keys[g] = s_file, s_key
        stored = offsets.copy()
        stored[g] = s_off
        if not np.array_equal(stored, offsets):
            raise _NotStock("a storage key's offsets are not its chunk's")
        if last_of_equal(owner, offsets) is not None:
            # chunks of a tensor at equal offsets (every replica stored) share one storage_data
            # key: the dict keeps the value stored last for them all (the records' own order; an
            # entry the skeleton's dict holds may already be two, so such a group is refused)
            place = np.full(total, -1, np.int64)
            place[g] = s_place
            winner, size = _last_stored(owner, offsets, place)
            is_real = np.zeros(total, bool)
            is_real[g[real_rows]] = True
            if (place[winner] < 0).any() or (is_real & (size > 1)).any():
                raise _NotStock("a chunk without its storage entry")
            files, keys = files[winner], keys[winner]
        elif len(g) != total:
            raise _NotStock("a chunk without its storage entry")
        out = []
        for t, (fqn, _item) in enumerate(tensors):
            a, b, d = int(firsts[t]), int(firsts[t] + counts[t]), ndims[t]
            out.append(TensorRecords(fqn, dtypes[t], shapes[t], np.ascontiguousarray(offsets[a:b, :d]),
                                     np.ascontiguousarray(sizes[a:b, :d]), files[a:b], keys[a:b]))
        value_storage = []
        for fqn in values:
            info = real.get(MetadataIndex(fqn))
            if info is not None:
                value_storage.append(ValueRecord(fqn, info.relative_path, getattr(info, "offset", None),
                                                 getattr(info, "length", None)))
        strings = np.array(self.strings + [None], dtype=object)[:-1]
        file_refs = _distinct(np.concatenate([files, np.array(extra_files, np.int64)]))
        md = self.metadata
        return ColumnsMetadata(out, values, value_storage, strings, md.planner_data,
                               md.__dict__.get("version", "1.0"), file_refs)

    def _chunk_arrays(self, tensors, chunk_rows, chunk_others, ndims, ndim_of, width) -> tuple:
        """(dtype spellings, chunks a tensor, each tensor's first chunk, each chunk's tensor,
        offsets, sizes): the chunk records put where the markers say, with the chunks the
        unpickler built itself."""
        where = self.r.where
        dtypes = [dtype_spelling(item.properties, f"{where}: tensor {fqn}") for fqn, item in tensors]
        counts = np.array([len(r) + len(o) for r, o in zip(chunk_rows, chunk_others)], np.int64)
        total = int(counts.sum())
        firsts = np.cumsum(counts) - counts
        owner = np.repeat(np.arange(len(tensors)), counts)
        cc = self.r.runs.get(_CHUNK)
        offsets = np.zeros((total, width), np.int64)
        sizes = np.zeros((total, width), np.int64)
        if cc is not None and total:
            flat = np.concatenate(chunk_rows)
            place = np.ones(total, bool)
            for t, others in enumerate(chunk_others):
                for at, chunk in others:
                    o, z = _real_chunk(chunk, ndims[t])
                    i = int(firsts[t]) + at
                    offsets[i, :ndims[t]], sizes[i, :ndims[t]] = o, z
                    place[i] = False
            dest = np.flatnonzero(place)
            if not np.array_equal(cc["ndim"][flat], ndim_of[owner[dest]]):
                raise _NotStock("a chunk of another number of dimensions")
            offsets[dest], sizes[dest] = _width(cc["offsets"][flat], width), _width(cc["sizes"][flat], width)
        elif total:
            raise _NotStock("chunks and no run of them")
        if (offsets < 0).any() or (sizes < 0).any():
            raise _NotStock("a negative offset or size")
        return dtypes, counts, firsts, owner, offsets, sizes

    def _storage_columns(self, key_rows: np.ndarray, by_string: np.ndarray, ndim_of: np.ndarray, width: int):
        cols = self.r.runs.get(_STORAGE)
        if cols is None or not len(key_rows):
            empty = np.zeros(0, np.int64)
            return empty, empty, np.zeros((0, width), np.int64), empty, empty
        fqn = self._string_column(cols, key_rows, "fqn")
        known = fqn < len(by_string)
        tensor = np.where(known, by_string[np.where(known, fqn, 0)], -1)
        if (tensor < 0).any():
            raise _NotStock("a storage entry of no tensor")
        if not np.array_equal(cols["ndim"][key_rows], ndim_of[tensor]):
            raise _NotStock("a storage key of another number of dimensions")
        return (tensor, cols["index"][key_rows], _width(cols["offsets"][key_rows], width),
                self._string_column(cols, key_rows, "path"),
                self._string_column(cols, key_rows, "key"))

    def _string_column(self, cols: dict, rows: np.ndarray, name: str) -> np.ndarray:
        """String ids of field `name` of `rows`: pushed ones decoded once per distinct bytes,
        references resolved to a string an entered record pushed earlier, or to the skeleton's memo."""
        kind = cols[f"{name}_kind"][rows]
        memo = cols[f"{name}_memo"][rows]
        base = cols["row_base"][rows]
        out = np.zeros(len(rows), np.int64)  # 0: None
        pushed_ids, pushed_memo = self._pushed(cols)
        is_pushed = kind == 0
        if is_pushed.any():
            out[is_pushed] = pushed_ids[pushed_memo.find(base[is_pushed] + memo[is_pushed])[0]]
        is_ref = kind == 1
        if is_ref.any():
            refs = memo[is_ref]
            if (refs >= base[is_ref] + cols[f"{name}_at"][rows][is_ref]).any():
                raise _NotStock("a reference to a memo entry not made yet")
            resolved = np.full(len(refs), -1, np.int64)
            at, hit = pushed_memo.find(refs)
            resolved[hit] = pushed_ids[at[hit]]
            missed = resolved < 0
            if missed.any():  # the skeleton's strings (read back at its end)
                indexes, ids = self._skeleton_strings()
                at, found = indexes.find(refs[missed])
                if not found.all() or (ids[at] < 0).any():
                    raise _NotStock("a reference to something not a str")
                resolved[missed] = ids[at]
            out[is_ref] = resolved
        return out

    def _skeleton_tuples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(memo index, values, count) of the tuples of ints the skeleton's end read back."""
        if self._tuples_cache is None:
            found = [(i, v) for i, v in sorted(self.memo_values.items()) if type(v) is tuple and len(v) <= MAX_DIMS
                     and all(type(x) is int for x in v) and not self.r.in_run_memo(i)]
            width = max((len(v) for _i, v in found), default=0)
            values = np.zeros((len(found), width), np.int64)
            for row, (_i, v) in enumerate(found):
                values[row, :len(v)] = v
            self._tuples_cache = (np.array([i for i, _v in found], np.int64), values,
                                  np.array([len(v) for _i, v in found], np.int64))
        return self._tuples_cache

    def _skeleton_strings(self) -> tuple[_Places, np.ndarray]:
        """(memo indexes, string id or -1 where not a str) of what the skeleton's end read back."""
        if self._skeleton_cache is None:
            indexes = sorted(self.memo_values)
            ids = [self.string_id(v) if type(v) is str and not self.r.in_run_memo(i) else -1
                   for i, v in ((i, self.memo_values[i]) for i in indexes)]
            self._skeleton_cache = (_Places(np.array(indexes, np.int64)), np.array(ids, np.int64))
        return self._skeleton_cache

    def _pushed(self, cols: dict) -> tuple[np.ndarray, _Places]:
        """(string id, memo indexes) of every string the entered storage records pushed, by memo index."""
        if self._pushed_cache is not None:
            return self._pushed_cache
        used = cols["row_base"] >= 0
        ids, memos = [], []
        body = self.r.body
        for name in ("fqn", "path", "key"):
            sel = used & (cols[f"{name}_kind"] == 0)
            starts, lengths = cols[f"{name}_start"][sel], cols[f"{name}_length"][sel]
            memos.append(cols["row_base"][sel] + cols[f"{name}_memo"][sel])
            raw = list(map(body.__getitem__, map(slice, starts.tolist(), (starts + lengths).tolist())))
            decoded = {b: self.string_id(b.decode("utf-8", "surrogatepass")) for b in dict.fromkeys(raw)}
            ids.append(np.fromiter(map(decoded.__getitem__, raw), np.int64, len(raw)))
        memo = np.concatenate(memos)
        order = np.argsort(memo, kind="stable")
        self._pushed_cache = (np.concatenate(ids)[order], _Places(memo[order]))
        return self._pushed_cache


def _dense(values: np.ndarray, n: int) -> bool:
    """Whether a table indexed by `values` (non-negative ints) is small enough to build: memo
    indexes and string ids are, unless a hostile file names one far past what it holds."""
    return not len(values) or int(values.max()) < 8 * n + (1 << 22)


def _distinct(values: np.ndarray) -> np.ndarray:
    """`np.unique` of non-negative ints, by marking them in a table where that is small: linear
    where `np.unique` sorts (633,700 references: ~2 ms against ~15)."""
    if not len(values) or (values < 0).any() or not _dense(values, len(values)):
        return np.unique(values).astype(np.int64)
    seen = np.zeros(int(values.max()) + 1, bool)
    seen[values] = True
    return np.flatnonzero(seen)


class _Places:
    """Where values are among sorted, distinct, non-negative `keys` (memo indexes): a table from
    key to place, built once on the first large question and kept for the next (a lookup a
    query: 633,700 of them in ~3 ms, where a binary search takes 15-45), else a binary search."""

    TABLE_FROM = 4096  # queries; fewer are searched (the table costs a pass over the memo's range)

    def __init__(self, keys: np.ndarray):
        self.keys = keys
        self._table: np.ndarray | None = None

    def find(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(place of each query, whether it is there at all); where it is not, its place is 0."""
        keys = self.keys
        if not len(keys) or not len(queries):
            return np.zeros(len(queries), np.int64), np.zeros(len(queries), bool)
        if self._table is None and len(queries) >= self.TABLE_FROM and keys[0] >= 0 and \
                _dense(keys, len(keys) + len(queries)) and (keys[1:] > keys[:-1]).all():
            self._table = np.full(int(keys[-1]) + 1, -1, np.int32)
            self._table[keys] = np.arange(len(keys), dtype=np.int32)
        if self._table is not None:
            table = self._table
            inside = (queries >= 0) & (queries < len(table))
            at = np.where(inside, table[np.where(inside, queries, 0)], -1)
            hit = at >= 0
            return np.where(hit, at, 0), hit
        at = np.searchsorted(keys, queries).clip(0, len(keys) - 1)
        return at, keys[at] == queries


def _find(keys: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_Places(keys).find(queries)`, for a question asked once."""
    return _Places(keys).find(queries)


def _width(values: np.ndarray, width: int) -> np.ndarray:
    """`values` with `width` columns (the records' own: as many as the most any of them had)."""
    if values.shape[1] >= width:
        return values[:, :width]
    return np.pad(values, ((0, 0), (0, width - values.shape[1])))


def _real_chunk(chunk: Any, ndim: int) -> tuple[tuple, tuple]:
    """A chunk the unpickler built itself (one the records did not take): plain tuples of ints."""
    if type(chunk) is not ChunkStorageMetadata:
        raise _NotStock("a chunk of another class")
    state = chunk.__dict__
    out = []
    for name in ("offsets", "sizes"):
        box = state.get(name)
        if type(box) is not tuple or len(box) != ndim or any(type(x) is not int for x in box):
            raise _NotStock("a chunk whose box is not ints")
        out.append(box)
    return out[0], out[1]
