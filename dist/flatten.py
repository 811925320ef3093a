"""Nested state dicts flattened exactly as HyperParallel flattens them, and rebuilt.

Mappings are always descended (keys become `str(key)`); a list or tuple is descended only when it
holds a tensor or a container that is descended itself, otherwise it is one value. The flat name
is the path joined with dots; the path itself (`str` keys, `int` positions) is what `.metadata`
records as `planner_data`, so a checkpoint saved here nests like one HyperParallel saved.
No framework is imported: the caller says what a tensor is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Path = tuple  # of str (mapping keys) and int (list positions)


def _descended(value: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if isinstance(value, Mapping):
        return True
    if isinstance(value, (list, tuple)):
        return any(is_tensor(v) or _descended(v, is_tensor) for v in value)
    return False


def flatten(state_dict: Mapping, is_tensor: Callable[[Any], bool]) -> tuple[dict[str, Any], dict[str, Path]]:
    """`(flat, paths)`: every leaf by its dotted name, and each name's key path.

    Raises:
        ValueError: two paths give the same dotted name (`{"a.b": x, "a": {"b": y}}`).
    """
    flat: dict[str, Any] = {}
    paths: dict[str, Path] = {}

    def visit(value: Any, path: Path) -> None:
        if path and not _descended(value, is_tensor):
            name = ".".join(str(p) for p in path)
            if name in flat:
                raise ValueError(f"two entries of the state dict flatten to the same name {name!r}: "
                                 f"{paths[name]!r} and {path!r}")
            flat[name], paths[name] = value, path
            return
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, child in items:
            visit(child, path + ((str(key) if isinstance(value, Mapping) else key),))

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"a state dict is a mapping, not {type(state_dict).__name__}")
    visit(state_dict, ())
    return flat, paths


def set_path(state_dict: Any, path: Path, value: Any) -> None:
    """Put `value` at `path` in the nested `state_dict`, replacing what is there.

    Mapping keys are matched as `str(key)`, as `flatten` named them."""
    node = state_dict
    for step in path[:-1]:
        node = node[_key(node, step)]
    last = path[-1]
    if isinstance(node, tuple):
        raise TypeError(f"cannot assign into a tuple at {'.'.join(map(str, path))}")
    node[_key(node, last)] = value


def _key(node: Any, step: Any) -> Any:
    if isinstance(node, Mapping):
        if step in node:
            return step
        for k in node:
            if str(k) == step:
                return k
        return step
    return int(step)
