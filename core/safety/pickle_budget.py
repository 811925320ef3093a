"""Budgets that keep a hostile pickle from exhausting memory, time or the stack.

A pickle is a program: 300 bytes can ask an allow-listed constructor for `range(10**12)` or a
numpy array of 3e9 elements, call `list(range(4_000_000))` twenty times over one memoised range,
copy one memoised string into a fresh bytearray ten thousand times, or build a list that holds
the same list ten times, nine levels deep (10^9 leaves for whatever walks it), or nest containers
deeper than any recursive code (`repr`, JSON conversion, flattening, re-pickling) can follow. The
safe unpickler (`core.safety.unpickle`) therefore checks these budgets:

- `alloc`: what the allow-listed constructors of one pickle may allocate, in all (containers
  built from an iterable, copies of bytes and strings, numpy arrays, scalars and array data):
  the larger of `alloc` and `alloc_per_byte` times the pickle's size. Every constructor charges
  what it is about to allocate to the load's `Allocations` before it does;
- `range`: the elements an allow-listed `range()` may span;
- `depth`: how deeply the containers of a value may nest;
- `objects`: how many objects a value may reach, counting a shared object each time it is
  reached (which is what makes an expansion bomb visible): the larger of `objects` and
  `objects_per_byte` times the pickle's size.

Depth and object count are checked on values (`.bytes` pickles, torch.save archives, PyTorch
DCP records) by `check_value`, one iterative walk whose memory is its depth; metadata pickles,
which hold millions of objects, get cheap structural checks where they are read instead
(`core.codecs.metadata_schema`). What the C unpickler allocates by itself grows with the opcodes
it reads, except what an opcode declares (a memo index, a length): `core.safety.unpickle` scans for
those.

The defaults suit every real checkpoint seen; to raise one, set the environment variable
`HPCKPT_PICKLE_BUDGET` to comma-separated `name=value` pairs, sizes with an optional K/M/G/T
suffix, e.g. `HPCKPT_PICKLE_BUDGET="depth=200,objects=50M,alloc=8G,range=100M"` (depth at
most MAX_DEPTH).
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import threading
from dataclasses import dataclass
from typing import Any

from hpckpt.core.errors import BudgetSettingError, UnsafePickleError

ENV = "HPCKPT_PICKLE_BUDGET"
#: Code that follows a value (JSON conversion, flattening, re-pickling) recurses: deeper than this
#: it would hit Python's recursion limit, so the depth budget cannot be raised past it.
MAX_DEPTH = 200
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True)
class PickleBudget:
    """What one pickle may cost; see the module docstring for each field."""

    depth: int = 100
    objects: int = 1_000_000
    objects_per_byte: int = 4
    alloc: int = 128 << 20
    alloc_per_byte: int = 4
    range: int = 1 << 22

    def object_limit(self, nbytes: int) -> int:
        """Objects a value of an `nbytes`-byte pickle may reach."""
        return max(self.objects, self.objects_per_byte * nbytes)

    def alloc_limit(self, nbytes: int) -> int:
        """Bytes the constructors of an `nbytes`-byte pickle may allocate in all."""
        return max(self.alloc, self.alloc_per_byte * nbytes)


def _size(text: str) -> int:
    text = text.strip().upper()
    number, suffix = (text[:-1], text[-1]) if text[-1:] in _SUFFIXES and text[-1:] else (text, "")
    value = int(number) * _SUFFIXES[suffix]
    if value <= 0:
        raise ValueError(text)
    return value


def parse_budget(text: str) -> PickleBudget:
    """`"depth=400,alloc=8G"` -> a PickleBudget with those fields changed."""
    names = {f.name for f in dataclasses.fields(PickleBudget)}
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            if name not in names:
                raise ValueError(name)
            changes[name] = _size(value)
            if name == "depth" and changes[name] > MAX_DEPTH:
                raise ValueError(value)
        except (ValueError, IndexError):
            raise BudgetSettingError(f"{ENV}: cannot use {item!r}",
                                     hint=f"write name=value pairs, names: {', '.join(sorted(names))}; "
                                          "values positive integers, optionally with K, M, G or T; "
                                          f"depth at most {MAX_DEPTH}") from None
    return PickleBudget(**changes)


_cache: tuple[str | None, PickleBudget] = (None, PickleBudget())


def current_budget() -> PickleBudget:
    """The budget in force: the defaults, changed by `HPCKPT_PICKLE_BUDGET` if it is set."""
    global _cache
    raw = os.environ.get(ENV)
    if raw != _cache[0]:
        _cache = (raw, parse_budget(raw) if raw else PickleBudget())
    return _cache[1]


def over_budget(what: str, amount: int, name: str, limit: int) -> UnsafePickleError:
    """The error for a pickle that asks for more than a budget allows, naming the setting."""
    return UnsafePickleError(f"refusing {what}: {amount:,} is over the pickle budget {name}={limit:,}",
                             hint=f"if the checkpoint is trusted, raise it: {ENV}=\"{name}=...\"")


class Allocations:
    """What the allow-listed constructors of one pickle's load have allocated so far, and how
    many numpy arrays they made (`core.safety.unpickle` turns those back into plain arrays)."""

    def __init__(self, limit: int):
        self.limit, self.used, self.arrays = limit, 0, 0

    def charge(self, nbytes: int, what: str) -> None:
        """Count `nbytes` about to be allocated for `what`, or refuse them (`refuse`)."""
        self.used += nbytes
        if self.used > self.limit:
            self.refuse(what)

    def refuse(self, what: str) -> None:
        """Raises:
            UnsafePickleError: the load would allocate more than its budget.
        """
        raise over_budget(f"{what}: the pickle's constructors would allocate {self.used:,} bytes in all",
                          self.used, "alloc", self.limit)


_loading = threading.local()  # the Allocations of the load running in this thread


def run_charging(ledger: Allocations, load: Any) -> Any:
    """`load()` with the constructors it calls charging `ledger` (in the calling thread)."""
    previous = getattr(_loading, "ledger", None)
    _loading.ledger = ledger
    try:
        return load()
    finally:
        _loading.ledger = previous


def allocations() -> Allocations:
    """The Allocations of the load running in this thread; outside any load (a constructor
    called directly), fresh ones holding `alloc`."""
    return getattr(_loading, "ledger", None) or Allocations(current_budget().alloc)


def charge(nbytes: int, what: str) -> Allocations:
    """Charge `nbytes` for `what` to this thread's load (`allocations()`); returns its Allocations."""
    ledger = allocations()
    ledger.charge(nbytes, what)
    return ledger


_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 3, 60, 60


def describe(value: Any) -> str:
    """A short repr of a value from a pickle, safe on any nesting (for error messages)."""
    if isinstance(value, (str, bytes, int, float, bool, type(None), list, tuple, dict, set, frozenset)):
        try:
            return _short.repr(value)
        except (RecursionError, ValueError):
            pass
    return f"a {type(value).__name__}"


# Types whose instances hold nothing a walk must enter (records of our own add themselves).
_LEAVES = {str, bytes, int, float, bool, type(None), complex, range, bytearray}


def register_leaf(*kinds: type) -> None:
    """Let the walk skip instances of `kinds` (plain records of ours: tensor records, dtypes)."""
    _LEAVES.update(kinds)


def _children(obj: Any) -> Any:
    """The objects `obj` holds, or None for a leaf (our records and numpy objects are checked)."""
    kind = type(obj)
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        return obj
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if kind is slice:
        return (obj.start, obj.stop, obj.step)
    if kind is memoryview:  # protocol 5's READONLY_BUFFER of a bytearray; no writer pickles one in-band
        raise UnsafePickleError("refusing a memoryview (a READONLY_BUFFER opcode): a checkpoint's values are "
                                "plain values, and a view cannot be saved again")
    if kind.__module__.startswith("numpy"):
        _check_numpy(obj)
        return None
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        return list(state.values())
    return None


def _check_numpy(obj: Any) -> None:
    """numpy objects are leaves, but an object dtype could hold anything: refused."""
    dtype = getattr(obj, "dtype", obj)
    if getattr(dtype, "hasobject", False):
        raise UnsafePickleError(f"refusing a numpy {type(obj).__name__} of object dtype: it can hold any object")


def check_value(value: Any, nbytes: int, budget: PickleBudget | None = None) -> None:
    """Stop a value that nests deeper than `budget.depth` or reaches more objects than the budget
    allows for an `nbytes`-byte pickle, counting a shared object each time it is reached, as
    code that follows the value will meet it.

    One depth-first walk without recursion that enters each distinct container once: what a
    container reaches (how many objects, how deep) is remembered when its walk ends, so a
    shared one is counted again without being walked again, and a bomb of 10^9 leaves is
    judged in the time its few hundred lists take.

    Raises:
        UnsafePickleError: a budget is exceeded (a cycle exceeds the depth budget), or the value
            holds a numpy object of object dtype.
    """
    budget = budget or current_budget()
    limit, max_depth = budget.object_limit(nbytes), budget.depth
    if type(value) in _LEAVES or not (children := _children(value)):
        return
    # a frame: (id, its children's iterator, [objects reached below it, deepest level below it
    # holding children]); `done` keeps the last two of every container whose walk has ended
    done: dict[int, tuple[int, int]] = {}
    stack = [(id(value), iter(children), [0, 0])]
    active, count = {id(value)}, 1

    def too_deep(level: int) -> UnsafePickleError:
        return over_budget("a value nested this deep (or holding itself)", level, "depth", max_depth)

    while stack:
        key, items, acc = stack[-1]
        level = len(stack) + 1  # of the children being walked
        for obj in items:
            count += 1
            acc[0] += 1
            if type(obj) in _LEAVES:
                continue
            known = done.get(id(obj))
            if known is None:
                if id(obj) in active:
                    raise too_deep(level + 1)
                children = _children(obj)
                if not children:
                    continue
                if level >= max_depth:
                    raise too_deep(level + 1)
                stack.append((id(obj), iter(children), [0, 0]))
                active.add(id(obj))
                break
            reached, deepest = known
            if level + deepest >= max_depth:
                raise too_deep(level + deepest + 1)
            count += reached
            acc[0] += reached
            acc[1] = max(acc[1], deepest + 1)
            if count > limit:
                break
        else:
            stack.pop()
            active.discard(key)
            done[key] = (acc[0], acc[1])
            if stack:
                parent = stack[-1][2]
                parent[0] += acc[0]
                parent[1] = max(parent[1], acc[1] + 1)
        if count > limit:
            raise over_budget("a value reaching this many objects (shared ones counted each time)",
                              count, "objects", limit)
