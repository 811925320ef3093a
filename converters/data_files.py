"""Reaching chunk bytes inside safetensors files (and legacy torch.save archives named like them).

HyperParallel, Hugging Face and plain safetensors checkpoints all keep tensors as keys of
safetensors files and values as pickles at byte ranges, so they share this one locator. Headers
are parsed once per file, on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpckpt.core.codecs import safetensors_io
from hpckpt.core.errors import (
    CorruptDataError,
    CorruptMetadataError,
    EntryMismatchError,
    MissingFileError,
    UnsupportedDTypeError,
)
from hpckpt.core.index import Chunk, Location, TensorEntry, ValueEntry
from hpckpt.core.io import checksums
from hpckpt.core.io.crc import crc32
from hpckpt.core.io.read import open_data_file, pread_exact
from hpckpt.core.paths import resolve_inside
from hpckpt.core.safety import input_files
from hpckpt.core.safety.unpickle import loads
from hpckpt.core.storage.readers import close_handle, handle_of, handle_size

ZIP_MAGIC = b"PK\x03\x04"


class DataFileLocator:
    """`Locator` for checkpoints whose tensors are keys of per-rank data files under `root`."""

    def __init__(self, root: Path, value_replicas: Iterable[ValueEntry] = (), siblings: bool = False):
        self.root = root
        self.siblings = siblings  # files of the checkpoints beside it may be named (`resolve_inside`)
        # values an index holds once but more files store (each rank's copy): checked by file_problems
        self._replicas: dict[str, list[ValueEntry]] = {}
        for entry in value_replicas:
            self._replicas.setdefault(entry.file, []).append(entry)
        self._tensor_tables: dict[str, dict[str, Location]] = {}
        self._headers: dict[str, safetensors_io.SafetensorsHeader] = {}
        self._sidecars: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.warnings: list[str] | None = None  # the index's: values that are no pickle are noted there

    def path(self, relative: str) -> Path:
        return resolve_inside(self.root, relative, self.siblings)

    def tensor_table(self, relative: str) -> dict[str, Location]:
        """Return key -> Location for every tensor in the data file `relative` (cached)."""
        table = self._tensor_tables.get(relative)
        if table is None:
            with self._lock:  # built once, whichever worker asks first
                table = self._tensor_tables.get(relative)
                if table is None:
                    table = self._tensor_tables[relative] = self._build_table(relative)
        return table

    def _build_table(self, relative: str) -> dict[str, Location]:
        path = self.path(relative)
        if not path.exists():
            raise MissingFileError(f"{relative}: data file is missing from {self.root}")
        with open_data_file(path) as f:  # refuses a FIFO, device or directory unopened
            magic = f.read(4)
        if magic == ZIP_MAGIC:
            return _torch_archive_table(path)
        header = self._header(relative, path)
        if header.problems:
            raise CorruptDataError(f"{relative}: {header.problems[0]}")
        check_mindspore_crc(header)
        return {key: Location(path, info.begin, info.end - info.begin, info.dtype, info.shape)
                for key, info in header.entries.items()}

    def header(self, relative: str) -> safetensors_io.SafetensorsHeader:
        """A data file's header, read once whoever asks (the index, then every locate).

        Raises:
            CorruptDataError: the header is malformed (`UnsupportedDTypeError` for a dtype hpckpt refuses).
        """
        header = self._header(relative, self.path(relative))
        if header.problems:
            raise CorruptDataError(f"{header.path}: {header.problems[0]}")
        if header.unsupported:
            key, why = next(iter(header.unsupported.items()))
            raise UnsupportedDTypeError(f"{header.path}: tensor {key!r}: {why}")
        return header

    def _header(self, relative: str, path: Path) -> safetensors_io.SafetensorsHeader:
        header = self._headers.get(relative)
        if header is None:
            header = self._headers[relative] = safetensors_io.read_header(path, strict=False)
        return header

    def file_problems(self, relative: str) -> list[str]:
        """Structural problems of a tensor file (empty when sound); parsed once, shared with locate."""
        path = self.path(relative)
        if not relative.endswith(".safetensors"):
            # `.bytes` files have no structure of their own; values are checked one by one, and the
            # other ranks' copies of a value (which no index entry reads) by their byte ranges here
            replicas = self._replicas.get(relative)
            if not replicas:
                return []
            size = path.stat().st_size
            return [f"value {v.fqn!r} (this rank's copy) needs bytes [{v.offset}, {v.offset + v.length}) of this "
                    f"{size}-byte file: truncated?" for v in replicas if v.offset + v.length > size]
        with open_data_file(path) as f:
            if f.read(4) == ZIP_MAGIC:
                self.tensor_table(relative)  # raises CorruptDataError for a broken archive
                return []
        header = self._header(relative, path)
        if not header.problems:
            try:
                self.tensor_table(relative)  # a MindSpore crc_num is checked there, once
            except CorruptDataError as exc:
                return [exc.message.removeprefix(f"{path}: ")]
        return header.problems

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location:
        loc = self.tensor_table(chunk.file).get(chunk.key)
        if loc is None:
            raise EntryMismatchError(
                f"{chunk.file}: has no tensor {chunk.key!r} (chunk {chunk.box} of {entry.fqn})"
            )
        if loc.stored_dtype != entry.dtype:
            raise EntryMismatchError(
                f"{chunk.file}: tensor {chunk.key!r} is {loc.stored_dtype}, the metadata says {entry.dtype} ({entry.fqn})"
            )
        if tuple(loc.stored_shape) != tuple(chunk.box.sizes):
            raise EntryMismatchError(
                f"{chunk.file}: tensor {chunk.key!r} has shape {list(loc.stored_shape)}, "
                f"the metadata says {list(chunk.box.sizes)} ({entry.fqn} chunk {chunk.box})"
            )
        return loc

    def value_bytes(self, entry: ValueEntry) -> bytes:
        path = self.path(entry.file)
        if not path.exists():
            raise MissingFileError(f"{entry.file}: data file is missing (holds value {entry.fqn})")
        fd = input_files.open_handle(path)
        try:
            size = handle_size(fd)
            length = size - entry.offset if entry.length < 0 else entry.length
            if entry.offset < 0 or entry.offset + length > size:
                raise CorruptDataError(
                    f"{entry.file}: value {entry.fqn} at bytes [{entry.offset}, {entry.offset + length}) "
                    f"lies beyond the end of the file ({size} bytes)"
                )
            return bytes(pread_exact(fd, length, entry.offset, path))
        finally:
            close_handle(fd)

    def decode_value(self, entry: ValueEntry) -> Any:
        if entry.encoding == "json":  # a safetensors output's values sidecar (converters.values_sidecar)
            from hpckpt.converters import values_sidecar

            document = self._sidecars.get(entry.file)
            if document is None:
                document = self._sidecars[entry.file] = values_sidecar.read(self.path(entry.file))
            if entry.fqn not in document:
                raise CorruptDataError(f"{entry.file}: no value {entry.fqn!r} (changed since it was read?)")
            return values_sidecar.decode_one(document[entry.fqn])
        data = self.value_bytes(entry)
        if not data.startswith(b"\x80"):
            # HyperParallel writes `bytes` values raw, not pickled; a damaged
            # pickle looks the same, so every command that reads one says so
            note = (f"{entry.fqn}: its {len(data)} bytes in {entry.file} are no pickle: read as a raw bytes value, as "
                    "HyperParallel saves one (HyperParallel's own loader cannot load it)")
            if self.warnings is not None and note not in self.warnings:
                self.warnings.append(note)
            return data
        try:
            return loads(data, what=f"{entry.file} value {entry.fqn}")
        except CorruptMetadataError as exc:
            raise CorruptDataError(exc.message) from exc


def check_mindspore_crc(header: safetensors_io.SafetensorsHeader) -> None:
    """MindSpore's `save_checkpoint(..., format="safetensors", crc_check=True)` records in
    `__metadata__["crc_num"]` the CRC-32 of every tensor's name and bytes, names sorted, which its
    `load_checkpoint(crc_check=True)` checks; hpckpt checks it before the file's data is used.

    Raises:
        CorruptDataError: the bytes hash otherwise (or `crc_num` is not a number).
    """
    stored = header.metadata.get("crc_num")
    if stored is None or header.metadata.get("format") != "ms":
        return
    try:
        expected = int(stored)
    except ValueError:
        raise CorruptDataError(f"{header.path}: __metadata__ crc_num {stored!r} is not a number") from None
    crc = 0
    with open_data_file(header.path) as f:
        for key in sorted(header.entries):
            info = header.entries[key]
            crc = crc32(key.encode("utf-8"), crc)
            crc = checksums.crc_of_range(handle_of(f), info.begin, info.end - info.begin, header.path, crc)
    if crc != expected:
        raise CorruptDataError(f"{header.path}: CRC-32 mismatch: __metadata__ crc_num says {expected}, the tensors "
                               f"hash to {crc}", hint="the file is damaged (MindSpore's load_checkpoint(crc_check=True) "
                               "refuses it too)")


def _torch_archive_table(path: Path) -> dict[str, Location]:
    """Legacy HyperParallel tensor files are torch.save archives of {key: tensor}."""
    from hpckpt.core.codecs import torch_zip

    obj = torch_zip.load_record(path)
    if not isinstance(obj, dict):
        raise CorruptDataError(f"{path}: torch.save archive does not hold a dict of tensors")
    return {
        str(key): record.location(path)
        for key, record in obj.items()
        if isinstance(record, torch_zip.TensorRecord)
    }
