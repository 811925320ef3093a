"""Stateful values, as torch.distributed.checkpoint treats them: saved as what their
`state_dict()` returns, loaded by filling that in place and handing it to `load_state_dict()`.

A value is Stateful when it has callable `state_dict` and `load_state_dict` attributes (torch's
`Stateful` protocol, recognised without importing torch: an `nn.Module`, an optimizer, an LR
scheduler or a recipe's `AppState` alike). torch resolves them at the top level of the state
dict only; here they are resolved anywhere in the caller's own dicts and lists, but not inside
what a Stateful's `state_dict()` returns (that tree is the object's to interpret).

The caller's containers are never changed on the way: a container on the path to a Stateful is
copied into the view, one that holds none is the caller's own. So a value loaded under a
Stateful goes into the tree its `state_dict()` returned, any other into the caller's state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpckpt.dist.flatten import Path


def is_stateful(value: Any) -> bool:
    return not isinstance(value, (Mapping, type)) and callable(getattr(value, "state_dict", None)) \
        and callable(getattr(value, "load_state_dict", None))


@dataclass
class Resolved:
    """The caller's state dict with each Stateful replaced by its `state_dict()` (`view`), and
    those objects by their path in it."""

    view: Any
    objects: dict[Path, tuple[Any, Any]] = field(default_factory=dict)  # path -> (object, its state dict)

    def owner(self, path: Path) -> Path | None:
        """The path of the Stateful whose state dict holds `path`, if any."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.objects:
                return path[:n]
        return None

    def restore(self) -> None:
        """Hand each Stateful its filled state dict, in the order they were found."""
        for obj, state in self.objects.values():
            obj.load_state_dict(state)


def resolve(state_dict: Any, is_tensor: Callable[[Any], bool]) -> Resolved:
    """Call `state_dict()` on every Stateful in the caller's dicts and lists (once each).

    Raises:
        TypeError: a Stateful's `state_dict()` returned something other than a mapping.
    """
    resolved = Resolved(None)

    def visit(value: Any, path: Path) -> Any:
        if is_tensor(value):
            return value
        if is_stateful(value):
            state = value.state_dict()
            if not isinstance(state, Mapping):
                raise TypeError(f"{'.'.join(map(str, path)) or 'the state dict'}: {type(value).__name__}.state_dict() "
                                f"returned a {type(state).__name__}, not a mapping")
            resolved.objects[path] = (value, state)
            return state
        if isinstance(value, Mapping):
            items = {k: visit(v, path + (str(k),)) for k, v in value.items()}
            return items if any(items[k] is not v for k, v in value.items()) else value
        if isinstance(value, (list, tuple)):
            items = [visit(v, path + (i,)) for i, v in enumerate(value)]
            if all(a is b for a, b in zip(items, value)):
                return value
            if isinstance(value, list) or type(value) is tuple:
                return items if isinstance(value, list) else tuple(items)
            return type(value)(*items)  # a named tuple
        return value

    resolved.view = visit(state_dict, ())
    return resolved
