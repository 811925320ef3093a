"""A MindSpore `.ckpt` file: one protobuf stream of tensors (some split over several Values) and
`str` values, indexed by walking its fields (`core.codecs.mindspore_ckpt.scan`), read by byte range.

Written as `mindspore.save_checkpoint` writes it, byte for byte: every tensor a Value whose
header follows from its dtype and shape, cut every `SPLIT_BYTES` into Values with the same tag
(MindSpore's synchronous save), then the values: `str` as MindSpore stores them, bool/int/float
as 0-d tensors (what `save_checkpoint(append_dict=...)` does, reported as converted: MindSpore
reads them back as tensors); with `--crc`, the CRC-32 trailer. Zero-element tensors and other
values cannot be held: they are reported as skipped. A dtype MindSpore cannot load is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.safetensors_file import whole_tensors
from hpckpt.core import dtypes
from hpckpt.core.codecs import mindspore_ckpt as ckpt
from hpckpt.core.codecs import safetensors_io
from hpckpt.core.errors import (CorruptDataError, EntryMismatchError, HpckptError, NotACheckpointError,
                                 UnknownFormatError)
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry, parse_range_key
from hpckpt.core.io.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.safety import input_files
from hpckpt.core.storage.readers import file_size
from hpckpt.core.storage.urls import as_path

SNIFF_BYTES = 4096
STRING_ENCODING = "utf-32"  # `ValueEntry.encoding` of MindSpore `str` values
#: Said by inspect (and, as every source note, by a write); a file without a trailer gets no note,
#: so that converting a plain .ckpt, the usual case, warns of nothing.
CRC_NOTE = "CRC-32 trailer present (checked when data is read, and by verify)"


class MindSporeCkptLocator:
    """`Locator` for one `.ckpt`: chunk keys are `"offset:nbytes"` of C-contiguous byte runs.

    A file with a CRC trailer is checked (streamed whole, once per index) on the first read of
    its data, a chunk located or a value decoded, before a byte of it can reach a destination:
    a mismatch is `CorruptDataError`, and the command fails before its commit.
    """

    def __init__(self, path: Path, file_size: int, has_crc: bool = False):
        self.path = path
        self.file_size = file_size
        self.crc = ckpt.CrcGate(path, has_crc)

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        offset, nbytes = parse_range_key(chunk.key, entry.fqn, CorruptDataError)
        if nbytes != chunk.box.volume * entry.dtype.itemsize:
            raise EntryMismatchError(
                f"{chunk.file}: bytes {chunk.key} of {entry.fqn!r} cannot hold {entry.dtype}{list(chunk.box.sizes)}"
            )
        self._check_range(offset, nbytes, entry.fqn)
        self.crc.check()
        return Location(self.path, offset, nbytes, entry.dtype, tuple(chunk.box.sizes))

    def decode_value(self, entry: ValueEntry) -> Any:
        self._check_range(entry.offset, entry.length, entry.fqn)
        self.crc.check()
        return ckpt.read_string(self.path, ckpt.CkptString(entry.fqn, entry.offset, entry.length))

    def file_problems(self, relative: str) -> list[str]:
        """The CRC trailer, when there is one, must match the file (the same check reads do)."""
        try:
            self.crc.check()
        except CorruptDataError as exc:
            return [exc.message.removeprefix(f"{self.path}: ")]
        return []

    def _check_range(self, offset: int, nbytes: int, fqn: str) -> None:
        if offset < 0 or offset + nbytes > self.file_size:
            raise CorruptDataError(
                f"{self.path}: {fqn!r} at bytes [{offset}, {offset + nbytes}) lies beyond the end "
                f"of the file ({self.file_size} bytes): truncated?"
            )


def _head(path: Path) -> tuple[bytes, int]:
    try:
        with input_files.open_file(path) as f:
            return f.read(SNIFF_BYTES), file_size(f)
    except (OSError, HpckptError):
        return b"", -1


def _refuse_empty(scan: ckpt.CkptScan) -> None:
    """No Value at all (0 bytes, or a CRC trailer alone: what `save_checkpoint({})` and
    `save_checkpoint([])` write) is no checkpoint: MindSpore's own loader refuses it ("The loaded
    parameter dict is empty"). Not corrupt: the bytes are well formed, there is just nothing."""
    if scan.tensors or scan.strings or scan.unsupported:
        return
    what = "is empty (0 bytes)" if scan.file_size == 0 else (
        "holds only a CRC trailer" if scan.has_crc and scan.proto_end == 0 else "holds no entry")
    raise NotACheckpointError(
        f"{scan.path}: this MindSpore .ckpt {what}: no tensor and no value, so it is no checkpoint "
        f"(MindSpore's load_checkpoint refuses it too)",
        hint="MindSpore's save_checkpoint({}) writes such a file; a 0-byte one may also be a copy that failed",
    )


def _refuse_unsupported(scan: ckpt.CkptScan) -> None:
    """Leaving entries out would make consolidate and reshard drop them silently: refuse instead."""
    if not scan.unsupported:
        return
    items = list(scan.unsupported.values())
    listed = "; ".join(f"{u.name!r} at offset {u.value_offset}: {u.reason}" for u in items[:3])
    more = f" (and {len(items) - 3} more)" if len(items) > 3 else ""
    raise UnknownFormatError(f"{scan.path}: {len(items)} entr{'y' if len(items) == 1 else 'ies'} "
                             f"hpckpt cannot read: {listed}{more}")


class MindSporeCkptReader:
    """`FormatAdapter` for a single MindSpore `.ckpt` file."""

    name = "mindspore-ckpt"

    def sniff(self, path: Path) -> bool:
        path = as_path(path)
        if not path.is_file():
            return False
        head, size = _head(path)
        kind = ckpt.sniff(head, size)
        if kind in ("value", "encrypted"):
            return True
        if path.suffix != ".ckpt":
            return False
        if safetensors_io.looks_like_safetensors(head, size):
            return False
        # A damaged or empty .ckpt is still ours, so that its error says what is wrong with it.
        only_crc = size == ckpt.CRC_TRAILER_BYTES and head.startswith(ckpt.CRC_MARK)
        return kind == "short" or head[:1] == b"\x0a" or only_crc

    def read_index(self, path: Path) -> CheckpointIndex:
        path = as_path(path)
        scan = ckpt.scan(path)
        _refuse_empty(scan)
        _refuse_unsupported(scan)
        name = path.name
        tensors = {
            t.name: TensorEntry(
                t.name, t.dtype, t.shape,
                [Chunk(box, name, f"{offset}:{nbytes}") for box, offset, nbytes in t.regions()],
                dtype_spelling=t.tensor_type,
            )
            for t in scan.tensors.values()
        }
        values = {s.name: ValueEntry(s.name, name, s.offset, s.nbytes, encoding=STRING_ENCODING)
                  for s in scan.strings.values()}
        notes = list(scan.notes)
        if scan.has_crc:
            notes.append(CRC_NOTE)
        # (a single-file index: the same fields as torch_save_file.py's, with this format's values)
        return CheckpointIndex(
            root=path.parent,
            format=self.name,
            format_version="1",
            framework="mindspore",
            tensors=tensors,
            values=values,
            data_files=[name],
            locator=MindSporeCkptLocator(path, scan.file_size, scan.has_crc),
            notes=notes,
            warnings=list(scan.warnings),
        )


#: Python scalars a `.ckpt` holds as 0-d tensors, in the tensor_type `save_checkpoint(append_dict=)`
#: gives them (`Tensor(value)`); `load_checkpoint` returns them as Parameters, not as scalars.
_SCALAR_TYPES = {bool: "bool", int: "int64", float: "float32"}
_CRC = "crc"


class MindSporeCkptWriter:
    """`FormatWriter` of a MindSpore `.ckpt` (call order in `converters.base`)."""

    def __init__(self, options: WriterOptions):
        self.options = options
        self._crc_at: int | None = None

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        """Raises:
            UnsupportedDTypeError: a tensor's dtype has no tensor_type MindSpore loads.
            NotACheckpointError: nothing would be written (a .ckpt with no entry is no checkpoint).
        """
        fixed, boxes, skipped, converted, position = [], [], [], [], 0
        split = max(1, int(ckpt.SPLIT_BYTES))

        def emit(data: bytes) -> None:
            nonlocal position
            fixed.append((position, data))
            position += len(data)

        for tensor, planned in whole_tensors(plan, "mindspore-ckpt"):
            spelling = ckpt.writable_spelling(tensor.dtype, tensor.fqn).encode()
            nbytes = tensor.box_nbytes(planned)
            if nbytes == 0:
                skipped.append((tensor.fqn, "zero-element tensors cannot be stored in a .ckpt"))
                continue
            tag, extents = _tag(tensor.fqn), []
            for start in range(0, nbytes, split):
                piece = min(split, nbytes - start)
                emit(ckpt.piece_header(tag, tensor.shape, spelling, piece))
                extents.append(Extent(position, piece))
                position += piece
            boxes.append(Placement(tensor, planned, tuple(extents)))
        for value in plan.values:
            record, reason = _value_record(value.fqn, values[value.fqn])
            if record is None:
                skipped.append((value.fqn, reason))
                continue
            emit(record)
            if reason is not None:
                converted.append((value.fqn, reason))
        if not fixed:
            raise NotACheckpointError(
                f"{self.options.name}: nothing to write: a .ckpt without a tensor or value is no "
                f"checkpoint (MindSpore's load_checkpoint refuses it, and so does hpckpt)"
                + (f"; not writable: {', '.join(sorted({r for _, r in skipped}))}" if skipped else ""),
                hint="select at least one entry, or write another format",
            )
        checksums = ()
        if self.options.crc:
            self._crc_at = position
            checksums = ((_CRC, 0, position),)
            position += ckpt.CRC_TRAILER_BYTES
        layout = FileLayout(self.options.name, position, tuple(fixed), tuple(boxes), checksums)
        return OutputLayout((layout,), tuple(skipped), tuple(converted))

    def expected_files(self, plan: Plan) -> list[str]:
        return [self.options.name]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        if self._crc_at is None:
            return Finished()
        trailer = ckpt.CRC_MARK + crcs[_CRC].to_bytes(10, "big")
        return Finished(((self.options.name, self._crc_at, trailer),))


def _value_record(name: str, data: Any) -> tuple[bytes | None, str | None]:
    """A value's Value record and why it is another kind now; or None and why it is not written.

    `str` stays a str (MindSpore's own encoding, read back as str). bool/int/float become 0-d
    tensors, as `save_checkpoint(append_dict=...)` stores them, and MindSpore reads them back as
    Parameters: reported as converted, never passed off as the same value.
    """
    if isinstance(data, str):
        if data.endswith("\x00"):
            return None, "MindSpore drops the trailing NUL characters of str values"
        return _string_value(name, data), None
    kind = _SCALAR_TYPES.get(type(data))
    if kind is None:
        return None, f"a .ckpt holds str, int, float and bool values, not {type(data).__name__}"
    dt = dtypes.dtype(kind)
    if kind == "int64" and not -(1 << 63) <= data < 1 << 63:
        return None, f"int {data} does not fit the Int64 tensor a .ckpt stores ints in"
    with np.errstate(over="ignore"):  # a float beyond float32's range becomes inf: reported below
        stored = np.array(data, dtype=dt.np)
    content = stored.tobytes()
    record = ckpt.piece_header(_tag(name), (), ckpt.writable_spelling(dt).encode(), len(content)) + content
    what = type(data).__name__
    if kind == "float32" and float(stored) != data and data == data:  # (NaN stays NaN)
        what = f"float {data!r}, rounded to {float(stored)!r},"
    return record, (f"{what} stored as a 0-d {dt.mindspore} tensor: MindSpore's load_checkpoint reads it "
                    f"back as a Parameter (a tensor), not as a Python {type(data).__name__}")


def _tag(name: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise ValueError(f"entry names must be non-empty strings, not {name!r}")
    return name.encode("utf-8")


def _string_value(name: str, text: str) -> bytes:
    """A `str` value as MindSpore stores it (`dims [0]`, numpy `<U` bytes = UTF-32-LE)."""
    content = text.encode("utf-32-le") or b"\x00" * 4  # numpy stores "" as one NUL (<U1)
    return ckpt.piece_header(_tag(name), (0,), ckpt.STRING_TYPE.encode(), len(content)) + content
