"""Flattening nested state dicts the way PyTorch DCP names their leaves.

A torch.save file may hold `{"hist": [t1, t2]}` and a PyTorch DCP checkpoint saved with
`flatten_state_dict=False` stores a nested dict as one object; both still hold tensors, and
hpckpt reads those as tensors under the names DCP's own flattening gives them: dict keys and
list positions joined by "." (`hist.0`, `opt.state.0.exp_avg`). As in DCP, a mapping is always
entered, a list only when it holds a tensor, a mapping or such a list, and anything else is one
leaf (a value); unlike DCP, an empty mapping is a leaf too, not dropped. DCP keeps tuples whole; `tuples=True` enters them too (a torch.save source),
since a tuple of tensors left whole would carry tensors as a value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any


def flatten_nested(state: Mapping, is_tensor: Callable[[Any], bool], *, tuples: bool = False,
                   prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield `(name, leaf)` for every leaf of `state`, in order, named as DCP flattens them."""
    sequences = (list, tuple) if tuples else (list,)

    def enterable(value: Any) -> bool:
        if isinstance(value, Mapping):
            return bool(value)
        if not isinstance(value, sequences):
            return False
        return any(is_tensor(v) or isinstance(v, Mapping) or enterable(v) for v in value)

    def walk(path: str, value: Any) -> Iterator[tuple[str, Any]]:
        if isinstance(value, Mapping) and value:  # DCP drops an empty mapping; here it is a value
            for key, item in value.items():
                yield from walk(f"{path}.{key}", item)
        elif enterable(value):
            for i, item in enumerate(value):
                yield from walk(f"{path}.{i}", item)
        else:
            yield path, value

    for key, value in state.items():
        yield from walk(f"{prefix}{key}", value)


def holds_tensor(value: Any, is_tensor: Callable[[Any], bool], *, tuples: bool = False) -> bool:
    """True when flattening `value` would yield a tensor: a value that must not stay one object."""
    if is_tensor(value):
        return True
    if isinstance(value, Mapping):
        return any(holds_tensor(v, is_tensor, tuples=tuples) for v in value.values())
    if isinstance(value, (list, tuple) if tuples else list):
        return any(holds_tensor(v, is_tensor, tuples=tuples) for v in value)
    return False


def replace_leaves(tree: Any, kinds: Mapping[type, Callable[[Any], Any]], seen: dict[int, Any] | None = None) -> Any:
    """`tree` with every leaf of a type in `kinds` replaced by `kinds[type](leaf)`: lists and
    dicts updated in place, tuples, sets and frozensets rebuilt, shared and cyclic containers
    visited once (an unpickled value may share one container a billion times over)."""
    make = kinds.get(type(tree))
    if make is not None:
        return make(tree)
    if not isinstance(tree, (dict, list, tuple, set, frozenset)):
        return tree
    seen = {} if seen is None else seen
    if id(tree) in seen:
        return seen[id(tree)]
    seen[id(tree)] = tree
    if isinstance(tree, dict):
        for key, value in tree.items():
            tree[key] = replace_leaves(value, kinds, seen)
        return tree
    if isinstance(tree, list):
        tree[:] = [replace_leaves(v, kinds, seen) for v in tree]
        return tree
    rebuilt = type(tree)(replace_leaves(v, kinds, seen) for v in tree)
    seen[id(tree)] = rebuilt
    return rebuilt
