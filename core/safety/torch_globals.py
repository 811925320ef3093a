"""What the globals a torch.save pickle names stand for, without torch: tensors rebuilt as
`TensorRecord`s over the archive's storages, and the few other objects such records hold.

This is the allow-list of `core.codecs.torch_zip`'s unpickler (on top of `core.safety.unpickle.safe_global`):
a global not in `RECORD_GLOBALS` is refused, never imported.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

from hpckpt.core import dtypes
from hpckpt.core.codecs.metadata_schema import check_ints, check_shape
from hpckpt.core.codecs.torch_records import BytesIOState, TensorRecord, span_elements
from hpckpt.core.dtypes import DType
from hpckpt.core.errors import CorruptDataError, CorruptMetadataError, UnknownFormatError, UnsafePickleError
from hpckpt.core.safety.allow_list import check_encoding, safe_global
from hpckpt.core.safety.pickle_budget import describe


@dataclass(frozen=True)
class Storage:
    """A storage the pickle referred to: its dtype (None: untyped) and where its bytes are."""

    dtype: DType | None
    data_offset: int  # absolute, in the outer file
    nbytes: int
    crc: int | None = None  # the CRC-32 of its bytes, as the zip directory records it


@dataclass(frozen=True)
class StorageType:
    """What `torch.FloatStorage` & co. resolve to: only their element type matters here."""

    dtype: DType | None



# Storage classes torch.save names: the legacy typed storages of the table's `torch_storage`
# column (quantized ones included, so that they are refused as a dtype, not as an unsafe pickle),
# and UntypedStorage, whose tensors name their dtype in `_rebuild_tensor_v3`.
def _storage_types() -> dict[tuple[str, str], StorageType]:
    table = {("torch", d.torch_storage): StorageType(d) for d in dtypes.all_dtypes() if d.torch_storage}
    for module in ("torch", "torch.storage"):
        table[(module, "UntypedStorage")] = StorageType(None)
    return table


def _rebuild_qtensor(storage, storage_offset, size, stride, *_ignored) -> TensorRecord:
    """`torch._utils._rebuild_qtensor`: kept as a record of its quantized dtype, which every
    format refuses; its bytes are not checked (quint4x2 packs two values per byte)."""
    if not isinstance(storage, Storage) or storage.dtype is None or storage.dtype.refusal is None:
        raise CorruptDataError("_rebuild_qtensor on a storage that is not a quantized one")
    shape = check_shape(size, storage.dtype.itemsize, "a quantized tensor record")
    strides = check_ints(stride, "a quantized tensor record: stride")
    offset = storage.data_offset + check_ints((storage_offset,), "a quantized tensor record: offset")[0] * \
        storage.dtype.itemsize
    return TensorRecord(storage.dtype, shape, strides, offset, storage.nbytes, storage.data_offset, storage.crc)


# The quantization schemes a quantized tensor's parameters name (kept as their names).
_QSCHEMES = ("per_tensor_affine", "per_channel_affine", "per_tensor_symmetric",
             "per_channel_symmetric", "per_channel_affine_float_qparams")


class _TensorType:
    """Stand-in for `torch.Tensor`/`torch.nn.Parameter` as the type argument of a rebuild."""


def _tensor(storage: Storage, storage_offset: int, size: Any, stride: Any, dtype: DType | None) -> TensorRecord:
    """Build a TensorRecord and check that the view it describes lies inside its storage."""
    if not isinstance(storage, Storage):
        raise CorruptDataError(f"tensor rebuilt from {type(storage).__name__}, not from a storage")
    dtype = dtype or storage.dtype
    if dtype is None:
        raise CorruptDataError("tensor on an untyped storage without a dtype")
    shape = check_shape(size, dtype.itemsize, "a tensor record")
    strides = check_ints(stride, "a tensor record: stride")
    if type(storage_offset) is not int:
        raise CorruptMetadataError(f"a tensor record: storage offset {describe(storage_offset)} is not an int")
    if len(shape) != len(strides) or min(shape + strides + (storage_offset,), default=0) < 0:
        raise CorruptDataError(f"tensor view size={shape} stride={strides} offset={storage_offset} is invalid")
    end = (storage_offset + span_elements(shape, strides)) * dtype.itemsize
    if math.prod(shape) and end > storage.nbytes:
        raise CorruptDataError(
            f"tensor view size={shape} stride={strides} offset={storage_offset} needs {end} bytes "
            f"of a {storage.nbytes}-byte storage"
        )
    return TensorRecord(dtype, shape, strides, storage.data_offset + storage_offset * dtype.itemsize, storage.nbytes,
                        storage.data_offset, storage.crc)


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored) -> TensorRecord:
    """`torch._utils._rebuild_tensor(_v2)`: requires_grad, hooks and metadata do not matter here."""
    return _tensor(storage, storage_offset, size, stride, None)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, *_ignored) -> TensorRecord:
    """`torch._utils._rebuild_tensor_v3`: an untyped storage plus an explicit dtype (float8, uint16...)."""
    if not isinstance(dtype, DType):
        raise CorruptDataError(f"_rebuild_tensor_v3 got dtype {dtype!r}")
    return _tensor(storage, storage_offset, size, stride, dtype)


def _rebuild_parameter(data, *_ignored) -> Any:
    """A Parameter is its data tensor; requires_grad, hooks and Python state are dropped."""
    return data


def _rebuild_from_type_v2(func, new_type, args, state) -> Any:
    """A tensor with Python attributes: rebuild the plain tensor, drop the attributes."""
    if new_type is not _TensorType:
        raise UnsafePickleError(f"refusing tensor subclass {new_type!r}")
    return func(*args)


def _bytes(*args: Any) -> bytes:
    """`bytes()`, which protocol 2 pickles `b""` as; never of a size (`bytes(10**12)`)."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise UnsafePickleError("refusing bytes() of a size: only bytes() and bytes(bytes) are allowed")
    if len(args) > 1:
        check_encoding(args[1], "bytes()")
    return bytes(*args)


# (an allow-list table like core/safety/allow_list.py's: these are the globals only torch.save records name)
RECORD_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType,
    ("torch.nn.parameter", "Parameter"): _TensorType,
    ("_io", "BytesIO"): BytesIOState,
    ("io", "BytesIO"): BytesIOState,
    ("builtins", "bytes"): _bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_qtensor"): _rebuild_qtensor,
    **{("torch", q): q for q in _QSCHEMES},
    **_storage_types(),
}


# Known torch objects hpckpt does not rebuild: a tensor subclass pickled whole (a DTensor inside a
# value PyTorch DCP saved with `flatten_state_dict=False`) is refused as such, not as unsafe.
_TENSOR_SUBCLASSES = {("torch._utils", "_rebuild_wrapper_subclass"), ("torch.distributed.tensor", "DTensor"),
                      ("torch.distributed.tensor._api", "DTensor"), ("torch.distributed._tensor.api", "DTensor"),
                      ("torch.distributed.device_mesh", "DeviceMesh")}


def record_global(module: str, name: str) -> Any:
    """Resolver for torch.save pickles: tensor rebuilds and storage types, then `safe_global`."""
    if (module, name) in _TENSOR_SUBCLASSES:
        raise UnknownFormatError(f"{module}.{name}: a tensor subclass (such as a DTensor) pickled whole inside a "
                                 "value, which hpckpt does not read", hint="save with the default planner "
                                 "(flatten_state_dict=True), which stores a DTensor's shards as items")
    try:
        return RECORD_GLOBALS[(module, name)]
    except KeyError:
        return safe_global(module, name)
