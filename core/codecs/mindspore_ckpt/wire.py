"""The protobuf wire format of a `.ckpt`, both ways: walking its fields, and a Value's header.

Reading walks field headers and seeks over payloads, so an index of a multi-GiB file is built
without reading tensor data; every length is bounded by its enclosing message, so a lie is
reported with the offset where it was found. Writing produces a one-Value `Checkpoint` up to its
tensor_content exactly as protobuf serializes MindSpore's message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from hpckpt.core.errors import CorruptDataError

MAX_TAG_BYTES = 1 << 20
MAX_TYPE_BYTES = 64
MAX_DIMS = 64
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_FIXED_SIZE = {_I64: 8, _I32: 4}


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
    """A varint read as int64, as protobuf does: its low 64 bits, two's complement (a 10-byte
    varint can carry up to 70 bits; the rest are dropped)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


#: MindSpore's CRC trailer: `b"crc_num"` and the CRC-32 as 10 bytes big-endian (`scan.CRC_MARK`).
_CRC_MARK, _CRC_TRAILER_BYTES = b"crc_num", 17


def _refuse_cut_trailer(cur: _Cursor, start: int, end: int) -> None:
    """Raise if the last `end - start` (< 17) bytes are the start of a CRC trailer: a file cut
    inside its trailer (a Value always begins with byte 0x0a, never with `c`)."""
    cur.f.seek(start)
    rest = cur.f.read(end - start)
    cur.f.seek(start)
    if rest and (_CRC_MARK.startswith(rest) or rest.startswith(_CRC_MARK)):
        raise cur.error(start, f"truncated CRC trailer ({len(rest)} of its {_CRC_TRAILER_BYTES} bytes: "
                               f"b'crc_num' and a 10-byte CRC-32): the file was cut short")


def _walk(cur: _Cursor, end: int) -> list[_RawValue]:
    """Every top-level Value; anything else at the top level means this is no checkpoint."""
    values = []
    while cur.pos < end:
        start = cur.pos
        if end - start < _CRC_TRAILER_BYTES:
            _refuse_cut_trailer(cur, start, end)
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


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def piece_header(tag: bytes, dims: tuple[int, ...], tensor_type: bytes, content_nbytes: int) -> bytes:
    """The bytes of a one-Value Checkpoint up to its tensor_content, exactly as protobuf
    serializes MindSpore's message (fields in number order, dims unpacked)."""
    tensor_head = b"".join(b"\x08" + _varint(d) for d in dims)
    tensor_head += b"\x12" + _varint(len(tensor_type)) + tensor_type + b"\x1a" + _varint(content_nbytes)
    tensor_len = len(tensor_head) + content_nbytes
    value_head = b"\x0a" + _varint(len(tag)) + tag + b"\x12" + _varint(tensor_len)
    value_len = len(value_head) + tensor_len
    return b"\x0a" + _varint(value_len) + value_head + tensor_head
