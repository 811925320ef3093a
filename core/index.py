"""`CheckpointIndex`: the framework-free view of any checkpoint that every command works on.

An adapter (one per format, in `hpckpt.converters`) parses a checkpoint's metadata into an index:
tensors with their global shape and stored chunks (boxes plus the file and key holding them), and
non-tensor values with the byte range holding them. Where the bytes of a chunk start inside its
file is resolved lazily through the adapter's `Locator`, so listing a checkpoint never opens its
data files.

An index is also what the engine copies from, and a source has two kinds of chunks: bytes in a
file (`Location`) and arrays in memory (`BufferLocation`, see `core.io.memory_source`), so the same
writers serve an offline conversion and a running job's save.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from hpckpt.core.dtypes import DType
from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.geometry.box import Box
from hpckpt.core.paths import resolve_inside


def int_rows(rows: Sequence[Sequence[int]], ndim: int, what: str = "a chunk") -> np.ndarray:
    """Equal-length int sequences (box offsets or sizes) as an int64 array `[len(rows), ndim]`.

    Raises:
        CorruptMetadataError: a row's length is not `ndim` (a chunk with other dims than its tensor),
            which would otherwise misalign every row after it.
    """
    if set(map(len, rows)) - {ndim}:
        bad = next(r for r in rows if len(r) != ndim)
        raise CorruptMetadataError(f"{what}: offsets or sizes {list(bad)} have {len(bad)} dims, its tensor {ndim}")
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=len(rows) * ndim).reshape(len(rows), ndim)


@dataclass(frozen=True, slots=True)
class Location:
    """Where a stored chunk's elements are: absolute byte offset of element 0 and its layout.

    `strides` are in elements (None: C-contiguous in `shape`). `stored_dtype`/`stored_shape` are
    what the data file itself says, which `verify` compares with the metadata. `checksum` is
    `(offset, nbytes, crc32)` of a byte range holding the chunk whose CRC-32 the format stores
    (a torch.save storage's zip member): the engine checks it for every range it copies from.
    """

    path: Path
    offset: int
    nbytes: int
    stored_dtype: DType
    stored_shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    checksum: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class BufferLocation:
    """A stored chunk held in memory: `array` has the chunk's shape and the numpy storage dtype
    of `stored_dtype` (raw bits for bfloat16/float8); any strides."""

    array: Any
    stored_dtype: DType

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass(slots=True)
class Chunk:
    """A stored box of a tensor and the file (relative path) and key that hold it."""

    box: Box
    file: str
    key: str


class TensorEntry:
    """A tensor: canonical dtype, global shape and its stored chunks.

    Adapters may pass `build` instead of `chunks`: the chunk list is then made on first use, so
    listing a checkpoint with hundreds of thousands of chunks creates none of them.
    """

    __slots__ = ("fqn", "dtype", "shape", "dtype_spelling", "n_chunks", "layout_hint", "_chunks", "_build",
                 "_build_arrays", "_build_files")

    def __init__(self, fqn: str, dtype: DType, shape: tuple[int, ...], chunks: list[Chunk] | None = None,
                 dtype_spelling: str = "", *, build: Callable[[], list[Chunk]] | None = None,
                 n_chunks: int | None = None, build_arrays: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None,
                 build_files: Callable[[Sequence[int] | None], list[str]] | None = None):
        self.fqn = fqn
        self.dtype = dtype
        self.shape = shape
        self.dtype_spelling = dtype_spelling  # as written in the metadata: "torch.float32", "Float32"
        self._chunks = chunks
        self._build = build
        self._build_arrays = build_arrays
        self._build_files = build_files
        self.layout_hint: str | None = None  # the inferred layout, when a snapshot already knows it
        self.n_chunks = len(chunks) if chunks is not None else int(n_chunks or 0)

    @property
    def chunks(self) -> list[Chunk]:
        if self._chunks is None:
            self._chunks = self._build() if self._build else []
            self._build = None
        return self._chunks

    @property
    def boxes(self) -> list[Box]:
        """The stored boxes alone; cheaper than `chunks` when the adapter can list them directly."""
        if self._chunks is None and self._build_arrays is not None:
            offsets, sizes = self._build_arrays()
            return [Box(tuple(o), tuple(z)) for o, z in zip(offsets.tolist(), sizes.tolist())]
        return [c.box for c in self.chunks]

    def chunk_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`(offsets, sizes)` of the stored chunks as int64 arrays `[n_chunks, ndim]`, in chunk
        order: what planning onto thousands of ranks works on, without an object per chunk."""
        if self._chunks is None and self._build_arrays is not None:
            return self._build_arrays()
        ndim, chunks = len(self.shape), self.chunks
        return int_rows([c.box.offsets for c in chunks], ndim), int_rows([c.box.sizes for c in chunks], ndim)

    def chunk_files(self, which: Sequence[int] | None = None) -> list[str]:
        """The file holding each stored chunk `which` (default: all, in chunk order)."""
        if self._chunks is None and self._build_files is not None:
            return self._build_files(which)
        chunks = self.chunks
        return [c.file for c in chunks] if which is None else [chunks[i].file for i in which]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def __repr__(self) -> str:
        return f"TensorEntry({self.fqn!r}, {self.dtype}, {list(self.shape)}, {self.n_chunks} chunks)"


@dataclass(slots=True)
class ValueEntry:
    """A non-tensor value: `length` bytes at `offset` of `file`, encoded as `encoding`.

    Encodings: "pickle" (HyperParallel `.bytes`), "torch_save" (a torch.save record, PyTorch DCP).
    """

    fqn: str
    file: str
    offset: int
    length: int
    encoding: str = "pickle"


def parse_range_key(key: str, fqn: str, error: type[Exception]) -> tuple[int, int]:
    """Adapters whose chunks are byte ranges of a file (PyTorch DCP records, .ckpt contents) key
    them `"offset:nbytes"`; a key that is not two integers is reported as `error`."""
    try:
        offset, nbytes = (int(part) for part in key.split(":"))
    except ValueError:
        raise error(f"{fqn}: chunk key {key!r} is not 'offset:nbytes'") from None
    return offset, nbytes


class Locator(Protocol):
    """What an adapter provides to reach the bytes behind an index."""

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location | BufferLocation:
        """Return where `chunk` lives. Raises MissingFileError/CorruptDataError/EntryMismatchError."""

    def decode_value(self, entry: ValueEntry) -> Any:
        """Return the Python value of a non-tensor entry, through the safe unpickler."""

    def file_problems(self, relative: str) -> list[str]:
        """Return structural problems of a data file (empty when sound), for `verify`."""


@dataclass
class CheckpointIndex:
    """Everything hpckpt knows about a checkpoint after reading its metadata only."""

    root: Path
    format: str  # a format name of the registry (converters.FORMATS), or "memory"
    format_version: str
    framework: str | None  # "torch", "mindspore" or None when it cannot be told
    tensors: dict[str, TensorEntry]
    values: dict[str, ValueEntry]
    data_files: list[str]  # relative paths of every file the metadata refers to, sorted
    locator: Locator
    metadata_files: list[str] = field(default_factory=list)
    world_size: int | None = None  # from file names (at least this many ranks saved), or exact:
    world_size_exact: bool = False  # what hpckpt's writer recorded (converters.hpckpt_json)
    planner_data: dict | None = None
    notes: list[str] = field(default_factory=list)  # what `inspect` says about it
    # what every command writing from it repeats as a warning: a file that is one piece of a
    # larger checkpoint, entries stored twice, metadata that could not be carried
    warnings: list[str] = field(default_factory=list)
    # a safetensors source's own `__metadata__` keys, which safetensors and hf outputs carry on
    user_metadata: dict[str, str] = field(default_factory=dict)

    def data_path(self, name: str) -> Path:
        """Where data file `name` lies: inside the checkpoint or, for a format whose saves may be
        incremental (the locator says so), in a checkpoint beside it (`core.paths.resolve_inside`)."""
        return resolve_inside(self.root, name, getattr(self.locator, "siblings", False))

    @property
    def baselines(self) -> list[str]:
        """The checkpoints beside this one that an incremental save points into (`../NAME`)."""
        names = {f.split("/")[1] for f in self.data_files if f.startswith("../") and f.count("/") >= 2}
        return sorted(f"../{n}" for n in names - {"", ".", ".."})  # (those only refused: `resolve_inside`)

    def locate(self, chunk: Chunk, entry: TensorEntry) -> Location | BufferLocation:
        return self.locator.locate(chunk, entry)

    def decode_value(self, fqn: str) -> Any:
        return self.locator.decode_value(self.values[fqn])
