"""Where a tensor lies inside a torch.save record: its dtype, shape, strides and first byte.

Readers turn these into `Location`s for the engine; writers use the same stride rules, so both
sides agree with torch on what a contiguous tensor is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpckpt.core.dtypes import DType
from hpckpt.core.index import Location


@dataclass(frozen=True)
class TensorRecord:
    """A tensor inside a torch.save record: where its element [0, ..., 0] is and how it is laid out."""

    dtype: DType
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    offset: int  # absolute byte offset in the outer file of element [0, ..., 0]
    storage_nbytes: int  # bytes of the storage member holding the tensor

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
            path=Path(path),
            offset=self.offset,
            nbytes=self.nbytes,
            stored_dtype=self.dtype,
            stored_shape=self.shape,
            strides=None if self.is_contiguous else self.strides,
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
