"""The only way hpckpt reads a pickle: an unpickler that resolves allow-listed names only.

A checkpoint's pickle can name any importable callable (`os.system`, `builtins.eval`...) and the
stock unpickler would call it. Here every global is looked up in an explicit table of harmless
values and our own plain classes; anything else raises `UnsafePickleError` naming the global,
before anything from the pickle has been called. torch is never imported: `torch.Size` becomes a
tuple and torch dtypes become our `DType`.
"""

from __future__ import annotations

import _compat_pickle
import collections
import datetime
import gc
import io
import pathlib
import pickle
from typing import Any, BinaryIO, Callable

from hpckpt.core import dtypes
from hpckpt.core.errors import CorruptMetadataError, HpckptError, UnsafePickleError
from hpckpt.core.metadata import HP_CLASSES
from hpckpt.core.torch_dcp_metadata import TORCH_DCP_CLASSES
from hpckpt.core.torch_records import TorchDevice

Resolver = Callable[[str, str], Any]


def _bytearray(*args: Any) -> bytearray:
    """bytearray from bytes only: `bytearray(10**12)` in a 30-byte pickle would exhaust memory."""
    if args and not isinstance(args[0], (bytes, bytearray, str)):
        raise UnsafePickleError("refusing bytearray() of a size: only bytearray(bytes) is allowed")
    return bytearray(*args)


def _posix_path(*parts: str) -> str:
    return str(pathlib.PurePosixPath(*parts))


def _windows_path(*parts: str) -> str:
    return str(pathlib.PureWindowsPath(*parts))


def _numpy_globals() -> dict[tuple[str, str], Any]:
    import numpy as np
    from numpy.core import multiarray

    table: dict[tuple[str, str], Any] = {("numpy", "dtype"): np.dtype, ("numpy", "ndarray"): np.ndarray}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "scalar")] = multiarray.scalar
        table[(module, "_reconstruct")] = multiarray._reconstruct
    return table


def _torch_globals() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {("torch", "Size"): tuple, ("torch", "device"): TorchDevice.unpickled}
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
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _bytearray,
    ("builtins", "slice"): slice,
    ("builtins", "range"): range,
    ("builtins", "tuple"): tuple,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "object"): object,
    ("_codecs", "encode"): lambda text, encoding="utf-8": text.encode(encoding),
    ("collections", "OrderedDict"): collections.OrderedDict,
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


class SafeUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` whose globals come from `safe_global` (or a caller's narrower resolver)."""

    def __init__(self, file: BinaryIO, *, resolver: Resolver = safe_global):
        super().__init__(file)
        self._resolver = resolver

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 pickles (torch.save writes them) use Python 2 names such as
        # `__builtin__.set`; the stock unpickler renames them, and so must we. The renamed
        # global still has to be on the allow-list.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        return self._resolver(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing persistent id {pid!r} outside a torch.save archive")


FREEZE_ABOVE_BYTES = 4 * 1024 * 1024


def loads(data: bytes, *, what: str, resolver: Resolver = safe_global) -> Any:
    """Unpickle `data` safely; `what` names the source in error messages.

    Raises:
        UnsafePickleError: the pickle names a global that is not allow-listed.
        CorruptMetadataError: the bytes are not a complete pickle.
    """
    # A large metadata pickle creates millions of objects and no reference cycles; the cyclic
    # collector would otherwise rescan them again and again (2.5x slower measured on 640k chunks).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = SafeUnpickler(io.BytesIO(data), resolver=resolver).load()
        if len(data) > FREEZE_ABOVE_BYTES:
            gc.freeze()  # keep the collector from rescanning the new objects, which hold no cycles
        return result
    except HpckptError as exc:
        exc.message = f"{what}: {exc.message}"
        exc.args = (exc.message,)
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, MemoryError, UnicodeDecodeError, OverflowError, RecursionError) as exc:
        raise CorruptMetadataError(f"{what}: not a valid pickle ({type(exc).__name__}: {exc})") from exc
    finally:
        if gc_was_enabled:
            gc.enable()


SNIFF_BYTES = 4096  # the first global of a metadata pickle lies within its first ~100 bytes


def sniff_head(path: "pathlib.Path") -> bytes:
    """The first bytes of a metadata file, enough to tell whose classes it pickles."""
    try:
        with open(path, "rb") as f:
            return f.read(SNIFF_BYTES)
    except OSError:
        return b""


def pickle_globals(data: bytes, limit: int = 64) -> set[tuple[str, str]]:
    """Return the (module, name) pairs a pickle refers to, without unpickling it.

    Pure Python, so meant for small pickles and prefixes. Stops after `limit` globals, which
    is plenty: class references are memoised after first use.
    """
    import pickletools

    found: set[tuple[str, str]] = set()
    recent: list[str] = []  # strings pushed since the last global (STACK_GLOBAL takes two)
    memo: dict[int, Any] = {}
    last: Any = None  # what the previous opcode pushed, for MEMOIZE
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            name = opcode.name
            pushed: Any = None
            if name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                pushed = arg
            elif name == "MEMOIZE":
                memo[len(memo)] = last
                continue
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(arg)] = last
                continue
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                pushed = memo.get(int(arg))
            elif name == "GLOBAL":
                module, _, attr = arg.partition(" ")
                found.add((module, attr))
            elif name == "STACK_GLOBAL" and len(recent) >= 2:
                found.add((recent[-2], recent[-1]))
                recent.clear()
            if isinstance(pushed, str):
                recent.append(pushed)
            last = pushed
            if len(found) >= limit:
                break
    except (ValueError, EOFError, UnicodeDecodeError) as exc:
        raise CorruptMetadataError(f"not a valid pickle ({exc})") from exc
    return found
