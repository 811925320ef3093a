"""What a walk of a `.ckpt` finds: tensors (joined from split Values), `str` values, entries
hpckpt does not read, where the CRC trailer is (checked by `crc`); and the reads of single values."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from hpckpt.core.codecs.mindspore_ckpt.sniff import encryption_mode
from hpckpt.core.codecs.mindspore_ckpt.wire import _Cursor, _RawValue, _walk
from hpckpt.core.dtypes import DType, all_dtypes
from hpckpt.core.errors import CorruptDataError, MissingFileError, UnknownFormatError
from hpckpt.core.geometry.box import Box, full_box
from hpckpt.core.geometry.layout import decompose_flat_interval
from hpckpt.core.io.read import open_data_file
from hpckpt.core.storage.readers import file_size, handle_of, pread
from hpckpt.core.storage.urls import as_path

CRC_MARK = b"crc_num"
CRC_TRAILER_BYTES = len(CRC_MARK) + 10
STRING_TYPE = "str"

# The tensor types MindSpore's loader accepts (`tensor_to_ms_type`), other than str and Int4.
_BY_SPELLING: dict[str, DType] = {
    d.mindspore: d for d in all_dtypes()
    if d.mindspore and not d.name.startswith("complex")
}
_UNSUPPORTED_TYPES = {"Int4": "Int4 (qint4x2, two 4-bit values per byte) is not read by hpckpt"}


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
    warnings: list[str] = field(default_factory=list)  # what a conversion from it must repeat

    @property
    def has_crc(self) -> bool:
        return self.stored_crc is not None


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
            scan.warnings.append(f"{name}: stored twice; the later copy wins, as in MindSpore's loader")
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
    return open_data_file(path, "MindSpore .ckpt file")


def scan(path: Path | str) -> CkptScan:
    """Walk a `.ckpt`'s fields (headers only; tensor_content is skipped by seeking).

    Raises:
        MissingFileError: the file does not exist or cannot be read.
        UnknownFormatError: the file is encrypted.
        CorruptDataError: truncated or malformed, with the offset where it goes wrong.
    """
    path = as_path(path)
    with _open(path) as f:
        try:
            size = file_size(f)
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


def decode_string(raw: bytes, where: str) -> str:
    """A `str` value's content as MindSpore's loader returns it (numpy `<U` drops trailing NULs)."""
    try:
        return raw.decode("utf-32-le").rstrip("\x00")
    except UnicodeDecodeError:
        raise CorruptDataError(f"{where}: str value is not valid UTF-32") from None


def read_string(path: Path | str, entry: CkptString) -> str:
    """Read and decode one `str` value (a few bytes, with one pread)."""
    path = as_path(path)
    with _open(path) as f:
        data = pread(handle_of(f), entry.nbytes, entry.offset)
    if len(data) != entry.nbytes:
        raise CorruptDataError(f"{path}: truncated: str value {entry.name!r} needs bytes "
                               f"[{entry.offset}, {entry.offset + entry.nbytes})")
    return decode_string(data, f"{path}: offset {entry.offset}: {entry.name!r}")
