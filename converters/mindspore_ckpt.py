"""A MindSpore `.ckpt` file: one protobuf stream of tensors (some split over several Values) and
`str` values, indexed by walking its fields (`core.mindspore_ckpt.scan`), read by byte range.

Written as `mindspore.save_checkpoint` writes it, byte for byte: every tensor a Value whose
header follows from its dtype and shape, cut every `SPLIT_BYTES` into Values with the same tag
(MindSpore's synchronous save), then the values: `str` as MindSpore stores them, bool/int/float
as 0-d tensors (what `save_checkpoint(append_dict=...)` does); with `--crc`, the CRC-32 trailer.
Zero-element tensors and other values cannot be held: they are reported as skipped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.converters.base import WriterOptions
from hpckpt.converters.safetensors_file import whole_tensors
from hpckpt.core import dtypes
from hpckpt.core import mindspore_ckpt as ckpt
from hpckpt.core.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.plan import Plan
from hpckpt.core import safetensors_io
from hpckpt.core.errors import CorruptDataError, EntryMismatchError, UnknownFormatError
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry, ValueEntry, parse_range_key

SNIFF_BYTES = 4096
STRING_ENCODING = "utf-32"  # `ValueEntry.encoding` of MindSpore `str` values


class MindSporeCkptLocator:
    """`Locator` for one `.ckpt`: chunk keys are `"offset:nbytes"` of C-contiguous byte runs."""

    def __init__(self, path: Path, file_size: int):
        self.path = path
        self.file_size = file_size

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        offset, nbytes = parse_range_key(chunk.key, entry.fqn, CorruptDataError)
        if nbytes != chunk.box.volume * entry.dtype.itemsize:
            raise EntryMismatchError(
                f"{chunk.file}: bytes {chunk.key} of {entry.fqn!r} cannot hold {entry.dtype}{list(chunk.box.sizes)}"
            )
        self._check_range(offset, nbytes, entry.fqn)
        return Location(self.path, offset, nbytes, entry.dtype, tuple(chunk.box.sizes))

    def decode_value(self, entry: ValueEntry) -> Any:
        self._check_range(entry.offset, entry.length, entry.fqn)
        return ckpt.read_string(self.path, ckpt.CkptString(entry.fqn, entry.offset, entry.length))

    def file_problems(self, relative: str) -> list[str]:
        """The CRC trailer, when there is one, must match the file (streams the whole file)."""
        try:
            ckpt.verify_crc(self.path)
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
        with open(path, "rb") as f:
            return f.read(SNIFF_BYTES), os.fstat(f.fileno()).st_size
    except OSError:
        return b"", -1


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
        path = Path(path)
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
        path = Path(path)
        scan = ckpt.scan(path)
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
            notes.append("CRC-32 trailer present (checked by verify)")
        # (a single-file index: the same fields as torch_save_file.py's, with this format's values)
        return CheckpointIndex(
            root=path.parent,
            format=self.name,
            format_version="1",
            framework="mindspore",
            tensors=tensors,
            values=values,
            data_files=[name],
            locator=MindSporeCkptLocator(path, scan.file_size),
            notes=notes,
        )


_SCALAR_TYPES = {bool: "bool", int: "int64", float: "float32"}
_CRC = "crc"


class MindSporeCkptWriter:
    """`FormatWriter` of a MindSpore `.ckpt` (call order in `converters.base`)."""

    def __init__(self, options: WriterOptions):
        self.options = options
        self._crc_at: int | None = None

    def layout(self, plan: Plan, values: Mapping[str, Any]) -> OutputLayout:
        fixed, boxes, skipped, position = [], [], [], 0
        split = max(1, int(ckpt.SPLIT_BYTES))

        def emit(data: bytes) -> None:
            nonlocal position
            fixed.append((position, data))
            position += len(data)

        for tensor, planned in whole_tensors(plan, "mindspore-ckpt"):
            spelling = ckpt.writable_spelling(tensor.dtype).encode()
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
            data = values[value.fqn]
            if isinstance(data, str):
                emit(_string_value(value.fqn, data))
            elif type(data) in _SCALAR_TYPES:
                kind = dtypes.dtype(_SCALAR_TYPES[type(data)])
                content = np.array(data, dtype=kind.np).tobytes()
                emit(ckpt.piece_header(_tag(value.fqn), (), ckpt.writable_spelling(kind).encode(), len(content)) + content)
            else:
                skipped.append((value.fqn, f"a .ckpt holds str, int, float and bool values, not {type(data).__name__}"))
        checksums = ()
        if self.options.crc:
            self._crc_at = position
            checksums = ((_CRC, 0, position),)
            position += ckpt.CRC_TRAILER_BYTES
        layout = FileLayout(self.options.name, position, tuple(fixed), tuple(boxes), checksums)
        return OutputLayout((layout,), tuple(skipped))

    def expected_files(self, plan: Plan) -> list[str]:
        return [self.options.name]

    def finish(self, crcs: Mapping[str, int]) -> Finished:
        if self._crc_at is None:
            return Finished()
        trailer = ckpt.CRC_MARK + crcs[_CRC].to_bytes(10, "big")
        return Finished(((self.options.name, self._crc_at, trailer),))


def _tag(name: str) -> bytes:
    if not isinstance(name, str) or not name:
        raise ValueError(f"entry names must be non-empty strings, not {name!r}")
    return name.encode("utf-8")


def _string_value(name: str, text: str) -> bytes:
    """A `str` value as MindSpore stores it (`dims [0]`, numpy `<U` bytes = UTF-32-LE)."""
    if text.endswith("\x00"):
        raise ValueError(f"{name}: MindSpore drops trailing NUL characters of str values")
    content = text.encode("utf-32-le") or b"\x00" * 4  # numpy stores "" as one NUL (<U1)
    return ckpt.piece_header(_tag(name), (0,), ckpt.STRING_TYPE.encode(), len(content)) + content
