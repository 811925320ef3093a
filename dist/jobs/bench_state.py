"""The bench's state: its Sharded leaves, the empty twin a load fills, and the check that a load
gave back, bit for bit, what was saved."""

from __future__ import annotations

from typing import Any, Callable


def _walk(node: Any, path: tuple = ()):
    """(path, leaf) of a nested state in a fixed order (dicts and lists are containers)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, (*path, i))
    else:
        yield path, node


def mapped(node: Any, leaf: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """The same nesting with every leaf replaced by `leaf(path, value)`."""
    if isinstance(node, dict):
        return {k: mapped(v, leaf, (*path, k)) for k, v in node.items()}
    if isinstance(node, list):
        return [mapped(v, leaf, (*path, i)) for i, v in enumerate(node)]
    return leaf(path, node)


def empty_like(state: dict, fw, framework: str) -> dict:
    """A zero state of the same tensors, layouts and nesting, values None (what a load fills).
    Every page is written once here, so a load's peak RSS is the loader's own memory."""
    from hpckpt.dist.jobs import tensors
    from hpckpt.dist.layouts import Sharded

    def leaf(_path, obj):
        if not isinstance(obj, Sharded):
            return None
        dtype = fw.dtype_of(obj.local, "")
        local = tensors.empty(framework, fw.shape_of(obj.local), dtype)
        view = fw.direct_view(local, dtype)
        if view is not None:
            view.fill(0)
        return Sharded(local, obj.shape, obj.layout)

    return mapped(state, leaf)


def sharded_leaves(state: dict) -> list[tuple[tuple, Any]]:
    from hpckpt.dist.layouts import Sharded

    return [(path, obj) for path, obj in _walk(state) if isinstance(obj, Sharded)]


def check_equal(fw, saved: dict, loaded: dict, who: str, rank: int) -> None:
    """Every local tensor of `loaded` bit-equal to the one of `saved` at the same place.

    Raises:
        CheckFailedError: the first tensor that differs, named.
    """
    import numpy as np

    from hpckpt.core.errors import CheckFailedError

    for (path, want), (_p, got) in zip(sharded_leaves(saved), sharded_leaves(loaded)):
        a = np.ascontiguousarray(fw.to_numpy(want.local, copy=False)).reshape(-1).view(np.uint8)
        b = np.ascontiguousarray(fw.to_numpy(got.local, copy=False)).reshape(-1).view(np.uint8)
        if not np.array_equal(a, b):
            raise CheckFailedError(f"rank {rank}: {who} loaded {'.'.join(map(str, path))} with other values "
                                   "than were saved")
