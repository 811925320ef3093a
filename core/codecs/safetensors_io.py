"""safetensors headers: parse and validate in one pass, so data can be read by byte range.

Layout: 8-byte little-endian header length N, N bytes of JSON, then the data buffer; each entry
`{"dtype", "shape", "data_offsets": [begin, end]}` relative to the buffer. Every check the
safetensors library makes on load is made here too (size limit, JSON, dtype codes, `numel *
itemsize == end - begin`, entries contiguous from 0 to the end of the file), each with its own
message, because a checkpoint that `verify` passes must load everywhere.

Sub-byte codes (F4, F6_*) count values in the header shape; hpckpt's element is the byte group
of `DType.safetensors_pack` values, so shapes are converted here in both directions (F4
`[.., 2k]` <-> `float4_e2m1fn_x2 [.., k]`, as safetensors' torch loader does). A header whose last
dimension is no multiple of the pack is a valid file hpckpt cannot represent: refused with
`UnsupportedDTypeError` rather than split across a byte.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from hpckpt.core import dtypes
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import CorruptDataError, HpckptError, UnknownFormatError, UnsupportedDTypeError
from hpckpt.core.io.read import open_data_file
from hpckpt.core.safety import input_files
from hpckpt.core.storage.readers import file_size

MAX_HEADER_BYTES = 100 * 1024 * 1024  # what the safetensors library accepts


@dataclass(frozen=True, slots=True)
class TensorInfo:
    key: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


@dataclass
class SafetensorsHeader:
    path: Path
    file_size: int
    data_start: int
    entries: dict[str, TensorInfo]
    metadata: dict[str, str]
    problems: list[str] = field(default_factory=list)  # structural findings; empty when valid
    unsupported: dict[str, str] = field(default_factory=dict)  # key -> why hpckpt cannot represent it


def read_header(path: Path, *, strict: bool = True) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at `path`.

    With `strict`, the first problem raises; otherwise problems are collected in `.problems`
    and entries that cannot be used are left out (this is what `verify` wants).

    Raises:
        MissingFileError: the file does not exist or cannot be opened.
        CorruptDataError: the header is truncated, too large, or not valid JSON (always), or
            any other structural problem (when `strict`).
        UnsupportedDTypeError: (when `strict`) a well-formed entry hpckpt cannot represent (F4
            or F6 whose last dimension splits a byte); otherwise it is left out, in `.unsupported`.
    """
    with open_data_file(path, "safetensors file") as f:
        size = file_size(f)
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CorruptDataError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise CorruptDataError(f"{path}: safetensors header length {header_len} exceeds the 100 MiB limit")
        if 8 + header_len > size:
            raise CorruptDataError(
                f"{path}: safetensors header length {header_len} is larger than the file ({size} bytes): truncated?"
            )
        raw = f.read(header_len)
    doc = input_files.load_json(raw, f"{path}: safetensors header", CorruptDataError)
    if not isinstance(doc, dict):
        raise CorruptDataError(f"{path}: safetensors header is not a JSON object")
    header = SafetensorsHeader(path, size, 8 + header_len, {}, {})
    _check_layout(header, _parse_entries(header, doc))
    _mindspore_overrides(header)
    if strict and header.problems:
        raise CorruptDataError(f"{path}: {header.problems[0]}")
    if strict and header.unsupported:
        key, why = next(iter(header.unsupported.items()))
        raise UnsupportedDTypeError(f"{path}: tensor {key!r}: {why}")
    return header


def _mindspore_overrides(header: SafetensorsHeader) -> None:
    """MindSpore stores an int4 tensor as its packed int8 bytes and says so in `__metadata__`
    (`{name: "Int4"}`); read as int8 it would be another tensor, so it is refused."""
    if header.metadata.get("format") != "ms":
        return
    for key in [k for k in header.entries if header.metadata.get(k) == "Int4"]:
        del header.entries[key]
        header.unsupported[key] = ("MindSpore int4, stored as packed int8 bytes (__metadata__ says Int4): "
                                   "hpckpt does not carry int4")


def _parse_entries(header: SafetensorsHeader, doc: dict) -> list[TensorInfo]:
    """Fill `header`; return the well-formed entries hpckpt cannot represent (their bytes still
    count in the layout check)."""
    buffer_size = header.file_size - header.data_start
    spans: list[TensorInfo] = []
    past_end: list[tuple[int, str]] = []  # (end, key) of entries whose bytes the file does not reach
    for key, spec in doc.items():
        if key == "__metadata__":
            if not isinstance(spec, dict) or not all(isinstance(v, str) for v in spec.values()):
                header.problems.append("__metadata__ must map strings to strings")
            else:
                header.metadata = dict(spec)
            continue
        try:
            dtype = dtypes.from_safetensors(spec["dtype"])
            shape = tuple(spec["shape"])
            begin, end = spec["data_offsets"]
        except UnknownFormatError as exc:
            header.problems.append(f"tensor {key!r}: {exc.message}")
            continue
        except (KeyError, TypeError, ValueError):
            header.problems.append(f"tensor {key!r}: entry needs dtype, shape and data_offsets [begin, end]")
            continue
        if type(begin) is not int or type(end) is not int or not _is_shape(shape):
            header.problems.append(f"tensor {key!r}: shape and data_offsets must be non-negative integers "
                                   "(dims below 2^63)")
            continue
        expected = _nbytes(dtype, shape)
        if end - begin != expected:
            header.problems.append(
                f"tensor {key!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                f"but {dtype.safetensors}{list(shape)} needs {expected}"
            )
            continue
        if begin < 0:
            header.problems.append(f"tensor {key!r}: data_offsets [{begin}, {end}] start before the data buffer")
            continue
        if end > buffer_size:
            past_end.append((end, key))
            continue
        shape, why = _element_shape(dtype, shape)
        info = TensorInfo(key, dtype, shape, header.data_start + begin, header.data_start + end)
        if why:
            header.unsupported[key] = why
            spans.append(info)
        else:
            header.entries[key] = info
    if past_end:  # one problem for the file, what it is and what it should be, not one per tensor
        end, key = max(past_end)
        header.problems.insert(0, f"truncated: {header.file_size} of {header.data_start + end} bytes (the header "
                                  f"places {len(past_end)} tensor(s) past the end, the last {key!r})")
    return spans


def _nbytes(dtype: DType, shape: tuple[int, ...]) -> int | str:
    """Bytes of a header entry (its shape counts values); a text when they are no whole number,
    which the safetensors library refuses too."""
    bits = math.prod(shape) * dtype.itemsize * 8 // dtype.safetensors_pack
    return bits // 8 if bits % 8 == 0 else f"{bits} bits, not a whole number of bytes"


def _element_shape(dtype: DType, shape: tuple[int, ...]) -> tuple[tuple[int, ...], str | None]:
    """A header shape in hpckpt's elements (byte groups of packed codes), or why it has none."""
    pack = dtype.safetensors_pack
    if pack == 1:
        return shape, None
    if not shape or shape[-1] % pack:
        return shape, (f"dtype {dtype.safetensors} not supported with shape {list(shape)}: hpckpt copies "
                       f"whole bytes of {pack} values, and the last dimension is not a multiple of {pack}")
    return shape[:-1] + (shape[-1] // pack,), None


def header_shape(dtype: DType, shape: tuple[int, ...]) -> list[int]:
    """The shape a safetensors header records for a tensor of hpckpt's `shape` (values, not groups)."""
    if dtype.safetensors_pack == 1:
        return list(shape)
    return [*shape[:-1], shape[-1] * dtype.safetensors_pack]


INT64_MAX = (1 << 63) - 1


def _is_shape(shape: tuple) -> bool:
    """Non-negative ints that fit int64 (a dim of 2^64 next to a 0 holds no bytes, but chunk
    arrays are int64, and the safetensors library refuses dims beyond usize)."""
    for s in shape:
        if type(s) is not int or s < 0 or s > INT64_MAX:
            return False
    return True


def _check_layout(header: SafetensorsHeader, unsupported: list[TensorInfo]) -> None:
    """Entries must tile the data buffer from 0 to its end, without holes or overlaps."""
    position = header.data_start
    for info in sorted([*header.entries.values(), *unsupported], key=lambda i: (i.begin, i.end)):
        if info.begin < position:
            header.problems.append(f"tensor {info.key!r} overlaps the previous tensor's bytes")
        elif info.begin > position:
            header.problems.append(f"{info.begin - position} bytes of hole before tensor {info.key!r}")
        position = max(position, info.end)
    if position < header.file_size and not header.problems:
        header.problems.append(f"{header.file_size - position} trailing bytes after the last tensor")


def is_safetensors(path: Path) -> bool:
    """Cheap sniff: a plausible header length followed by '{'."""
    try:
        with input_files.open_file(path) as f:
            head = f.read(9)
            size = file_size(f)
    except (OSError, HpckptError):
        return False
    return looks_like_safetensors(head, size)


def looks_like_safetensors(head: bytes, size: int) -> bool:
    """The sniff on bytes a caller has read already: the file's first 9 (or more) and its size."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and 8 + n <= size


def encode_header(entries: "list[tuple[str, DType, tuple[int, ...]]]",
                  metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The 8-byte length and JSON header of a file holding `entries` `(key, dtype, shape)` in that
    order, and each entry's data offset in the file. The header is padded with spaces to a
    multiple of 8 bytes, so the data is 8-byte aligned, as the safetensors library does.

    Raises:
        UnsupportedDTypeError: an entry's dtype has no safetensors code (complex128, bits8...).
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offsets, position = [], 0
    for key, dtype, shape in entries:
        dtypes.check_holds(dtype, "safetensors", f"tensor {key!r}")
        if dtype.safetensors_pack > 1 and not shape:
            raise dtypes.refuse(dtype, f"tensor {key!r}", f"a 0-d tensor of {dtype.safetensors_pack}-value "
                                "byte groups has no safetensors shape")
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": dtype.safetensors, "shape": header_shape(dtype, shape),
                       "data_offsets": [position, position + nbytes]}
        offsets.append(position)
        position += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, [start + o for o in offsets]


def write_file(path: Path, tensors: "list[tuple[str, DType, tuple[int, ...], bytes | memoryview]]",
               metadata: dict[str, str] | None = None) -> None:
    """Write a small safetensors file from raw little-endian bytes, in the order given.

    For test-sized writes; the engine streams real outputs. Taking raw bytes avoids the
    safetensors library's numpy path, which writes non-contiguous arrays wrongly (0.8.0) and
    cannot express bfloat16.
    """
    for key, dtype, shape, data in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        if len(memoryview(data).cast("B")) != nbytes:
            raise ValueError(f"{key}: {len(memoryview(data).cast('B'))} bytes for {dtype}{list(shape)} ({nbytes} needed)")
    head, _offsets = encode_header([(key, dtype, shape) for key, dtype, shape, _data in tensors], metadata)
    with open(path, "wb") as f:
        f.write(head)
        for _key, _dtype, _shape, data in tensors:
            f.write(memoryview(data).cast("B"))
