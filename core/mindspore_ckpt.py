"""MindSpore `.ckpt` files: an index built by walking the protobuf fields, and a streaming writer.

Facts (MindSpore 2.10, `train/serialization.py` and `checkpoint.proto`):

* The file is a protobuf `Checkpoint { repeated Value value = 1 }`, written as one serialized
  one-Value `Checkpoint` after another. `Value { required string tag = 1; oneof { TensorProto
  tensor = 2; MapTensorProto maptensor = 3 } }`, `TensorProto { repeated int64 dims = 1;
  required string tensor_type = 2; required bytes tensor_content = 3 }`. Content is raw
  little-endian row-major data, unaligned.
* Split rule: a tensor is written as consecutive Values with the same tag and the full dims.
  Synchronous saves (Parameters/Tensors, the default) cut the raw bytes every
  `1024 * SLICE_SIZE` bytes (512 MiB), so pieces need not hold whole rows. Asynchronous saves
  (numpy data) use `np.array_split(array, ceil(nbytes / 512 MiB))` along axis 0: whole rows, and
  possibly empty pieces. The loader concatenates the run's contents, so both are read here as
  flat byte intervals of the tensor, each cut into N-D boxes.
* `dims == [0]` with one element of content loads as a 0-d tensor (the loader's rule); 0-d
  tensors are written with no dims. Zero-element tensors are not written at all.
* `str` values: `tensor_type "str"`, `dims [0]`, content = numpy `<U` bytes (UTF-32-LE, trailing
  NULs dropped on load). `Int4` (qint4x2, two nibbles per byte) and maptensors are not read.
* CRC (`crc_check=True`): the file ends with `b"crc_num"` and the CRC-32 (`binascii.crc32`, start
  0) of every byte before that marker, as 10 bytes big-endian. The loader strips such a trailer
  whenever `pb_content[-17:-10] == b"crc_num"`, checked or not.
* Encryption (`enc_key`): the whole stream is replaced by blocks that each start with a 4-byte
  little-endian magic, 0x7F3A5ED8 (AES-GCM), 0x7F3A5ED9 (AES-CBC), 0x7F3A5EDA (SM4-CBC). A plain
  `.ckpt` always starts with 0x0A (field 1, length-delimited), so the two never collide.

No torch or mindspore import: this module is on the CLI's start-up path.
"""

from __future__ import annotations

import math
import os
import secrets
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

from hpckpt.core.box import Box, full_box
from hpckpt.core.dtypes import DType, all_dtypes
from hpckpt.core.errors import CorruptDataError, MissingFileError, UnknownFormatError
from hpckpt.core.layout import decompose_flat_interval
from hpckpt.core.staging import fsync_files

#: Bytes per Value when a tensor is split (MindSpore: `1024 * SLICE_SIZE`, SLICE_SIZE in KiB).
SPLIT_BYTES = 512 * 1024 * 1024
CRC_MARK = b"crc_num"
CRC_TRAILER_BYTES = len(CRC_MARK) + 10
STRING_TYPE = "str"
ENCRYPTION_MAGICS = {0x7F3A5ED8: "AES-GCM", 0x7F3A5ED9: "AES-CBC", 0x7F3A5EDA: "SM4-CBC"}
_MAGIC_FAMILY = 0x7F3A5ED8  # the low 3 bits name the mode; the rest is MindSpore's cipher magic

MAX_TAG_BYTES = 1 << 20
MAX_TYPE_BYTES = 64
MAX_DIMS = 64
CRC_BLOCK_BYTES = 8 * 1024 * 1024

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_FIXED_SIZE = {_I64: 8, _I32: 4}

# The tensor types MindSpore's loader accepts (`tensor_to_ms_type`), other than str and Int4.
_BY_SPELLING: dict[str, DType] = {
    d.mindspore: d for d in all_dtypes()
    if d.mindspore and not d.name.startswith("complex")
}
_UNSUPPORTED_TYPES = {"Int4": "Int4 (qint4x2, two 4-bit values per byte) is not read by hpckpt"}


# --------------------------------------------------------------------------------------------
# What a scan finds


@dataclass(frozen=True, slots=True)
class Piece:
    """One Value of a tensor: where the Value starts and where its tensor_content lies."""

    value_offset: int
    content_offset: int
    content_nbytes: int


@dataclass(slots=True)
class CkptTensor:
    """A tensor: its run of Values (one unless MindSpore split it), dtype and full shape."""

    name: str
    tensor_type: str
    dtype: DType
    shape: tuple[int, ...]
    pieces: list[Piece]

    def regions(self) -> list[tuple[Box, int, int]]:
        """(box in global coordinates, absolute byte offset, byte count), each C-contiguous.

        A piece holding a flat interval that is not whole rows becomes several boxes (partial
        row, whole rows, partial row), so every split MindSpore writes can be read.
        """
        itemsize = self.dtype.itemsize
        out: list[tuple[Box, int, int]] = []
        element = 0
        for piece in self.pieces:
            count = piece.content_nbytes // itemsize
            offset = piece.content_offset
            for box in decompose_flat_interval(self.shape, element, element + count):
                nbytes = box.volume * itemsize
                out.append((box, offset, nbytes))
                offset += nbytes
            element += count
        if not out:  # a zero-element tensor: one empty chunk, so it is not "uncovered"
            out.append((full_box(self.shape), self.pieces[0].content_offset, 0))
        return out


@dataclass(frozen=True, slots=True)
class CkptString:
    """A `str` value: UTF-32-LE bytes at `offset`."""

    name: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class CkptUnsupported:
    """An entry hpckpt does not read (maptensor, Int4, unknown type), kept so callers can refuse."""

    name: str
    value_offset: int
    reason: str


@dataclass
class CkptScan:
    """Everything a walk of a `.ckpt` learns; nothing of tensor_content was read."""

    path: Path
    file_size: int
    proto_end: int  # the protobuf stream ends here (before the CRC trailer, when there is one)
    stored_crc: int | None
    tensors: dict[str, CkptTensor] = field(default_factory=dict)
    strings: dict[str, CkptString] = field(default_factory=dict)
    unsupported: dict[str, CkptUnsupported] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def has_crc(self) -> bool:
        return self.stored_crc is not None


@dataclass(slots=True)
class _RawValue:
    """One Value as found on disk, before runs of the same tag are joined."""

    offset: int
    tag: str | None = None
    kind: str | None = None  # "tensor" or "maptensor"
    dims: list[int] = field(default_factory=list)
    tensor_type: str | None = None
    content_offset: int = -1
    content_nbytes: int = 0


# --------------------------------------------------------------------------------------------
# Walking the wire format


class _Cursor:
    """Reads protobuf field headers from a buffered file and seeks over payloads.

    Every read is bounded by the end of the enclosing message, so a length that runs past its
    message or past the file is reported with the offset where it was found.
    """

    def __init__(self, f: BinaryIO, path: Path):
        self.f = f
        self.path = path
        self.pos = 0

    def error(self, offset: int, message: str) -> CorruptDataError:
        return CorruptDataError(f"{self.path}: offset {offset}: {message}")

    def varint(self, end: int, what: str) -> int:
        start, result, shift = self.pos, 0, 0
        while True:
            if self.pos >= end:
                raise self.error(start, f"truncated {what} (varint runs past byte {end})")
            byte = self.f.read(1)
            if not byte:
                raise self.error(start, f"truncated {what}: the file ends at {self.pos}")
            self.pos += 1
            result |= (byte[0] & 0x7F) << shift
            if byte[0] < 0x80:
                return result
            shift += 7
            if shift >= 70:
                raise self.error(start, f"malformed {what}: varint longer than 10 bytes")

    def key(self, end: int, what: str) -> tuple[int, int]:
        start = self.pos
        key = self.varint(end, f"field key in {what}")
        number, wire = key >> 3, key & 7
        if number == 0 or wire not in (_VARINT, _I64, _LEN, _I32):
            raise self.error(start, f"malformed {what}: field {number} with wire type {wire}")
        return number, wire

    def length(self, end: int, what: str) -> int:
        start = self.pos
        n = self.varint(end, f"length of {what}")
        if self.pos + n > end:
            raise self.error(
                start, f"{what} declares {n} bytes but only {end - self.pos} remain "
                f"(the enclosing message or file ends at {end}): truncated?"
            )
        return n

    def read(self, n: int, what: str) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise self.error(self.pos, f"truncated {what}: the file ends at {self.pos + len(data)}")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n

    def skip_field(self, wire: int, end: int, what: str) -> None:
        """Skip an unknown field, as protobuf parsers do."""
        if wire == _VARINT:
            self.varint(end, what)
        elif wire == _LEN:
            self.skip(self.length(end, what))
        else:
            if self.pos + _FIXED_SIZE[wire] > end:
                raise self.error(self.pos, f"truncated {what}")
            self.skip(_FIXED_SIZE[wire])


def _text(cur: _Cursor, n: int, limit: int, what: str, offset: int) -> str:
    if n > limit:
        raise cur.error(offset, f"{what} of {n} bytes is implausibly long (limit {limit})")
    try:
        return cur.read(n, what).decode("utf-8")
    except UnicodeDecodeError:
        raise cur.error(offset, f"{what} is not valid UTF-8") from None


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _walk(cur: _Cursor, end: int) -> list[_RawValue]:
    """Every top-level Value; anything else at the top level means this is no checkpoint."""
    values = []
    while cur.pos < end:
        start = cur.pos
        number, wire = cur.key(end, "Checkpoint")
        if (number, wire) != (1, _LEN):
            raise cur.error(start, f"expected a Checkpoint Value (field 1), found field {number} "
                                   f"with wire type {wire}: not a MindSpore .ckpt, or damaged")
        n = cur.length(end, "Value")
        values.append(_value(cur, start, cur.pos + n))
    return values


def _value(cur: _Cursor, start: int, end: int) -> _RawValue:
    raw = _RawValue(start)
    while cur.pos < end:
        at = cur.pos
        number, wire = cur.key(end, "Value")
        if wire != _LEN or number not in (1, 2, 3):
            cur.skip_field(wire, end, "Value field")
            continue
        n = cur.length(end, "Value field")
        if number == 1:
            raw.tag = _text(cur, n, MAX_TAG_BYTES, "tag", at)
        elif number == 2:
            raw.kind = "tensor"
            _tensor(cur, raw, cur.pos + n)
        else:
            raw.kind = "maptensor"
            cur.skip(n)
    if raw.tag is None:
        raise cur.error(start, "Value without a tag")
    if raw.kind is None:
        raise cur.error(start, f"Value {raw.tag!r} holds neither a tensor nor a maptensor")
    if raw.kind == "tensor" and (raw.tensor_type is None or raw.content_offset < 0):
        raise cur.error(start, f"tensor {raw.tag!r} lacks its required tensor_type or tensor_content")
    return raw


def _tensor(cur: _Cursor, raw: _RawValue, end: int) -> None:
    """Fields of a TensorProto; repeated occurrences merge as protobuf says (dims append)."""
    while cur.pos < end:
        at = cur.pos
        number, wire = cur.key(end, "TensorProto")
        if number == 1 and wire == _VARINT:
            raw.dims.append(_int64(cur.varint(end, "dims")))
        elif number == 1 and wire == _LEN:  # packed dims
            stop = cur.pos + cur.length(end, "packed dims")
            while cur.pos < stop:
                raw.dims.append(_int64(cur.varint(stop, "dims")))
        elif number == 2 and wire == _LEN:
            raw.tensor_type = _text(cur, cur.length(end, "tensor_type"), MAX_TYPE_BYTES, "tensor_type", at)
        elif number == 3 and wire == _LEN:
            n = cur.length(end, "tensor_content")
            raw.content_offset, raw.content_nbytes = cur.pos, n
            cur.skip(n)
        else:
            cur.skip_field(wire, end, "TensorProto field")
        if len(raw.dims) > MAX_DIMS:
            raise cur.error(at, f"more than {MAX_DIMS} dims")


# --------------------------------------------------------------------------------------------
# Joining Values into tensors


def _runs(values: list[_RawValue]) -> list[list[_RawValue]]:
    """Consecutive Values with the same tag form one entry, as MindSpore's loader joins them."""
    runs: list[list[_RawValue]] = []
    for value in values:
        if runs and runs[-1][0].tag == value.tag:
            runs[-1].append(value)
        else:
            runs.append([value])
    return runs


def _check_run(path: Path, run: list[_RawValue]) -> None:
    first = run[0]
    for other in run[1:]:
        if other.kind != first.kind or other.dims != first.dims or other.tensor_type != first.tensor_type:
            raise CorruptDataError(
                f"{path}: offset {other.offset}: Value continues {first.tag!r} (split tensor) but its "
                f"type or dims ({other.tensor_type} {other.dims}) differ from the first piece's "
                f"({first.tensor_type} {first.dims}) at offset {first.offset}"
            )


def _shape(scan: CkptScan, first: _RawValue, dtype: DType, total: int) -> tuple[int, ...]:
    """The tensor's shape; MindSpore loads `dims [0]` with one element of content as 0-d."""
    if any(d < 0 for d in first.dims):
        raise CorruptDataError(f"{scan.path}: offset {first.offset}: tensor {first.tag!r} has negative dims {first.dims}")
    if first.dims == [0] and total == dtype.itemsize:
        scan.notes.append(f"{first.tag}: dims [0] with one element, read as 0-d as MindSpore does")
        return ()
    return tuple(first.dims)


def _add_tensor(scan: CkptScan, run: list[_RawValue], dtype: DType) -> None:
    path, first = scan.path, run[0]
    total = sum(v.content_nbytes for v in run)
    shape = _shape(scan, first, dtype, total)
    needed = math.prod(shape) * dtype.itemsize
    if total != needed:
        pieces = f" in {len(run)} pieces" if len(run) > 1 else ""
        raise CorruptDataError(
            f"{path}: offset {first.offset}: tensor {first.tag!r} holds {total} bytes{pieces}, "
            f"but {first.tensor_type}{list(shape)} needs {needed}"
        )
    for value in run:
        if value.content_nbytes % dtype.itemsize:
            raise CorruptDataError(
                f"{path}: offset {value.offset}: piece of {first.tag!r} holds {value.content_nbytes} bytes, "
                f"not a whole number of {dtype.itemsize}-byte elements"
            )
    pieces = [Piece(v.offset, v.content_offset, v.content_nbytes) for v in run]
    scan.tensors[first.tag] = CkptTensor(first.tag, first.tensor_type, dtype, shape, pieces)


def _add_string(scan: CkptScan, run: list[_RawValue]) -> None:
    first = run[0]
    if len(run) > 1:
        raise CorruptDataError(f"{scan.path}: offset {first.offset}: str value {first.tag!r} is split "
                               f"over {len(run)} Values, which MindSpore never writes")
    if first.content_nbytes % 4:
        raise CorruptDataError(f"{scan.path}: offset {first.offset}: str value {first.tag!r} holds "
                               f"{first.content_nbytes} bytes, not whole UTF-32 characters")
    scan.strings[first.tag] = CkptString(first.tag, first.content_offset, first.content_nbytes)


def _add_run(scan: CkptScan, run: list[_RawValue]) -> None:
    first = run[0]
    name = first.tag
    for table in (scan.tensors, scan.strings, scan.unsupported):
        if table.pop(name, None) is not None:
            scan.notes.append(f"{name}: stored twice; the later copy wins, as in MindSpore's loader")
    if first.kind == "maptensor":
        scan.unsupported[name] = CkptUnsupported(name, first.offset, "maptensor (MapParameter) entries are not read by hpckpt")
        return
    _check_run(scan.path, run)
    if first.tensor_type == STRING_TYPE:
        _add_string(scan, run)
    elif first.tensor_type in _BY_SPELLING:
        _add_tensor(scan, run, _BY_SPELLING[first.tensor_type])
    else:
        reason = _UNSUPPORTED_TYPES.get(first.tensor_type, f"unknown tensor_type {first.tensor_type!r}")
        scan.unsupported[name] = CkptUnsupported(name, first.offset, reason)


# --------------------------------------------------------------------------------------------
# Public reading API


def encryption_mode(head: bytes) -> str | None:
    """The cipher of an encrypted MindSpore file from its first 4 bytes, else None."""
    if len(head) < 4:
        return None
    magic = int.from_bytes(head[:4], "little")
    if magic & ~7 != _MAGIC_FAMILY & ~7:
        return None
    return ENCRYPTION_MAGICS.get(magic, "unknown mode")


def _refuse_encrypted(path: Path, head: bytes) -> None:
    mode = encryption_mode(head)
    if mode is not None:
        raise UnknownFormatError(
            f"{path}: encrypted MindSpore checkpoint ({mode}); hpckpt does not decrypt",
            hint="decrypt with mindspore.load_checkpoint(path, dec_key=..., dec_mode=...) and save it "
                 "again without enc_key",
        )


def _trailer(f: BinaryIO, size: int) -> tuple[int, int | None]:
    """(end of the protobuf stream, stored CRC or None); MindSpore's rule: `[-17:-10] == b"crc_num"`."""
    if size < CRC_TRAILER_BYTES:
        return size, None
    f.seek(size - CRC_TRAILER_BYTES)
    tail = f.read(CRC_TRAILER_BYTES)
    if len(tail) != CRC_TRAILER_BYTES or not tail.startswith(CRC_MARK):
        return size, None
    return size - CRC_TRAILER_BYTES, int.from_bytes(tail[len(CRC_MARK):], "big")


def _open(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise MissingFileError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise CorruptDataError(f"{path}: is a directory, not a MindSpore .ckpt file") from None
    except OSError as exc:
        raise MissingFileError(f"{path}: cannot be read ({exc.strerror})") from None


def scan(path: Path | str) -> CkptScan:
    """Walk a `.ckpt`'s fields (headers only; tensor_content is skipped by seeking).

    Raises:
        MissingFileError: the file does not exist or cannot be read.
        UnknownFormatError: the file is encrypted.
        CorruptDataError: truncated or malformed, with the offset where it goes wrong.
    """
    path = Path(path)
    with _open(path) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            _refuse_encrypted(path, f.read(4))
            proto_end, crc = _trailer(f, size)
            f.seek(0)
            values = _walk(_Cursor(f, path), proto_end)
        except OSError as exc:  # an I/O error mid-walk (none of hpckpt's own errors is an OSError here)
            raise MissingFileError(f"{path}: cannot be read ({exc.strerror})") from None
    result = CkptScan(path, size, proto_end, crc)
    for run in _runs(values):
        _add_run(result, run)
    return result


def verify_crc(path: Path | str) -> bool:
    """Check the CRC trailer by streaming the file; False when there is no trailer.

    Raises:
        CorruptDataError: the CRC-32 of the bytes before the trailer differs from the stored one.
    """
    path = Path(path)
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        proto_end, stored = _trailer(f, size)
        if stored is None:
            return False
        f.seek(0)
        computed = _crc_of(f, proto_end, path)
    if computed != stored:
        raise CorruptDataError(
            f"{path}: CRC-32 mismatch: the trailer says {stored:#010x}, the {proto_end} bytes "
            f"before it hash to {computed:#010x}"
        )
    return True


def _crc_of(f: BinaryIO, nbytes: int, path: Path) -> int:
    buf = memoryview(bytearray(min(CRC_BLOCK_BYTES, max(nbytes, 1))))
    crc, done = 0, 0
    while done < nbytes:
        n = f.readinto(buf[: min(len(buf), nbytes - done)])
        if not n:
            raise CorruptDataError(f"{path}: truncated while checking the CRC at offset {done}")
        crc = zlib.crc32(buf[:n], crc)
        done += n
    return crc


def decode_string(raw: bytes, where: str) -> str:
    """A `str` value's content as MindSpore's loader returns it (numpy `<U` drops trailing NULs)."""
    try:
        return raw.decode("utf-32-le").rstrip("\x00")
    except UnicodeDecodeError:
        raise CorruptDataError(f"{where}: str value is not valid UTF-32") from None


def read_string(path: Path | str, entry: CkptString) -> str:
    """Read and decode one `str` value (a few bytes, with one pread)."""
    path = Path(path)
    with _open(path) as f:
        data = os.pread(f.fileno(), entry.nbytes, entry.offset)
    if len(data) != entry.nbytes:
        raise CorruptDataError(f"{path}: truncated: str value {entry.name!r} needs bytes "
                               f"[{entry.offset}, {entry.offset + entry.nbytes})")
    return decode_string(data, f"{path}: offset {entry.offset}: {entry.name!r}")


def sniff(head: bytes, file_size: int) -> str:
    """Classify a file's first bytes: "value" (starts with a plausible Checkpoint Value),
    "encrypted", "short" (all bytes so far fit, but the head ends first) or "no"."""
    if encryption_mode(head):
        return "encrypted"
    try:
        return "value" if _sniff_value(head, file_size) else "no"
    except _Short:
        return "short"


class _Short(Exception):
    """The head ended before the sniff could decide."""


def _head_varint(head: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(head):
            raise _Short
        byte = head[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            return -1, pos


def _sniff_value(head: bytes, file_size: int) -> bool:
    """Field 1 (Value) whose length fits the file, opening with a UTF-8 tag, then a tensor or
    maptensor field whose length fits the Value."""
    if not head:
        raise _Short
    if head[0] != 0x0A:
        return False
    value_len, pos = _head_varint(head, 1)
    if value_len < 0 or pos + value_len > file_size:
        return False
    end = pos + value_len
    if pos >= len(head):
        raise _Short
    if head[pos] != 0x0A:
        return False
    tag_len, pos = _head_varint(head, pos + 1)
    if tag_len < 0 or pos + tag_len > end:
        return False
    if pos + tag_len > len(head):
        raise _Short
    try:
        head[pos:pos + tag_len].decode("utf-8")
    except UnicodeDecodeError:
        return False
    pos += tag_len
    if pos >= len(head):
        raise _Short
    if head[pos] not in (0x12, 0x1A):
        return False
    body_len, pos = _head_varint(head, pos + 1)
    return 0 <= body_len and pos + body_len == end


# --------------------------------------------------------------------------------------------
# Writing


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _piece_header(tag: bytes, dims: tuple[int, ...], tensor_type: bytes, content_nbytes: int) -> bytes:
    """The bytes of a one-Value Checkpoint up to its tensor_content, exactly as protobuf
    serializes MindSpore's message (fields in number order, dims unpacked)."""
    tensor_head = b"".join(b"\x08" + _varint(d) for d in dims)
    tensor_head += b"\x12" + _varint(len(tensor_type)) + tensor_type + b"\x1a" + _varint(content_nbytes)
    tensor_len = len(tensor_head) + content_nbytes
    value_head = b"\x0a" + _varint(len(tag)) + tag + b"\x12" + _varint(tensor_len)
    value_len = len(value_head) + tensor_len
    return b"\x0a" + _varint(value_len) + value_head + tensor_head


def writable_spelling(dtype: DType) -> str:
    """The tensor_type MindSpore's loader reads for `dtype`, or ValueError."""
    if dtype.mindspore not in _BY_SPELLING:  # None included: it is no key
        raise ValueError(f"MindSpore .ckpt cannot hold {dtype} tensors")
    return dtype.mindspore


@dataclass(slots=True)
class _OpenTensor:
    name: str
    tag: bytes
    dims: tuple[int, ...]
    tensor_type: bytes
    remaining: int  # bytes of the tensor still to come
    split: int  # bytes per Value
    piece_left: int = 0  # bytes of the current piece still to come


class CkptWriter:
    """Stream a `.ckpt` that `mindspore.load_checkpoint` reads, without buffering tensor data.

    Declare a tensor with `begin_tensor(name, dtype, shape)`, pass its row-major little-endian
    bytes to `write` in as many pieces as convenient, then `end_tensor()` (or use `add_tensor`).
    Each Value's length prefixes follow from dtype and shape, so bytes go straight to the file.
    Tensors over `SPLIT_BYTES` (read when the tensor begins; tests lower it) are cut every
    `SPLIT_BYTES` bytes into consecutive Values with the same tag, as MindSpore's synchronous save
    does. Zero-element tensors are skipped, as MindSpore drops them: `skipped` lists them so the
    caller can warn. `add_string` writes a `str` value; ints and floats must be given as 0-d
    tensors by the caller (that is what `save_checkpoint(append_dict=...)` does).

    The file is written to a hidden sibling and renamed into place by `close()` (fsynced, with
    its directory, unless `sync=False`); `abort()` or an exception inside `with` removes it.
    With `crc=True` the CRC-32 of everything written is appended as MindSpore's trailer.
    """

    def __init__(self, path: Path | str, *, crc: bool = False, sync: bool = True):
        self.path = Path(path)
        self.sync = sync
        self.skipped: list[str] = []
        self._crc: int | None = 0 if crc else None
        self._names: set[str] = set()
        self._open: _OpenTensor | None = None
        self._aborted = False
        self._closed = False
        self._tmp = self.path.with_name(f".{self.path.name[:200]}.{secrets.token_hex(6)}.partial")
        self._f: BinaryIO | None = open(self._tmp, "xb")

    # -- tensors --

    def begin_tensor(self, name: str, dtype: DType, shape: tuple[int, ...]) -> bool:
        """Declare the next tensor; False when it has no elements and is skipped (no `write`)."""
        self._check_new(name)
        spelling = writable_spelling(dtype)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"{name}: negative dimension in shape {list(shape)}")
        nbytes = math.prod(shape) * dtype.itemsize
        self._names.add(name)
        if nbytes == 0:
            self.skipped.append(name)
            return False
        self._open = _OpenTensor(name, name.encode("utf-8"), shape, spelling.encode(), nbytes,
                                 max(1, int(SPLIT_BYTES)))
        return True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes of the open tensor; starts a new Value at every split boundary."""
        view = memoryview(data).cast("B")
        t = self._open
        if t is None:
            if len(view):
                raise ValueError("write() without an open tensor")
            return
        if len(view) > t.remaining:
            raise ValueError(f"{t.name}: {len(view)} bytes written but only {t.remaining} remain")
        while len(view):
            if t.piece_left == 0:
                t.piece_left = min(t.split, t.remaining)
                self._emit(_piece_header(t.tag, t.dims, t.tensor_type, t.piece_left))
            n = min(len(view), t.piece_left)
            self._emit(view[:n])
            view = view[n:]
            t.piece_left -= n
            t.remaining -= n

    def can_place(self) -> bool:
        """True when the open tensor can be filled in place (`write_in_place`): it is one Value
        (no split) and no CRC is being kept (a CRC needs every byte to pass through here)."""
        t = self._open
        return t is not None and t.piece_left == 0 and t.remaining <= t.split and self._crc is None

    def write_in_place(self, fill: Callable[[int, int], None]) -> None:
        """The open tensor's bytes written by `fill(fd, offset)` straight into the file (`pwrite`
        or `copy_file_range`: no copy through this process). Only when `can_place()`."""
        if not self.can_place():
            raise ValueError("write_in_place() needs an open, unsplit tensor and no CRC")
        t = self._open
        self._emit(_piece_header(t.tag, t.dims, t.tensor_type, t.remaining))
        self._f.flush()
        start = self._f.tell()
        fill(self._f.fileno(), start)
        if os.fstat(self._f.fileno()).st_size < start + t.remaining:
            raise ValueError(f"{t.name}: fill() wrote less than the tensor's {t.remaining} bytes")
        self._f.seek(start + t.remaining)
        t.remaining = 0

    def end_tensor(self) -> None:
        t = self._open
        if t is not None and t.remaining:
            raise ValueError(f"{t.name}: {t.remaining} bytes of the tensor were never written")
        self._open = None

    def add_tensor(self, name: str, dtype: DType, shape: tuple[int, ...],
                   data: bytes | bytearray | memoryview) -> bool:
        """Write a whole tensor from one buffer; False when it has no elements and is skipped."""
        if not self.begin_tensor(name, dtype, shape):
            return False
        self.write(data)
        self.end_tensor()
        return True

    # -- values --

    def add_string(self, name: str, text: str) -> None:
        """A `str` value, stored as MindSpore does (`dims [0]`, numpy `<U` bytes = UTF-32-LE)."""
        self._check_new(name)
        if text.endswith("\x00"):
            raise ValueError(f"{name}: MindSpore drops trailing NUL characters of str values")
        content = text.encode("utf-32-le") or b"\x00" * 4  # numpy stores "" as one NUL (<U1)
        self._names.add(name)
        self._emit(_piece_header(name.encode("utf-8"), (0,), STRING_TYPE.encode(), len(content)))
        self._emit(content)

    # -- finishing --

    def close(self) -> list[str]:
        """Finish the file (CRC trailer, fsync, rename into place); returns `skipped`."""
        if self._aborted:
            raise ValueError(f"{self.path}: the writer was aborted; nothing was written")
        if self._closed:
            return self.skipped
        if self._open is not None and self._open.remaining:
            name = self._open.name
            self.abort()
            raise ValueError(f"{name}: closed before all of the tensor's bytes were written")
        try:
            if self._crc is not None:
                self._f.write(CRC_MARK + self._crc.to_bytes(10, "big"))
            self._f.flush()
            if self.sync:
                os.fsync(self._f.fileno())
            self._f.close()
            self._f = None
            os.replace(self._tmp, self.path)
            self._closed = True
        except BaseException:
            self.abort()
            raise
        if self.sync:
            fsync_files([self.path.parent])
        return self.skipped

    def abort(self) -> None:
        """Drop the partial file; the destination is left as it was."""
        if self._closed:
            return  # the file is in place and stays
        self._aborted = True
        if self._f is not None:
            self._f.close()
            self._f = None
        self._open = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> "CkptWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def _check_new(self, name: str) -> None:
        if self._f is None:
            raise ValueError("the writer is closed or aborted")
        if self._open is not None and self._open.remaining:
            raise ValueError(f"{self._open.name}: the previous tensor is not complete")
        self._open = None
        if not isinstance(name, str) or not name:
            raise ValueError(f"entry names must be non-empty strings, not {name!r}")
        if name in self._names:
            raise ValueError(f"{name}: written twice (MindSpore's loader would join or replace them)")

    def _emit(self, data: bytes | memoryview) -> None:
        assert self._f is not None
        self._f.write(data)
        if self._crc is not None:
            self._crc = zlib.crc32(data, self._crc)
