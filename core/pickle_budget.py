"""Budgets that keep a hostile pickle from exhausting memory, time or the stack.

A pickle is a program: 300 bytes can ask an allow-listed constructor for `range(10**12)` or a
numpy array of 3e9 elements, or build a list that holds the same list ten times, nine levels
deep (10^9 leaves for whatever walks it), or nest containers deeper than any recursive code
(`repr`, JSON conversion, flattening, re-pickling) can follow. The safe unpickler
(`core.unpickle`) therefore checks three budgets:

- `alloc`: the bytes one allow-listed constructor may allocate (a numpy array, scalar or dtype),
  and `range`, the elements an allow-listed `range()` may span (code that turns it into a tuple
  allocates them);
- `depth`: how deeply the containers of a value may nest;
- `objects`: how many objects a value may reach, counting a shared object each time it is
  reached (which is what makes an expansion bomb visible): the larger of `objects` and
  `objects_per_byte` times the pickle's size.

Depth and object count are checked on values (`.bytes` pickles, torch.save archives, PyTorch
DCP records) by `check_value`, one iterative pass; metadata pickles, which hold millions of
objects, get cheap structural checks where they are read instead (`core.metadata`).

The defaults suit every real checkpoint seen; to raise one, set the environment variable
`HPCKPT_PICKLE_BUDGET` to comma-separated `name=value` pairs, sizes with an optional K/M/G/T
suffix, e.g. `HPCKPT_PICKLE_BUDGET="depth=200,objects=50M,alloc=8G,range=100M"` (depth at
most MAX_DEPTH).
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from dataclasses import dataclass
from typing import Any

from hpckpt.core.errors import RulesFileError, UnsafePickleError

ENV = "HPCKPT_PICKLE_BUDGET"
#: Code that follows a value (JSON conversion, flattening, re-pickling) recurses: deeper than this
#: it would hit Python's recursion limit, so the depth budget cannot be raised past it.
MAX_DEPTH = 200
_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class BudgetSettingError(RulesFileError):
    """`HPCKPT_PICKLE_BUDGET` cannot be parsed: a wrong setting is a usage error (exit 2)."""

    kind = "pickle-budget"


@dataclass(frozen=True)
class PickleBudget:
    """What one pickle may cost; see the module docstring for each field."""

    depth: int = 100
    objects: int = 1_000_000
    objects_per_byte: int = 64
    alloc: int = 1 << 30
    range: int = 1 << 22

    def object_limit(self, nbytes: int) -> int:
        """Objects a value of an `nbytes`-byte pickle may reach."""
        return max(self.objects, self.objects_per_byte * nbytes)


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
    """Walk `value` breadth first, without recursion, and stop once it nests deeper than
    `budget.depth` or reaches more objects than the budget allows for an `nbytes`-byte pickle.

    Raises:
        UnsafePickleError: a budget is exceeded (a cycle exceeds the depth budget), or the value
            holds a numpy object of object dtype.
    """
    budget = budget or current_budget()
    limit = budget.object_limit(nbytes)
    level, depth, count = [value], 0, 0
    while level:
        depth += 1
        count += len(level)
        following: list = []
        for obj in level:
            if type(obj) in _LEAVES:
                continue
            children = _children(obj)
            if not children:
                continue
            if depth >= budget.depth:
                raise over_budget("a value nested this deep (or holding itself)", depth + 1, "depth", budget.depth)
            following.extend(children)
            if count + len(following) > limit:
                raise over_budget("a value reaching this many objects (shared ones counted each time)",
                                  count + len(following), "objects", limit)
        level = following
