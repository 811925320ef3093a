"""Pickles that `torch.load(weights_only=True)` reads, built opcode by opcode, without torch.

The stock Pickler would need torch's own classes to name `torch._utils._rebuild_tensor_v2`,
storages and dtypes; here each opcode is written by hand, so the torch.save archives of `pt` and
`torch-dcp` outputs and PyTorch DCP's `.metadata` are produced in a process that never imports
torch. Only opcodes torch's weights_only unpickler implements are used.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections import OrderedDict
from typing import Any, Iterable

from hpckpt.core import dtypes
from hpckpt.core.codecs.torch_records import TorchDevice, contiguous_strides
from hpckpt.core.dtypes import DType

_U32_MAX = 0xFFFFFFFF

class PickleBuilder:
    """Protocol-2 opcodes written by hand: the stock Pickler would import torch to name its globals.

    Only opcodes torch's weights_only unpickler implements are used (no BINBYTES, no FRAME); bytes
    go through `_codecs.encode` as protocol 2 does. Globals and constant strings are memoized.
    """

    def __init__(self) -> None:
        self.body = bytearray()
        self._memo: dict[tuple[str, str], int] = {}

    def checkpoint(self) -> tuple[int, int]:
        return len(self.body), len(self._memo)

    def rollback(self, mark: tuple[int, int]) -> None:
        """Undo a value that failed half-way, so the builder stays consistent."""
        size, memo_size = mark
        del self.body[size:]
        self._memo = {k: i for k, i in self._memo.items() if i < memo_size}

    def _memoized(self, key: tuple[str, str], emit: Any) -> None:
        """Emit once and remember; later uses fetch it from the memo (smaller pickles)."""
        index = self._memo.get(key)
        if index is not None:
            self._memo_op(pickle.BINGET, pickle.LONG_BINGET, index)
            return
        emit()
        self._memo[key] = index = len(self._memo)
        self._memo_op(pickle.BINPUT, pickle.LONG_BINPUT, index)

    def _memo_op(self, short: bytes, long: bytes, index: int) -> None:
        self.body += short + bytes([index]) if index < 256 else long + struct.pack("<I", index)

    def global_(self, module: str, name: str) -> None:
        line = f"{module}\n{name}\n".encode("ascii")
        self._memoized(("global", f"{module}.{name}"), lambda: self.body.extend(pickle.GLOBAL + line))

    def const(self, text: str) -> None:
        self._memoized(("str", text), lambda: self.string(text))

    def string(self, text: str) -> None:
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw) > _U32_MAX:
            raise ValueError("string longer than 4 GiB")
        self.body += pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw

    def integer(self, value: int) -> None:
        if 0 <= value < 0x100:
            self.body += pickle.BININT1 + bytes([value])
        elif 0 <= value < 0x10000:
            self.body += pickle.BININT2 + struct.pack("<H", value)
        elif -0x80000000 <= value < 0x80000000:
            self.body += pickle.BININT + struct.pack("<i", value)
        else:
            raw = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
            if len(raw) > 255:
                raise ValueError(f"integer of {len(raw)} bytes: torch's weights_only loader reads at most 255")
            self.body += pickle.LONG1 + bytes([len(raw)]) + raw

    def tuple_of(self, items: Iterable[Any], emit: Any) -> None:
        """A tuple whose items `emit` writes; the short forms torch's pickles use too."""
        items = list(items)
        if not items:
            self.body += pickle.EMPTY_TUPLE
            return
        short = len(items) <= 3
        if not short:
            self.body += pickle.MARK
        for item in items:
            emit(item)
        self.body += (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[len(items) - 1] if short else pickle.TUPLE

    def call(self, module: str, name: str, args: list[Any], emit: Any) -> None:
        """`module.name(*args)`: a global, a tuple of arguments, REDUCE."""
        self.global_(module, name)
        self.tuple_of(args, emit)
        self.body += pickle.REDUCE

    def tensor(self, dtype: DType, shape: tuple[int, ...], key: str) -> None:
        """`_rebuild_tensor_v2/v3(storage, 0, shape, strides, False, OrderedDict()[, dtype])`.

        Old dtypes go through their legacy typed storage (`DType.torch_storage`), as torch.save
        writes them; every other one through UntypedStorage and `_rebuild_tensor_v3`.

        Raises:
            UnsupportedDTypeError: torch.save cannot hold `dtype` (no torch dtype, quantized...).
        """
        dtypes.check_holds(dtype, "torch-save", "torch.save")  # the caller knows the tensor's name
        typed = dtype.torch_storage
        self.global_("torch._utils", "_rebuild_tensor_v2" if typed else "_rebuild_tensor_v3")
        self.body += pickle.MARK
        self._storage_pid(dtype, shape, key, typed)
        self.integer(0)
        self.tuple_of(shape, self.integer)
        self.tuple_of(contiguous_strides(shape), self.integer)
        self.body += pickle.NEWFALSE
        self.call("collections", "OrderedDict", [], None)
        if not typed:
            self.global_("torch", dtype.name)
        self.body += pickle.TUPLE + pickle.REDUCE

    def _storage_pid(self, dtype: DType, shape: tuple[int, ...], key: str, typed: str | None) -> None:
        """Persistent id `('storage', storage type, key, 'cpu', numel)`; untyped numel is bytes."""
        numel = math.prod(shape)
        self.body += pickle.MARK
        self.const("storage")
        if typed:
            self.global_("torch", typed)  # e.g. "FloatStorage"
        else:
            self.global_("torch.storage", "UntypedStorage")
        self.string(key)
        self.const("cpu")
        self.integer(numel if typed else numel * dtype.itemsize)
        self.body += pickle.TUPLE + pickle.BINPERSID

    def value(self, value: Any, where: str, active: frozenset[int] = frozenset()) -> None:
        """A plain value that `torch.load(weights_only=True)` accepts; anything else is refused."""
        kind = type(value)
        if kind in _SCALARS:
            _SCALARS[kind](self, value)
            return
        emit = _CONTAINERS.get(kind)
        if emit is None:
            raise TypeError(f"{where}: cannot save a {kind.__module__}.{kind.__qualname__}; "
                            "torch.load(weights_only=True) accepts plain Python values only")
        if id(value) in active:
            raise ValueError(f"{where}: the value contains itself")
        emit(self, value, where, active | {id(value)})

    def _tuple(self, value: tuple, where: str, active: frozenset[int]) -> None:
        self.tuple_of(range(len(value)), lambda i: self.value(value[i], f"{where}[{i}]", active))

    def _list(self, value: list, where: str, active: frozenset[int]) -> None:
        self.body += pickle.EMPTY_LIST
        if value:
            self.body += pickle.MARK
            for i, item in enumerate(value):
                self.value(item, f"{where}[{i}]", active)
            self.body += pickle.APPENDS

    def _dict_items(self, value: dict, where: str, active: frozenset[int]) -> None:
        if not value:
            return
        self.body += pickle.MARK
        for key, item in value.items():
            self.value(key, f"{where} key {key!r}", active)
            self.value(item, f"{where}[{key!r}]", active)
        self.body += pickle.SETITEMS

    def _dict(self, value: dict, where: str, active: frozenset[int]) -> None:
        self.body += pickle.EMPTY_DICT
        self._dict_items(value, where, active)

    def _ordered_dict(self, value: OrderedDict, where: str, active: frozenset[int]) -> None:
        self.call("collections", "OrderedDict", [], None)
        self._dict_items(value, where, active)

    def _set(self, value: set, where: str, active: frozenset[int]) -> None:
        self.global_("builtins", "set")
        self._list(list(value), where, active)
        self.body += pickle.TUPLE1 + pickle.REDUCE

    def _bytes(self, value: bytes) -> None:
        """`_codecs.encode(latin-1 text, 'latin1')`: protocol 2's spelling of bytes."""
        self.global_("_codecs", "encode")
        self.string(value.decode("latin-1"))
        self.const("latin1")
        self.body += pickle.TUPLE2 + pickle.REDUCE

    def _bytearray(self, value: bytearray) -> None:
        self.global_("builtins", "bytearray")
        self._bytes(bytes(value))
        self.body += pickle.TUPLE1 + pickle.REDUCE

    def _complex(self, value: complex) -> None:
        self.call("builtins", "complex", [value.real, value.imag], self._float)

    def _float(self, value: float) -> None:
        self.body += pickle.BINFLOAT + struct.pack(">d", value)

    def _bool(self, value: bool) -> None:
        self.body += pickle.NEWTRUE if value else pickle.NEWFALSE

    def _none(self, _value: None) -> None:
        self.body += pickle.NONE

    def _bytes_io(self, value: io.BytesIO) -> None:
        """An `io.BytesIO`, as torch.save pickles one: `BytesIO.__new__`, then its state (content,
        position, no dict). Not for `weights_only=True` (torch DCP loads its values with
        `weights_only=False`; hpckpt's unpickler reads the content as bytes)."""
        self.global_("_io", "BytesIO")
        self.body += pickle.EMPTY_TUPLE + pickle.NEWOBJ
        self._bytes(value.getvalue())
        self.integer(value.tell())
        self.body += pickle.NONE + pickle.TUPLE3 + pickle.BUILD

    def _dtype(self, value: DType) -> None:
        """A torch dtype as a value (`torch.float32`), as torch pickles it."""
        if not value.in_torch:
            raise TypeError(f"torch has no dtype {value}")
        self.global_("torch", value.name)

    def _device(self, value: TorchDevice) -> None:
        kind, _, index = value.spec.partition(":")
        self.call("torch", "device", [kind, int(index)] if index else [kind], lambda v: self.value(v, "device"))


def torch_loadable(value: Any, where: str) -> tuple[Any, str | None, str | None]:
    """`(value to write, why it was converted, why it cannot be written)` for a value going into
    a torch.save record: numpy scalars become the Python numbers torch's weights_only loader
    reads (a conversion, reported); what it cannot read at all (a numpy array, a datetime) is
    skipped with the reason, never an internal error."""
    converted: list[str] = []

    def plain(v: Any) -> Any:
        if type(v).__module__ == "numpy" and hasattr(v, "item") and getattr(v, "ndim", None) == 0:
            converted.append(type(v).__name__)
            return v.item()
        if type(v) in (list, tuple, set):
            return type(v)(plain(x) for x in v)
        if type(v) in (dict, OrderedDict):
            return type(v)((plain(k), plain(x)) for k, x in v.items())
        return v

    data = plain(value)
    try:
        PickleBuilder().value(data, where)
    except (TypeError, ValueError) as exc:
        return None, None, str(exc).removeprefix(f"{where}: ")
    note = f"numpy {', '.join(sorted(set(converted)))} stored as Python numbers" if converted else None
    return data, note, None


def loadable_values(values: Iterable[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], list, list]:
    """The `(fqn, value)` a torch.save record can hold, as they will be written, and the
    `(fqn, reason)` of those skipped and of those converted (`torch_loadable`)."""
    kept, skipped, converted = [], [], []
    for fqn, value in values:
        data, note, why = torch_loadable(value, fqn)
        if why is not None:
            skipped.append((fqn, why))
            continue
        if note is not None:
            converted.append((fqn, note))
        kept.append((fqn, data))
    return kept, skipped, converted


def standalone_pickle(value: Any, where: str = "value") -> bytes:
    """One value as a complete protocol-2 pickle (what `torch.save`'s data.pkl holds for it)."""
    builder = PickleBuilder()
    builder.value(value, where)
    return pickle.PROTO + b"\x02" + bytes(builder.body) + pickle.STOP


# Exact types only: a subclass (IntEnum, defaultdict...) would load back as something else.
_SCALARS = {
    type(None): PickleBuilder._none, bool: PickleBuilder._bool, int: PickleBuilder.integer,
    float: PickleBuilder._float, complex: PickleBuilder._complex, str: PickleBuilder.string,
    bytes: PickleBuilder._bytes, bytearray: PickleBuilder._bytearray, io.BytesIO: PickleBuilder._bytes_io,
    DType: PickleBuilder._dtype, TorchDevice: PickleBuilder._device,
}
_CONTAINERS = {
    tuple: PickleBuilder._tuple, list: PickleBuilder._list, dict: PickleBuilder._dict,
    OrderedDict: PickleBuilder._ordered_dict, set: PickleBuilder._set,
}
