"""The only way hpckpt reads a pickle: an unpickler that resolves allow-listed names only.

A checkpoint's pickle can name any importable callable (`os.system`, `builtins.eval`...) and the
stock unpickler would call it. Here every global is looked up in an explicit table of harmless
values and our own plain classes; anything else raises `UnsafePickleError` naming the global,
before anything from the pickle has been called. torch is never imported: `torch.Size` becomes a
tuple and torch dtypes become our `DType`.

Allow-listed names can still be asked for too much (`range(10**12)`, a numpy array of 3e9
elements, the same memoised string copied ten thousand times, containers nested too deep or
shared to explode): every constructor here charges what it is about to allocate to the load's
budget (`core.pickle_budget`), a pickle up to SCAN_BYTES is scanned for what its opcodes declare
(memo indices, lengths) before the C unpickler runs, and every value is walked once it is loaded.
"""

from __future__ import annotations

import _compat_pickle
import collections
import contextlib
import datetime
import gc
import io
import operator
import pathlib
import pickle
import threading
from typing import Any, BinaryIO, Callable

import numpy as np

from hpckpt.core import dtypes
from hpckpt.core.errors import CorruptMetadataError, HpckptError, UnsafePickleError
from hpckpt.core.nesting import replace_leaves
from hpckpt.core.safety.pickle_budget import (Allocations, allocations, charge, check_value, current_budget,
                                       over_budget, register_leaf, run_charging)
from hpckpt.core.codecs.hyperparallel_metadata import HP_CLASSES
from hpckpt.core.codecs.torch_dcp_metadata import TORCH_DCP_CLASSES
from hpckpt.core.codecs.torch_records import BytesIOState, TorchDevice, without_bytes_io

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


VALUE, METADATA = "value", "metadata"

# Unpickling itself never recurses, but hashing a tuple does, in C and without a depth check: a
# pickle nesting tuples 150,000 deep as a dict key overflows an 8 MiB stack (a crash, not an
# error). Each level takes one opcode byte and about 60 bytes of stack, so a pickle larger than
# DIRECT_BYTES is loaded in a thread whose stack holds one level per byte of the pickle.
DIRECT_BYTES = 32 << 10
STACK_PER_BYTE = 80
MAX_STACK = 1 << 30
_stack_lock = threading.Lock()


def _stream_size(file: BinaryIO) -> int:
    """Bytes left in `file` (0: unknown). By seeking: `BytesIO.getbuffer()` would make the
    BytesIO copy the bytes it shares (+31 MiB for the 1,024-rank metadata)."""
    try:
        here = file.seek(0, io.SEEK_CUR)
        end = file.seek(0, io.SEEK_END)
        file.seek(here)
        return end - here
    except (OSError, AttributeError, ValueError):
        return 0


SCAN_BYTES = 1 << 20  # scanned before loading: about 40 ms a MiB


def _arguments() -> dict[int, tuple[int, int, str]]:
    """Opcode byte -> (layout of its argument, size, name). Layouts: 0 none, 1 `size` bytes, 2 a
    `size`-byte little-endian length then that many bytes, 3 `size` newline-ended lines."""
    import pickletools

    lengths = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
               pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
    table = {}
    for op in pickletools.opcodes:
        arg, code, name = op.arg, op.code.encode("latin-1")[0], op.name.lower()
        if arg is None:
            table[code] = (0, 0, name)
        elif op.name in ("GLOBAL", "INST"):
            table[code] = (3, 2, name)
        elif arg.n >= 0:
            table[code] = (1, arg.n, name)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[code] = (3, 1, name)
        else:
            table[code] = (2, lengths[arg.n], name)
    return table


_ARGUMENTS: dict[int, tuple[int, int, str]] = {}
_PUT, _BINPUT, _LONG_BINPUT, _STOP = b"p"[0], b"q"[0], b"r"[0], b"."[0]


def _scan(file: BinaryIO, nbytes: int) -> None:
    """Refuse what a pickle's opcodes declare beyond what its bytes can honestly need, before the
    C unpickler acts on it (pickles above SCAN_BYTES, large metadata where a scan would cost
    seconds, are not scanned; the `hpckpt` process bounds their load's memory, `_memory_cap`):

    - a memo index no honest pickle of this size uses: the unpickler grows its memo to twice the
      largest index it is told to store at, 16 bytes an entry (a 6-byte `LONG_BINPUT 10**8` asks
      for 1.6 GB); an honest index counts the objects stored before, fewer than the bytes (allowed:
      2 x the bytes or 2^20, a memo of at most 64 MiB for a pickle of SCAN_BYTES);
    - a length (of bytes, a string, a long integer, a frame) past the pickle's end: the
      unpickler allocates what a BYTEARRAY8 declares before it finds the bytes missing.

    Raises:
        UnsafePickleError: a memo index larger than the pickle.
        pickle.UnpicklingError: the opcodes do not parse (reported by the callers as corrupt).
    """
    if not isinstance(file, io.BytesIO) or not 0 < nbytes <= SCAN_BYTES:
        return
    if not _ARGUMENTS:
        _ARGUMENTS.update(_arguments())
    start = file.tell()
    _scan_opcodes(file.getvalue(), start, max(2 * nbytes, 1 << 20))  # getvalue() shares the bytes


def _scan_opcodes(data: bytes, at: int, memo_limit: int) -> None:
    table, end, index = _ARGUMENTS, len(data), None
    while at < end:
        code = data[at]
        layout = table.get(code)
        if layout is None:
            raise pickle.UnpicklingError(f"malformed pickle (no opcode {code:#04x} at byte {at})")
        kind, size, name = layout
        at += 1
        if kind == 1:
            if code == _BINPUT or code == _LONG_BINPUT:
                index = int.from_bytes(data[at:at + size], "little")
            at += size
        elif kind == 2:
            length = int.from_bytes(data[at:at + size], "little")
            if at + size + length > end:
                raise pickle.UnpicklingError(f"malformed pickle (a {name} declares {length:,} bytes, "
                                             f"{max(0, end - at - size):,} remain)")
            at += size + length
        elif kind == 3:
            start = at
            for _ in range(size):
                at = data.find(b"\n", at) + 1
                if at == 0:
                    raise pickle.UnpicklingError("malformed pickle (a line argument without its newline)")
            if code == _PUT:
                try:
                    index = int(data[start:at - 1])
                except ValueError:
                    raise pickle.UnpicklingError(f"malformed pickle (PUT {data[start:at - 1][:20]!r})") from None
        elif code == _STOP:
            return
        if at > end:
            raise pickle.UnpicklingError(f"malformed pickle (the argument of a {name} runs past the end)")
        if index is not None:
            if index > memo_limit:
                raise UnsafePickleError(f"refusing a memo index of {index:,} in a pickle of {end:,} bytes "
                                        "(it would make the unpickler allocate a memo that large)")
            index = None
    raise pickle.UnpicklingError("malformed pickle (no STOP opcode)")

@contextlib.contextmanager
def _memory_cap(nbytes: int):
    """The bound on what loading one large pickle may allocate (a memo index it names, which the
    scan of small pickles catches, makes the C unpickler allocate 16 bytes per index).

    Raises:
        UnsafePickleError: the load needed more than that.
    """
    import resource

    from hpckpt.core import process

    # Only in the `hpckpt` process (`core.process`): the limit is the process's, and the threads of
    # a program importing hpckpt need theirs. Up to max(1 GiB, 64 x the pickle's bytes).
    if not process.single_job or nbytes <= SCAN_BYTES:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        used = None
    budget = max(1 << 30, 64 * nbytes)
    cap = None if used is None else used + budget
    if cap is None or any(limit != resource.RLIM_INFINITY and limit <= cap for limit in (soft, hard)):
        yield  # unknown, or already tighter
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    except MemoryError:
        raise UnsafePickleError(f"refusing a pickle of {nbytes:,} bytes that needs more than {budget >> 20:,} MiB "
                                "of memory to load (a memo index far beyond its size?)") from None
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _load_on_big_stack(load: Callable[[], Any], nbytes: int) -> Any:
    """`load()` in a thread whose stack fits `nbytes` levels of tuple nesting (see DIRECT_BYTES)."""
    if 0 < nbytes <= DIRECT_BYTES:
        return load()
    size = STACK_PER_BYTE * nbytes if nbytes else MAX_STACK
    size = min(MAX_STACK, max(size, 16 << 20) + (8 << 20)) // 4096 * 4096
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            with _memory_cap(nbytes):
                outcome["value"] = load()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            outcome["error"] = exc

    thread = _start_thread(run, size)
    if thread is None:  # no address space for any such stack (a tight `ulimit -v`): load here
        return load()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _start_thread(run: Callable[[], None], size: int) -> threading.Thread | None:
    """A started thread with a stack of `size` bytes, else of a quarter of that, ... down to 16 MiB."""
    while True:
        with _stack_lock:
            previous = threading.stack_size(size)
            try:
                thread = threading.Thread(target=run, name="hpckpt-unpickle", daemon=True)
                thread.start()
                return thread
            except (RuntimeError, MemoryError):
                if size <= 16 << 20:
                    return None
                size = max(16 << 20, size // 4 // 4096 * 4096)
            finally:
                threading.stack_size(previous)


class SafeUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` whose globals come from `safe_global` (or a caller's narrower resolver).

    `kind` is VALUE (a `.bytes` pickle, a torch.save archive, a DCP record: arbitrary objects,
    walked once by `pickle_budget.check_value` for depth and object count) or METADATA (millions
    of objects of known classes: checked where they are read, see `core.metadata`).
    """

    def __init__(self, file: BinaryIO, *, resolver: Resolver = safe_global, kind: str = VALUE):
        super().__init__(file)
        self._file = file
        self._resolver = resolver
        self._kind = kind
        self._nbytes = _stream_size(file)
        self.saw_bytes_io = False

    def load(self) -> Any:
        _scan(self._file, self._nbytes)
        ledger = Allocations(current_budget().alloc_limit(self._nbytes))
        result = _load_on_big_stack(lambda: run_charging(ledger, super(SafeUnpickler, self).load), self._nbytes)
        if self._kind == VALUE:
            check_value(result, self._nbytes)
        if ledger.arrays:
            try:
                result = plain_arrays(result)
            except RecursionError:  # (a value is walked above: only metadata nests this deep)
                raise UnsafePickleError("refusing numpy arrays in metadata nested too deep to walk") from None
        return without_bytes_io(result) if self.saw_bytes_io else result

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 pickles (torch.save writes them) use Python 2 names such as
        # `__builtin__.set`; the stock unpickler renames them, and so must we. The renamed
        # global still has to be on the allow-list.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        found = self._resolver(module, name)
        self.saw_bytes_io |= found is BytesIOState
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing persistent id {type(pid).__name__} outside a torch.save archive")


FREEZE_ABOVE_BYTES = 4 * 1024 * 1024


def loads(data: bytes, *, what: str, resolver: Resolver = safe_global, kind: str = VALUE) -> Any:
    """Unpickle `data` safely; `what` names the source in error messages, `kind` is VALUE or
    METADATA (see SafeUnpickler).

    Raises:
        UnsafePickleError: the pickle names a global that is not allow-listed, or exceeds a
            budget (`core.pickle_budget`).
        CorruptMetadataError: the bytes are not a complete pickle.
    """
    # A large metadata pickle creates millions of objects and no reference cycles; the cyclic
    # collector would otherwise rescan them again and again (2.5x slower measured on 640k chunks).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = SafeUnpickler(io.BytesIO(data), resolver=resolver, kind=kind).load()
        if len(data) > FREEZE_ABOVE_BYTES:
            gc.freeze()  # keep the collector from rescanning the new objects, which hold no cycles
        return result
    except HpckptError as exc:
        exc.message = f"{what}: {exc.message}"
        exc.args = (exc.message,)
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, MemoryError, UnicodeDecodeError, OverflowError, RecursionError, LookupError) as exc:
        raise CorruptMetadataError(f"{what}: not a valid pickle ({type(exc).__name__}: {str(exc)[:200]})") from exc
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
