"""A MindSpore `.ckpt` file: one protobuf stream of tensors (some split over several Values) and
`str` values, indexed by walking its fields (`core.mindspore_ckpt.scan`), read by byte range."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpckpt.core import mindspore_ckpt as ckpt
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


class MindSporeCkptAdapter:
    """`FormatAdapter` for a single MindSpore `.ckpt` file."""

    name = "mindspore-ckpt"
    description = "one MindSpore .ckpt file (protobuf; split tensors, str values and CRC trailer read)"

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
        return CheckpointIndex(
            root=path.parent,
            format=self.name,
            format_version="1",
            framework="mindspore",
            tensors=tensors,
            values=values,
            metadata_files=[],
            data_files=[name],
            locator=MindSporeCkptLocator(path, scan.file_size),
            world_size=None,
            notes=notes,
        )
