"""What a torch.save record's objects become without torch: a tensor is a `TensorRecord` (its
dtype, shape, strides and first byte), an `io.BytesIO` its bytes.

Readers turn tensor records into `Location`s for the engine; writers use the same stride rules,
so both sides agree with torch on what a contiguous tensor is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpckpt.core.dtypes import DType
from hpckpt.core.errors import CorruptDataError, UnsafePickleError
from hpckpt.core.index import Location
from hpckpt.core.nesting import replace_leaves
from hpckpt.core.safety.pickle_budget import charge, register_leaf
from hpckpt.core.storage.urls import as_path


@dataclass(frozen=True)
class TensorRecord:
    """A tensor inside a torch.save record: where its element [0, ..., 0] is and how it is laid out."""

    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    offset: int  # absolute byte offset in the outer file of element [0, ..., 0]
    storage_nbytes: int  # bytes of the storage member holding the tensor
    storage_offset: int = -1  # absolute byte offset of that member's data (-1: unknown)
    storage_crc: int | None = None  # the CRC-32 its zip entry records

    @property
    def is_contiguous(self) -> bool:
        return _same_layout_as_contiguous(self.shape, self.strides)

    @property
    def nbytes(self) -> int:
        """Bytes from `offset` to the end of the last element (the span a reader must fetch)."""
        return span_elements(self.shape, self.strides) * self.dtype.itemsize

    def location(self, path: "Path | str") -> Location:
        """Return the `Location` a generic reader needs; strides only when not C-contiguous."""
        return Location(
            path=as_path(path),
            offset=self.offset,
            nbytes=self.nbytes,
            stored_dtype=self.dtype,
            stored_shape=self.shape,
            strides=None if self.is_contiguous else self.strides,
            checksum=(self.storage_offset, self.storage_nbytes, self.storage_crc)
            if self.storage_crc is not None and self.storage_offset >= 0 else None,
        )


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements, as torch computes them (a size-0/1 dim still counts as 1)."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _same_layout_as_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when the view addresses the same bytes as a row-major one (size-0/1 dims may differ)."""
    if 0 in shape:
        return True
    expected = contiguous_strides(shape)
    return all(s == e for n, s, e in zip(shape, strides, expected) if n != 1)


def span_elements(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Number of elements from the first to the last addressed one (0 for an empty tensor)."""
    if 0 in shape:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


@dataclass(frozen=True)
class TorchDevice:
    """A `torch.device` inside a saved value (`torch.device("cuda", 0)` is `TorchDevice("cuda:0")`):
    kept as what it is, so that writers that can (torch.save, PyTorch DCP) save it as a device
    again and the others report it converted, never pass its string off as the same value."""

    spec: str

    def __str__(self) -> str:
        return self.spec

    @classmethod
    def unpickled(cls, *args: Any) -> "TorchDevice":
        """What `torch.device(type)` / `torch.device(type, index)` in a pickle becomes."""
        if not 1 <= len(args) <= 2 or not isinstance(args[0], str) or (len(args) == 2 and type(args[1]) is not int):
            raise UnsafePickleError(f"refusing torch.device{args!r}: only device(type) and device(type, index)")
        return cls(":".join(str(a) for a in args))


register_leaf(TensorRecord, TorchDevice)  # the pickle budget's walk need not enter them


def is_tensor_record(value: Any) -> bool:
    """What flattening a torch.save record treats as a tensor leaf (`core.nesting`)."""
    return isinstance(value, TensorRecord)


class BytesIOState:
    """Stand-in for `io.BytesIO`: PyTorch DCP's default planner torch.saves a state dict's
    `io.BytesIO` whole; hpckpt reads its content as `bytes` (see `without_bytes_io`)."""

    content = b""

    def __setstate__(self, state: Any) -> None:
        if not (isinstance(state, tuple) and state and isinstance(state[0], (bytes, bytearray))):
            raise CorruptDataError(f"io.BytesIO state {type(state).__name__} does not start with its bytes")
        if type(state[0]) is not bytes:  # copied (bytes are shared)
            charge(len(state[0]), "io.BytesIO content")
        self.content = bytes(state[0])


def without_bytes_io(tree: Any) -> Any:
    """`tree` with every BytesIO stand-in replaced by its bytes."""
    return replace_leaves(tree, {BytesIOState: lambda stand_in: stand_in.content})
