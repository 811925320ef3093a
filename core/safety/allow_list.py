"""The allow-list of the safe unpickler: every global a checkpoint's pickle may name, and what
it becomes (plain Python, numpy arrays charged to the load's budget, hpckpt's own classes for
the metadata of HyperParallel and PyTorch DCP, our `DType` for torch dtypes). A name not here is
refused by `safe_global` with `UnsafePickleError`, before anything from the pickle is called.
"""

from __future__ import annotations

import collections
import datetime
import operator
import pathlib
from typing import Any, Callable

import numpy as np

from hpckpt.core import dtypes
from hpckpt.core.codecs.hyperparallel_metadata import HP_CLASSES
from hpckpt.core.codecs.torch_dcp_metadata import TORCH_DCP_CLASSES
from hpckpt.core.codecs.torch_records import BytesIOState, TorchDevice
from hpckpt.core.errors import UnsafePickleError
from hpckpt.core.nesting import replace_leaves
from hpckpt.core.safety.pickle_budget import allocations, charge, current_budget, over_budget, register_leaf


Resolver = Callable[[str, str], Any]


#: The encodings pickle itself writes text with (`_codecs.encode(text, "latin1")`, protocols 0-2).
PICKLE_ENCODINGS = frozenset(("latin1", "latin-1", "utf-8", "utf8", "ascii"))


def check_encoding(encoding: Any, what: str) -> str:
    """Only the encodings pickle uses: any other codec name runs codec lookup code (LookupError
    on an unknown one, bytes-to-bytes codecs on others)."""
    if not isinstance(encoding, str) or encoding.lower() not in PICKLE_ENCODINGS:
        raise UnsafePickleError(f"refusing {what} with encoding {str(encoding)[:40]!r}: only "
                                f"{', '.join(sorted(PICKLE_ENCODINGS))} are allowed")
    return encoding


def _encoded_size(text: str, encoding: Any) -> int:
    """At most what `text` takes encoded (utf-8: up to 4 bytes a character)."""
    return len(text) * (1 if str(encoding).lower() in ("latin1", "latin-1", "ascii") else 4)


def _encode(text: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """`_codecs.encode`, as pickle uses it: a str, one of pickle's encodings."""
    if not isinstance(text, str) or not isinstance(errors, str):
        raise UnsafePickleError("refusing _codecs.encode of something other than a str")
    check_encoding(encoding, "_codecs.encode")
    charge(_encoded_size(text, encoding), "_codecs.encode")
    return text.encode(encoding, errors)


def _bytearray(*args: Any) -> bytearray:
    """bytearray from bytes only: `bytearray(10**12)` in a 30-byte pickle would exhaust memory."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise UnsafePickleError("refusing bytearray() of a size: only bytearray(bytes) is allowed")
    if len(args) > 1:
        check_encoding(args[1], "bytearray()")
    if args:
        charge(_encoded_size(args[0], args[1] if len(args) > 1 else "utf-8") if isinstance(args[0], str)
               else len(args[0]), "bytearray()")
    return bytearray(*args)


#: What one element of a container costs (bytes, at most): its slot, and for sets and dicts the
#: spare room of their hash tables.
_SLOT, _SET_SLOT, _DICT_SLOT = 8, 64, 128
_SIZED = frozenset((list, tuple, dict, set, frozenset, str, bytes, bytearray, collections.OrderedDict))


def _elements(source: Any, what: str) -> tuple[int, int]:
    """(elements, bytes each creates besides its slot) of a container's source, without iterating
    it: a range makes an int a step, an array a numpy scalar or row view an element."""
    if type(source) in _SIZED:
        return len(source), 0
    if type(source) is range:
        return len(source), 32
    if isinstance(source, np.ndarray) and source.ndim:
        return len(source), 128
    raise UnsafePickleError(f"refusing {what}() of a {type(source).__name__}: only containers, strings and ranges")


def _charged_builtin(kind: type, slot: int) -> Callable[..., Any]:
    """The builtin `kind`, charging what `kind(source)` would allocate before it does.

    A function: pickles call these with REDUCE only (NEWOBJ of a function is refused as a
    malformed pickle)."""
    name = kind.__name__

    def charged(*args: Any, **kwargs: Any) -> Any:
        if args:
            source = args[0]
            n, made = (len(source), 0) if type(source) in _SIZED else _elements(source, name)
        else:
            n, made = 0, 0
        n += len(kwargs)
        ledger = allocations()
        ledger.used += n * (slot + made) + 64
        if ledger.used > ledger.limit:
            ledger.refuse(f"{name}() of {n:,} elements")
        return kind(*args, **kwargs)

    charged.__name__ = charged.__qualname__ = name
    return charged


_CHARGED_TUPLE, _LIST = _charged_builtin(tuple, _SLOT), _charged_builtin(list, _SLOT)


def _TUPLE(*args: Any) -> tuple:
    """`tuple`, and `torch.Size`: of a tuple (each size in PyTorch DCP metadata), that very tuple,
    nothing allocated and nothing charged."""
    if len(args) == 1 and type(args[0]) is tuple:
        return args[0]
    return _CHARGED_TUPLE(*args)
_SET, _FROZENSET = _charged_builtin(set, _SET_SLOT), _charged_builtin(frozenset, _SET_SLOT)
_DICT, _ORDERED_DICT = _charged_builtin(dict, _DICT_SLOT), _charged_builtin(collections.OrderedDict, _DICT_SLOT)


def _range(*args: Any) -> range:
    """`range()` within the budget: code that turns a shape into a tuple would allocate it."""
    made = range(*args)
    limit = current_budget().range
    try:
        length = len(made)
    except OverflowError:  # more than sys.maxsize elements
        span = abs(made.stop - made.start) // abs(made.step)
        raise over_budget(f"range() of {span:,} elements", span, "range", limit) from None
    if length > limit:
        raise over_budget(f"range() of {length:,} elements", length, "range", limit)
    return made


def _path_parts(parts: tuple) -> tuple:
    if not all(isinstance(part, str) for part in parts):
        raise UnsafePickleError("refusing a pathlib path of something other than strings")
    charge(sum(map(len, parts)) * 4 + 64, "a pathlib path")
    return parts


def _posix_path(*parts: str) -> str:
    return str(pathlib.PurePosixPath(*_path_parts(parts)))


def _windows_path(*parts: str) -> str:
    return str(pathlib.PureWindowsPath(*_path_parts(parts)))


def _checked_dtype(np: Any, dtype: Any, what: str) -> Any:
    """A numpy dtype without objects (an object array could hold anything) and of bounded size."""
    made = np.dtype(dtype)
    if made.hasobject:
        raise UnsafePickleError(f"refusing {what} of object dtype: it can hold any object")
    limit = current_budget().alloc
    if made.itemsize > limit:
        raise over_budget(f"{what} of {made.itemsize:,}-byte elements", made.itemsize, "alloc", limit)
    return made


MAX_NDIM = 64  # numpy itself stops at 32


def _checked_alloc(shape: Any, itemsize: int, what: str) -> tuple[int, ...]:
    """The dims of `shape`, charged as an array of them before it is made."""
    shape = shape if isinstance(shape, (tuple, list)) else (shape,)
    if len(shape) > MAX_NDIM:
        raise UnsafePickleError(f"refusing {what} of {len(shape):,} dimensions")
    dims = tuple(map(operator.index, shape))
    nbytes = itemsize
    for n in dims:
        if n < 0:
            raise UnsafePickleError(f"refusing {what} of shape {list(dims)[:8]}: negative dimension")
        nbytes *= n
    charge(nbytes, f"{what} of {nbytes:,} bytes (shape {list(dims)[:8]})").arrays += 1
    return dims


class UnpickledArray(np.ndarray):
    """What numpy's reconstructors make while a pickle loads: an ndarray whose `__setstate__`
    (the BUILD opcode that gives it its data) charges that data first: numpy copies data given
    as text, so one memoised string could otherwise fill any number of arrays. `plain_arrays`
    turns every one into a plain ndarray view once the load is done."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise UnsafePickleError("refusing a numpy array state that is not numpy's (version, shape, dtype, "
                                    "order, data)")
        dtype, data = state[-3], state[-1]
        if not isinstance(dtype, np.dtype) or dtype.hasobject:
            raise UnsafePickleError("refusing a numpy array state whose dtype is not a plain one")
        if not isinstance(data, (bytes, str)):
            raise UnsafePickleError(f"refusing a numpy array state whose data is a {type(data).__name__}")
        charge(len(data), "a numpy array's data")
        super().__setstate__(state)

    def __reduce__(self) -> Any:  # pickled again, it is a plain ndarray
        return self.view(np.ndarray).__reduce__()


def plain_arrays(tree: Any) -> Any:
    """`tree` with every UnpickledArray replaced by a plain ndarray over the same memory."""
    return replace_leaves(tree, {UnpickledArray: lambda array: array.view(np.ndarray)})


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """numpy's reconstructors, each charging what it would allocate before it does."""
    from numpy.core import multiarray

    def dtype(spec: Any, align: bool = False, copy: bool = True) -> Any:
        if not isinstance(spec, str):
            raise UnsafePickleError(f"refusing numpy.dtype({type(spec).__name__}): pickles name a dtype by string")
        return _checked_dtype(np, np.dtype(spec, bool(align), bool(copy)), "numpy.dtype")

    def ndarray(shape: Any, dtype: Any = float) -> Any:
        made = _checked_dtype(np, dtype, "numpy.ndarray")
        return np.ndarray.__new__(UnpickledArray, _checked_alloc(shape, made.itemsize, "numpy.ndarray"), made)

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not ndarray and subtype is not np.ndarray:
            raise UnsafePickleError(f"refusing numpy _reconstruct of {type(subtype).__name__}: only ndarray")
        made = _checked_dtype(np, dtype, "numpy._reconstruct")
        return multiarray._reconstruct(UnpickledArray, _checked_alloc(shape, made.itemsize, "numpy._reconstruct"),
                                       made)

    def scalar(dtype: Any, *data: Any) -> Any:
        if not isinstance(dtype, np.dtype):
            raise UnsafePickleError("refusing numpy scalar() of something other than a dtype")
        made = _checked_dtype(np, dtype, "numpy scalar")
        charge(made.itemsize, f"a numpy scalar of {made.itemsize:,} bytes")
        return multiarray.scalar(made, *data)

    table: dict[tuple[str, str], Any] = {("numpy", "dtype"): dtype, ("numpy", "ndarray"): ndarray}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "scalar")] = scalar
        table[(module, "_reconstruct")] = reconstruct
    return table


def _torch_globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {("torch", "Size"): _TUPLE, ("torch", "device"): TorchDevice.unpickled}
    for d in dtypes.all_dtypes():  # every torch dtype: a refused one is refused as a dtype, not here
        if d.in_torch:
            table[("torch", d.name)] = d
    for alias in ("float", "half", "double", "long", "int", "short", "cfloat", "cdouble", "chalf", "bit"):
        table[("torch", alias)] = dtypes.dtype(alias)
    for name in ("strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"):
        table[("torch", name)] = name
    # torch 2.x pickles `torch.strided` in DCP metadata as `_get_layout("torch.strided")`.
    table[("torch.serialization", "_get_layout")] = lambda name: str(name).removeprefix("torch.")
    return table


_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "set"): _SET,
    ("builtins", "frozenset"): _FROZENSET,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "slice"): slice,
    ("builtins", "range"): _range,
    ("builtins", "tuple"): _TUPLE,
    ("builtins", "list"): _LIST,
    ("builtins", "dict"): _DICT,
    ("builtins", "object"): object,
    ("_codecs", "encode"): _encode,
    ("_io", "BytesIO"): BytesIOState,  # read as its bytes (`torch_records.without_bytes_io`)
    ("io", "BytesIO"): BytesIOState,
    ("collections", "OrderedDict"): _ORDERED_DICT,
    ("datetime", "datetime"): datetime.datetime,
    ("datetime", "date"): datetime.date,
    ("datetime", "time"): datetime.time,
    ("datetime", "timedelta"): datetime.timedelta,
    ("datetime", "timezone"): datetime.timezone,
    ("pathlib", "PosixPath"): _posix_path,
    ("pathlib", "PurePosixPath"): _posix_path,
    ("pathlib", "WindowsPath"): _windows_path,
    ("pathlib", "PureWindowsPath"): _windows_path,
    ("pathlib._local", "PosixPath"): _posix_path,
    ("pathlib._local", "PurePosixPath"): _posix_path,
    ("pathlib._local", "WindowsPath"): _windows_path,
    ("pathlib._local", "PureWindowsPath"): _windows_path,
    **HP_CLASSES,
    **TORCH_DCP_CLASSES,
    **_torch_globals(),
}
_numpy_added = False
register_leaf(dtypes.DType)


def safe_global(module: str, name: str) -> Any:
    """Return the allow-listed object for `module.name`, or raise UnsafePickleError."""
    global _numpy_added
    if not _numpy_added and module.startswith("numpy"):
        _SAFE_GLOBALS.update(_numpy_globals())
        _numpy_added = True
    try:
        return _SAFE_GLOBALS[(module, name)]
    except KeyError:
        raise UnsafePickleError(
            f"refusing to load global '{module}.{name}': it is not on hpckpt's allow-list",
            hint="a checkpoint's pickle may only name checkpoint metadata classes and plain values",
        ) from None
