"""The only way hpckpt reads a pickle: an unpickler that resolves allow-listed names only.

A checkpoint's pickle can name any importable callable (`os.system`, `builtins.eval`...) and the
stock unpickler would call it. Here every global is looked up in an explicit table of harmless
values and our own plain classes; anything else raises `UnsafePickleError` naming the global,
before anything from the pickle has been called. torch is never imported: `torch.Size` becomes a
tuple and torch dtypes become our `DType`.

Allow-listed names can still be asked for too much (`range(10**12)`, a numpy array of 3e9
elements, the same memoised string copied ten thousand times, containers nested too deep or
shared to explode): every constructor here charges what it is about to allocate to the load's
budget (`core.safety.pickle_budget`), a pickle up to SCAN_BYTES is scanned for what its opcodes declare
(memo indices, lengths) before the C unpickler runs, and every value is walked once it is loaded.

The table of allowed globals is `allow_list.py`, the opcode scan `pickle_scan.py`; the loading
itself (a big stack for deep pickles, the memory cap, the walk) is here.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import gc
import io
import pickle
import threading
from contextvars import ContextVar
from typing import Any, BinaryIO, Callable, Iterator


from hpckpt.core.codecs.torch_records import BytesIOState, without_bytes_io
from hpckpt.core.errors import CorruptMetadataError, HpckptError, UnsafePickleError
from hpckpt.core.safety.allow_list import Resolver, plain_arrays, safe_global
from hpckpt.core.safety.pickle_budget import Allocations, check_value, current_budget, run_charging
from hpckpt.core.safety.pickle_scan import SCAN_BYTES, _scan



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
    of objects of known classes: checked where they are read, see `core.codecs.metadata_schema`).
    """

    def __init__(self, file: BinaryIO, *, resolver: Resolver = safe_global, kind: str = VALUE):
        super().__init__(file)
        self._file = file
        self._resolver = resolver
        self._kind = kind
        self._nbytes = _stream_size(file)
        self.saw_bytes_io = False

    def load(self) -> Any:
        if not _OWN_OUTPUT.get():
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


_OWN_OUTPUT: ContextVar[bool] = ContextVar("hpckpt_own_output", default=False)


@contextlib.contextmanager
def reading_own_output() -> Iterator[None]:
    """Within: the metadata read is what this process has just written into its own staging
    directory (a write's read-back, which proves that what is committed loads). The opcode
    pre-scan is skipped there: it guards the C unpickler's allocations against a hostile file,
    at ~60 ns an opcode in Python (0.05-0.1 s of a save's commit for a 1 MiB `.metadata`, on
    every rank's critical path); the allow-list and the budgets still apply."""
    token = _OWN_OUTPUT.set(True)
    try:
        yield
    finally:
        _OWN_OUTPUT.reset(token)


FREEZE_ABOVE_BYTES = 4 * 1024 * 1024


def loads(data: bytes, *, what: str, resolver: Resolver = safe_global, kind: str = VALUE) -> Any:
    """Unpickle `data` safely; `what` names the source in error messages, `kind` is VALUE or
    METADATA (see SafeUnpickler).

    Raises:
        UnsafePickleError: the pickle names a global that is not allow-listed, or exceeds a
            budget (`core.safety.pickle_budget`).
        CorruptMetadataError: the bytes are not a complete pickle.
    """
    # A large metadata pickle creates millions of objects and no reference cycles; the cyclic
    # collector would otherwise rescan them again and again (docs/design-figures.md).
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
