"""torch.distributed.checkpoint's keyword forms, so that loops written for `dcp.save`/`dcp.load`
call `hpckpt.dist` unchanged: what maps onto hpckpt's options, and one clear TypeError for the
torch-only parameters hpckpt does not take (a planner, another library's storage, a stager)."""

from __future__ import annotations

import os
from typing import Any

#: torch's `AsyncCheckpointerType` values that hpckpt's async_save is (it persists on a thread)
THREAD = "thread"

_INSTEAD = {
    "planner": "hpckpt plans the save itself (each replicated box stored once; `dedup=` chooses who stores "
               "it); to use your own planner, call torch's dcp.save/dcp.load with a planner and hpckpt's "
               "storage (hpckpt.dist.torch_storage)",
    "storage_writer": "pass the destination as `checkpoint_id=` (hpckpt's own HpckptWriter is taken)",
    "storage_reader": "pass the checkpoint as `checkpoint_id=` (hpckpt's own HpckptReader is taken)",
    "async_stager": "hpckpt.dist.async_save stages the shards itself (to pinned memory for accelerator tensors); "
                    "drop async_stager",
    "async_checkpointer_type": "hpckpt.dist.async_save persists on a thread (AsyncCheckpointerType.THREAD); "
                               "drop async_checkpointer_type",
}


def _hpckpt_storage(value: Any) -> bool:
    """hpckpt's own HpckptReader/HpckptWriter (`dist.torch_storage`), told without importing it."""
    return type(value).__module__ == "hpckpt.dist.torch_storage"


def refuse_torch_only(call: str, **given: Any) -> None:
    """Raise TypeError for the first torch-only parameter given a value hpckpt cannot honour."""
    for name, value in given.items():
        if value is None or (name.startswith("storage_") and _hpckpt_storage(value)):
            continue
        if name == "async_checkpointer_type" and str(getattr(value, "value", value)).lower() == THREAD:
            continue
        raise TypeError(f"hpckpt.dist.{call}() does not take {name}={type(value).__name__}: {_INSTEAD[name]}")


def checkpoint_path(call: str, checkpoint_id: str | os.PathLike | None, storage: Any = None) -> str | os.PathLike:
    """The checkpoint's path: `checkpoint_id`, else that of hpckpt's own storage object."""
    if checkpoint_id is None and _hpckpt_storage(storage):
        checkpoint_id = storage.path
    if checkpoint_id is None:
        raise TypeError(f"hpckpt.dist.{call}() needs checkpoint_id (the checkpoint's directory)")
    return checkpoint_id


def coordination_of(coordination: str, use_collectives: bool) -> str:
    """torch's `use_collectives=False` (no cross-rank synchronisation, per-rank metadata) is
    hpckpt's `coordination="none"`."""
    if use_collectives:
        return coordination
    if coordination not in ("collectives", "none"):
        raise ValueError(f"use_collectives=False and coordination={coordination!r} contradict each other: "
                         "use_collectives=False is coordination='none'")
    return "none"


def format_of(format: str | None, storage_writer: Any) -> str:
    """The output format: as given; by default HyperParallel, or PyTorch DCP when the caller
    handed hpckpt's own HpckptWriter (which writes PyTorch DCP under torch's `dcp.save`)."""
    if format is not None:
        return format
    return "torch-dcp" if _hpckpt_storage(storage_writer) else "hyperparallel"
