"""Counters with no one-to-one counterpart in the other framework, computed for `convert-ms-torch`.

`naming.mapping` decides which destination tensors are derived (MindSpore's one `global_step`
becomes a `step` per torch parameter, torch's steps and betas become `beta1_power`...); this
computes their values from the source's counters, which are small tensors or plain values, and
presents them, held in memory, beside the source's own tensors (`core.io.memory_source`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hpckpt.converters.naming.entries import Derived
from hpckpt.converters.naming.presets import DEFAULT_ADAM_BETAS
from hpckpt.core.errors import EntryMismatchError
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.memory_source import MemoryTensor, with_memory_tensors
from hpckpt.core.io.read import read_box


def _scalars(index: CheckpointIndex, name: str) -> list[float]:
    """The numbers a counter holds: a tensor's elements or a plain value (number, tuple...)."""
    if name in index.tensors:
        entry = index.tensors[name]
        if not entry.dtype.is_exact_in_numpy:
            raise EntryMismatchError(f"{name}: a {entry.dtype} counter cannot be read as a number")
        return [float(v) for v in np.asarray(read_box(index, entry)).reshape(-1)]
    if name in index.values:
        value = index.decode_value(name)
        return [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    raise EntryMismatchError(f"{name}: the counter it derives from is not in the source")


def _agreed(scalars: Callable[[str], list[float]], names: list[str], what: str) -> float:
    found = {tuple(scalars(n))[:1] for n in names}
    found.discard(())
    if len(found) > 1:
        raise EntryMismatchError(f"{what}: its sources disagree ({', '.join(names[:4])}...)")
    return found.pop()[0] if found else 0.0


def derive_values(index: CheckpointIndex, derived: Iterable[Derived]) -> tuple[dict[str, np.ndarray], list[str]]:
    """The value of each `Derived` entry, as an array of its dtype and shape, and a warning for
    each whose dtype cannot hold the value exactly (a `global_step` above 2**24 in torch's float32
    `step`, rounded as torch itself would round it)."""
    # read each counter once: a preset derives a `step` (or `lr`) per parameter from one counter,
    # and both beta powers from the same steps
    scalars = functools.cache(lambda name: _scalars(index, name))
    out: dict[str, np.ndarray] = {}
    warnings: list[str] = []
    for d in derived:
        if d.kind == "num_batches_tracked":
            value = 0.0
        elif d.kind == "step":
            value = _agreed(scalars, list(d.sources), d.destination)
        elif d.kind == "lr":
            value = _lr(index, scalars, list(d.sources))
        elif d.kind in ("beta1_power", "beta2_power"):
            steps = [s for s in d.sources if s.endswith("step")]
            betas = [s for s in d.sources if s not in steps]
            which = 0 if d.kind == "beta1_power" else 1
            # no betas in the source (e.g. safetensors): the default both frameworks' Adam uses
            beta = {tuple(scalars(b))[which] for b in betas} if betas else {DEFAULT_ADAM_BETAS[which]}
            if len(beta) != 1:
                raise EntryMismatchError(f"{d.destination}: the parameter groups have different betas")
            value = beta.pop() ** _agreed(scalars, steps, d.destination)
        else:
            raise ValueError(f"{d.destination}: unknown derived kind {d.kind!r}")
        out[d.destination] = held = np.full(d.shape, value, dtype=d.dtype.np)
        if held.size and held.reshape(-1)[0].item() != value:
            warnings.append(f"{d.destination}: {value!r} is held as {held.reshape(-1)[0].item()!r} by its dtype "
                            f"{held.dtype}, the one the destination framework uses")
    return out, warnings


def _lr(index: CheckpointIndex, scalars: Callable[[str], list[float]], sources: list[str]) -> float:
    """One learning rate: the value itself, or a MindSpore 1-D schedule read at `global_step`."""
    rates = {tuple(scalars(s)) for s in sources}
    if len(rates) != 1:
        raise EntryMismatchError(f"learning rate: the sources disagree ({', '.join(sources[:4])})")
    schedule = rates.pop()
    if len(schedule) == 1:
        return schedule[0]
    step = int(scalars("global_step")[0]) if "global_step" in index.tensors else 0
    return schedule[min(step, len(schedule) - 1)]


def with_tensors(index: CheckpointIndex, arrays: dict[str, np.ndarray], dtypes_of: dict[str, Any]) -> CheckpointIndex:
    """`index` plus the derived `arrays` as whole tensors, held in memory."""
    return with_memory_tensors(index, {name: MemoryTensor.whole(dtypes_of[name], np.require(array, requirements="C"))
                                       for name, array in arrays.items()})
