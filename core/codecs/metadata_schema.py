"""Schema checks of a `.metadata` pickle (HyperParallel's and PyTorch DCP's Metadata objects),
and of the shapes and ints their fields and torch's tensor records carry.

A metadata pickle holds millions of objects, so it is not walked (see `core.safety.pickle_budget`);
instead every field is checked where it is read: per tensor when the index is built (cheap: one
pass over the tensors and one over storage_data), per chunk when a command first turns the
chunks into boxes (`guarded` and `schema_errors` around that code turn a field of the wrong type,
or a missing one, into CorruptMetadataError naming it).
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Callable, Iterable, Iterator

from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.safety.pickle_budget import describe

MAX_DIMS = 64  # torch's limit; numpy's is 32 or 64
INT64_MAX = (1 << 63) - 1
#: A chunk takes at least this many bytes of pickle (a real one about 34): more chunks than the
#: pickle's bytes allow can only be one list referred to many times, an expansion bomb.
MIN_PICKLE_BYTES_PER_CHUNK = 8
_SCHEMA_ERRORS = (AttributeError, TypeError, ValueError, OverflowError, RecursionError, KeyError, IndexError)


class RequiredFields:
    """A field missing from an unpickled metadata object (a damaged or hand-made pickle) is a
    schema error naming it (exit 6), wherever it is first read, not an AttributeError.

    Only the classes with one object per tensor (or per file) take it: a class with a
    `__getattr__` makes every attribute read slower, and the per-chunk classes (chunks, storage
    keys and infos, close to a million each in the planning benchmark) would slow planning
    (docs/design-figures.md)."""

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__") and name in {f.name for f in fields(self)}:
            raise CorruptMetadataError(f"a {type(self).__name__} in the metadata has no {name!r} field")
        raise AttributeError(name)


@contextmanager
def schema_errors(where: str) -> Iterator[None]:
    """Report a field of the wrong type (or a missing one) met in this block as a schema error."""
    try:
        yield
    except CorruptMetadataError:
        raise
    except _SCHEMA_ERRORS as exc:
        raise CorruptMetadataError(f"{where}: malformed metadata ({type(exc).__name__}: {str(exc)[:160]})") from None


def guarded(build: Callable[..., Any], where: str, diagnose: Callable[[], str | None] | None = None) -> Callable:
    """`build` (a lazy chunk builder), reporting bad fields as schema errors; `diagnose` names the
    first bad chunk field, looked for only once something failed."""
    def call(*args: Any) -> Any:
        try:
            return build(*args)
        except CorruptMetadataError:
            raise
        except _SCHEMA_ERRORS as exc:
            found = diagnose() if diagnose else None
            raise CorruptMetadataError(f"{where}: {found or f'malformed metadata ({type(exc).__name__}: {str(exc)[:160]})'}"
                                       ) from None
    return call


def check_shape(value: Any, itemsize: int, what: str) -> tuple[int, ...]:
    """A tensor's global shape: at most MAX_DIMS non-negative ints whose product, in bytes, fits int64."""
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        raise CorruptMetadataError(f"{what}: size {describe(value)} is not a shape (a sequence of at most "
                                   f"{MAX_DIMS} non-negative ints)")
    dims = check_ints(value, f"{what}: size")
    nbytes = itemsize
    for n in dims:
        nbytes *= n
    if nbytes > INT64_MAX:
        raise CorruptMetadataError(f"{what}: size {list(dims)} holds {nbytes:,} bytes, more than int64 can count")
    return dims


def check_ints(value: Iterable, what: str) -> tuple[int, ...]:
    """The entries of `value` as ints (numpy ints too, never bools), refusing negative ones."""
    if not isinstance(value, (tuple, list)):
        raise CorruptMetadataError(f"{what} {describe(value)} is not a sequence of ints")
    dims = []
    for n in value:
        try:
            size = operator.index(n)
        except TypeError:
            size = None
        if size is None or isinstance(n, bool) or size < 0 or size > INT64_MAX:
            raise CorruptMetadataError(f"{what} {describe(value)} has entry {describe(n)}, not a non-negative int")
        dims.append(size)
    return tuple(dims)


def bad_chunk(chunks: Any, ndim: int) -> str | None:
    """Describe the first chunk whose offsets or sizes are missing or malformed (None: all fine)."""
    if not isinstance(chunks, (list, tuple)):
        return f"chunks is {describe(chunks)}, not a list"
    for i, chunk in enumerate(chunks):
        state = getattr(chunk, "__dict__", None)
        if not isinstance(state, dict):
            return f"chunk {i} is {describe(chunk)}, not a ChunkStorageMetadata"
        for name in ("offsets", "sizes"):
            if name not in state:
                return f"chunk {i} ({type(chunk).__name__}) has no {name!r} field"
            box = state[name]
            if not isinstance(box, (tuple, list)) or len(box) != ndim:
                return f"chunk {i}: {name} {describe(box)} is not {ndim} ints"
            try:
                check_ints(box, f"chunk {i}: {name}")
            except CorruptMetadataError as exc:
                return exc.message
    return None


def _check_planner_data(planner: Any, where: str) -> None:
    """fqn -> key path (a short tuple of str/int): what a nested state dict's names come from."""
    if not isinstance(planner, dict):
        return  # not used (HyperParallel may write None)
    for fqn, path in planner.items():
        if type(fqn) is not str or not isinstance(path, (tuple, list)) or len(path) > MAX_DIMS or \
                not all(type(k) in (str, int) for k in path):
            raise CorruptMetadataError(f"{where}: planner_data entry {describe(fqn)}: {describe(path)} is not "
                                       "a key path (a short tuple of str and int)")


def _check_storage(storage: dict, storage_types: tuple[type, type], where: str) -> None:
    """Keys of the key class with a str fqn and an int (or no) index, entries of the entry class:
    what is hashed later must be checked first (a deeply nested tuple hashed overflows the C
    stack). One pass over the keys, one C-speed pass over the entries."""
    key_type, info_type = storage_types
    with schema_errors(f"{where}: storage_data key"):
        kinds = {(type(key), type(key.fqn), type(key.index)) for key in storage}
    for kind in kinds:
        if kind[0] is not key_type or kind[1] is not str or kind[2] not in (int, type(None)):
            raise CorruptMetadataError(f"{where}: storage_data has a key of type {kind[0].__name__} whose fqn is "
                                       f"a {kind[1].__name__} and index a {kind[2].__name__}")
    _check_types(storage.values(), (info_type,), "entries", where)
    with schema_errors(f"{where}: storage_data entry"):  # every reader reads it: one missing is a schema error
        if hasattr(info_type, "tensor_key"):  # HyperParallel's: a chunk's key in its file, looked up (hashed) later
            kinds = {(type(info.relative_path), type(info.tensor_key)) for info in storage.values()}  # (one pass)
            _check_found({p for p, _ in kinds}, (str,), "a relative_path", where)
            _check_found({k for _, k in kinds}, (str, type(None)), "a tensor_key", where)
        else:
            _check_types(map(operator.attrgetter("relative_path"), storage.values()), (str,), "a relative_path", where)


def _check_types(objects: Iterable, allowed: tuple, what: str, where: str) -> None:
    """One C-speed pass: every object is of an allowed type (checked before anything hashes them:
    a deeply nested tuple hashed overflows the C stack)."""
    _check_found(set(map(type, objects)), allowed, what, where)


def _check_found(found: set, allowed: tuple, what: str, where: str) -> None:
    wrong = found.difference(allowed)
    if wrong:
        names = ", ".join(sorted(t.__name__ for t in wrong))
        raise CorruptMetadataError(f"{where}: storage_data holds {what} of type {names}")


def check_entries(metadata: Any, nbytes: int, where: str, *, storage_types: tuple[type, type],
                  tensor_type: type) -> int:
    """The per-tensor schema of a Metadata object (HyperParallel's or PyTorch DCP's): names are
    str, sizes shapes, chunk lists lists, storage_data of the right classes, and no more chunks
    than a pickle of `nbytes` bytes can describe. Returns the number of chunks.

    Raises:
        CorruptMetadataError: naming the first field that is wrong.
    """
    state, storage = metadata.__dict__.get("state_dict_metadata"), metadata.__dict__.get("storage_data")
    for name, value in (("state_dict_metadata", state), ("storage_data", storage)):
        if not isinstance(value, dict):
            raise CorruptMetadataError(f"{where}: {name} is {describe(value)}, not a dict")
    version = metadata.__dict__.get("version")
    if version is not None and type(version) is not str:
        raise CorruptMetadataError(f"{where}: version is {describe(version)}, not a str")
    _check_planner_data(metadata.__dict__.get("planner_data"), where)
    _check_storage(storage, storage_types, where)
    chunks = 0
    for fqn, item in state.items():
        if type(fqn) is not str:
            raise CorruptMetadataError(f"{where}: state_dict_metadata key {describe(fqn)} is not a str")
        if type(item) is tensor_type:
            listed = item.chunks
            if not isinstance(listed, list):
                raise CorruptMetadataError(f"{where}: tensor {fqn}: chunks is {describe(listed)}, not a list")
            chunks += len(listed)
    if chunks > max(nbytes // MIN_PICKLE_BYTES_PER_CHUNK, 1024):
        raise CorruptMetadataError(f"{where}: describes {chunks:,} chunks in a {nbytes:,}-byte pickle: "
                                   "the same chunk list is referred to over and over (an expansion bomb)")
    return chunks


def storage_paths(storage: dict, where: str) -> set[str]:
    """The data files storage_data names (type-checked before they are hashed)."""
    with schema_errors(f"{where}: storage_data entry"):
        paths = list(map(operator.attrgetter("relative_path"), storage.values()))
    if set(map(type, paths)) - {str}:
        bad = next(p for p in paths if type(p) is not str)
        raise CorruptMetadataError(f"{where}: storage_data entry has relative_path {describe(bad)}, not a str")
    return set(paths)


def dtype_spelling(properties: Any, where: str) -> str:
    """A tensor's dtype as the metadata spells it: a str (or a torch dtype, which the safe
    unpickler makes a DType), from properties that are TensorProperties of either format."""
    from hpckpt.core.dtypes import DType

    dtype = getattr(properties, "__dict__", {}).get("dtype") if type(properties).__name__ == "TensorProperties" else None
    if type(dtype) is not str and not isinstance(dtype, DType):
        what = f"properties.dtype {describe(dtype)}" if dtype is not None else f"properties {describe(properties)}"
        raise CorruptMetadataError(f"{where}: {what} is not a dtype")
    return str(dtype)
