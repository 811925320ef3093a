"""The framework behind a state dict: one module per framework, with one interface.

`hpckpt.dist`'s save and load are written once; what differs between PyTorch and MindSpore (what
a tensor is, what a rank holds of it, host arrays, in-place fills, the collectives) lives in
`torch_tensors` and `mindspore_tensors`, each importing its framework and nothing else does.
A state dict's framework is found from its tensors without importing any framework: a tensor of
a framework means that framework is already imported.

The interface (module-level names): `NAME`; `is_tensor(obj)`; `dtype_of(t, fqn)`;
`shape_of(t)`; `native_shards(fqn, obj) -> Shards` (the layouts the framework's own tensors
carry); `to_numpy(t, copy=)` (raw bits for bfloat16/float8); `direct_view(t, dtype)`;
`fill(t, array, dtype, rows=None)`; `Comm` (`rank`, `world_size`, `backend`, `all_gather_json`,
`barrier`, `groups`, `broadcast`, `release`, `global_rank`); `comm_of(process_group)` (None
when the framework's communication is not initialised).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

MODULES = {"torch": "hpckpt.dist.frameworks.torch_tensors", "mindspore": "hpckpt.dist.frameworks.mindspore_tensors"}


def named(name: str) -> ModuleType:
    if name not in MODULES:
        raise ValueError(f"framework must be one of {', '.join(MODULES)}, not {name!r}")
    return importlib.import_module(MODULES[name])


def of(obj: Any) -> ModuleType | None:
    """The framework module of a tensor (a `Sharded` counts as its local tensor's), else None."""
    from hpckpt.dist.layouts import Sharded

    if isinstance(obj, Sharded):
        obj = obj.local
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return named("torch")
    mindspore = sys.modules.get("mindspore")
    if mindspore is not None and isinstance(obj, mindspore.Tensor):
        return named("mindspore")
    return None


def is_any_tensor(obj: Any) -> bool:
    return of(obj) is not None


def of_state(flat: dict[str, Any], default: str | None = None) -> ModuleType:
    """The one framework of a flattened state dict's tensors.

    Raises:
        ValueError: tensors of two frameworks in one state dict.
    """
    found: dict[str, ModuleType] = {}
    for obj in flat.values():
        fw = of(obj)
        if fw is not None:
            found.setdefault(fw.NAME, fw)
    if len(found) > 1:
        raise ValueError(f"a state dict holds tensors of {' and '.join(sorted(found))}: save or load one framework's")
    if found:
        return next(iter(found.values()))
    if default is None:  # values only: whichever framework is imported (torch first)
        default = "torch" if "torch" in sys.modules or "mindspore" not in sys.modules else "mindspore"
    return named(default)
