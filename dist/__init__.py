"""Save and load inside a running PyTorch or MindSpore job: `save`, `async_save`, `load`.

The live half of hpckpt. Every rank describes what it holds (DTensor shards, plain tensors,
tensors carrying HyperParallel's `chunk_info`, tensors wrapped with their layout by `sharded`,
values), the local plans are gathered, every rank
builds the same global plan from them (`core.geometry.global_plan`: replicas stored once), each rank writes
its own files through the one HyperParallel writer and engine into a shared staging directory,
and the coordinator commits (`.metadata` last, one rename). Loading reads, on each rank, only the
overlaps of its boxes with the saved ones, from any format hpckpt reads; a box several ranks want
is read once and broadcast.

The framework is the state dict's (`frameworks`): torch is imported only by
`frameworks.torch_tensors`, MindSpore only by `frameworks.mindspore_tensors`, and only when the
state dict holds their tensors (`hpckpt.core` and the CLI import neither).

    from hpckpt import dist as hdist
    result = hdist.save({"model": model_sd, "optim": optim_sd}, "ckpt/step100")
    handle = hdist.async_save(state, "ckpt/step200"); ...; handle.result(timeout=600)
    loaded = hdist.load(state, "ckpt/step200")        # fills the tensors of `state` in place
"""

from hpckpt.core.errors import CoordinationTimeoutError
from hpckpt.dist.layouts import Sharded, sharded
from hpckpt.dist.load import load
from hpckpt.dist.results import AsyncSaveHandle, LoadResult, SaveResult
from hpckpt.dist.save import async_save, save

__all__ = ["save", "async_save", "load", "sharded", "Sharded", "SaveResult", "LoadResult", "AsyncSaveHandle",
           "CoordinationTimeoutError"]
