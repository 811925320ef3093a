"""The bench's contenders on one state: hpckpt.dist, and the framework's own checkpointing —
PyTorch DCP on DTensors made from the same local shards (torchrun), MindSpore's
`save_checkpoint` / `load_checkpoint` of one file per rank (msrun).

Each has `name`, `fsync` (whether its saves are durable), `save(dest)`, `async_save(dest)` (a
wait function), `prepare_load(target)` (untimed) and `load(dest, prepared)`; each returns the
figures only it can give. A framework is imported when its contender is built, never at import.
"""

from __future__ import annotations

import contextlib
import math
import threading
from pathlib import Path
from typing import Callable

from hpckpt.core.commit.durable import fsync_path
from hpckpt.dist.jobs.bench_state import mapped, sharded_leaves


class Hpckpt:
    """hpckpt.dist on the state as built (Sharded local tensors)."""

    name = "hpckpt"
    fsync = {"save": True, "async_save": True}

    def __init__(self, ctx, state: dict, nbytes: int):
        self.ctx, self.state, self.nbytes = ctx, state, nbytes

    def save(self, dest: Path) -> dict:
        import hpckpt.dist as hdist

        hdist.save(self.state, dest, progress=self.ctx.progress)
        return {}

    def async_save(self, dest: Path) -> tuple[Callable[[], None], dict]:
        import hpckpt.dist as hdist

        handle = hdist.async_save(self.state, dest, progress=self.ctx.progress)
        return handle.result, {}

    def prepare_load(self, target: dict) -> dict:
        return target

    def load(self, dest: Path, target: dict) -> dict:
        import hpckpt.dist as hdist

        r = hdist.load(target, dest, progress=self.ctx.progress)
        return {"bytes_read": r.bytes_read, "job_bytes_read": r.job_bytes_read, "job_bytes_wanted": r.job_bytes_wanted,
                "read_amplification": r.read_amplification, "bytes_broadcast": r.bytes_broadcast,
                "broadcast": r.broadcast, "broadcast_reason": r.broadcast_reason, "wants_from": r.wants_from}


# -- PyTorch DCP ------------------------------------------------------------------------------

class TorchDCP:
    """torch.distributed.checkpoint on DTensors sharing the local tensors of the state.

    DTensor cuts uneven dims with the ceil rule (`torch.chunk`); a layout whose boxes differ from
    torch's (hpckpt's default "balanced" split of an uneven dim) cannot be described to DCP, so
    it is refused, naming the tensor."""

    name = "torch_dcp"
    fsync = {"save": True, "async_save": True}  # FileSystemWriter(sync_files=True) by default

    def __init__(self, ctx, state: dict, nbytes: int):
        import torch.distributed.checkpoint  # noqa: F401 - its slow import (docs/design-figures.md) outside every timed phase

        self.ctx, self.nbytes = ctx, nbytes
        self._meshes: dict = {}
        self.state = self.as_dtensors(state)

    def _mesh(self, shape: tuple[int, ...]):
        from torch.distributed.device_mesh import init_device_mesh

        if shape not in self._meshes:  # every rank builds the same meshes in the same order
            self._meshes[shape] = init_device_mesh("cpu", shape)
        return self._meshes[shape]

    def _dtensor(self, fqn: str, s):
        import torch
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        from hpckpt.core.errors import GeometryError
        from hpckpt.core.geometry.layout.placements import Shard as HpShard

        layout = s.layout
        if layout.mesh.ranks != tuple(range(self.ctx.world_size)) or layout.order is not None:
            raise GeometryError(f"{fqn}: layout {layout} is not a DTensor layout over ranks "
                                f"0..{self.ctx.world_size - 1} in order",
                                hint="compare with torch DCP on a mesh of the whole job in rank order")
        placements = []
        for p in layout.placements:
            if isinstance(p, HpShard):
                placements.append(Shard(p.dim))
            elif str(p) == "R":
                placements.append(Replicate())
            else:
                raise GeometryError(f"{fqn}: placement {p} has no DTensor equivalent")
        mesh = self._mesh(layout.mesh.shape)
        local = s.local
        box = s.box(fqn, self.ctx.rank, tuple(local.shape))
        sizes, offsets = compute_local_shape_and_global_offset(s.shape, mesh, placements)
        if box is None or tuple(sizes) != box.sizes or (box.volume and tuple(offsets) != box.offsets):
            raise GeometryError(
                f"{fqn}: {list(s.shape)} split by {layout}: rank {self.ctx.rank} holds "
                f"{list(box.sizes) if box else None} at {list(box.offsets) if box else None}, a DTensor "
                f"{list(sizes)} at {list(offsets)}: torch splits uneven dims with the ceil rule, pass --split ceil",
                hint="pass --split ceil to compare with torch DCP")
        stride = tuple(int(torch.Size(s.shape[d + 1:]).numel()) for d in range(len(s.shape)))
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(s.shape), stride=stride)

    def as_dtensors(self, state: dict) -> dict:
        """The state with every Sharded leaf a DTensor over the same local tensor (no copy)."""
        from hpckpt.dist.layouts import Sharded

        return mapped(state, lambda path, obj: self._dtensor(".".join(map(str, path)), obj)
                      if isinstance(obj, Sharded) else obj)

    def save(self, dest: Path) -> dict:
        import torch.distributed.checkpoint as dcp

        self.ctx.progress.start(self.nbytes)
        dcp.save(self.state, checkpoint_id=str(dest))
        self.ctx.progress.advance(self.nbytes)
        return {}

    def async_save(self, dest: Path) -> tuple[Callable[[], None], dict]:
        import torch.distributed.checkpoint as dcp

        self.ctx.progress.start(self.nbytes)
        future = dcp.async_save(self.state, checkpoint_id=str(dest))
        done = getattr(future, "upload_completion", future)  # torch >= 2.9 may answer an AsyncSaveResponse

        def wait() -> None:
            done.result()
            self.ctx.progress.advance(self.nbytes)

        return wait, {}

    def prepare_load(self, target: dict) -> dict:
        return self.as_dtensors(target)

    def load(self, dest: Path, state: dict) -> dict:
        import torch.distributed.checkpoint as dcp

        self.ctx.progress.start(self.nbytes)
        dcp.load(state, checkpoint_id=str(dest))
        self.ctx.progress.advance(self.nbytes)
        return {}


# -- MindSpore --------------------------------------------------------------------------------

class MindSpore:
    """MindSpore's own: every rank `save_checkpoint` of its local shards to its own `.ckpt`
    (a list of name/data items: a dict of Parameters re-wrapped with their names would copy each
    tensor, plain Tensors in a dict are dropped), `load_checkpoint(file, net=cell)` into a cell
    holding the fresh Parameters. Only tensors: MindSpore's `append_dict` cannot hold the
    state's tuple and nested values. `async_save=True` is MindSpore's thread mode: the caller
    waits for a deep copy of the host arrays; the file is complete once the thread named
    `asyn_save_ckpt` ends (what MindSpore's own atexit hook joins). No fsync, files 0400."""

    name = "mindspore"
    fsync = {"save": False, "async_save": False}
    THREAD = "asyn_save_ckpt"

    def __init__(self, ctx, state: dict, nbytes: int):
        self.ctx, self.nbytes = ctx, nbytes
        self._items = [{"name": ".".join(map(str, path)), "data": s.local}
                       for path, s in sharded_leaves(state) if math.prod(s.local.shape)]

    def _file(self, dest: Path) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        return dest / f"rank_{self.ctx.rank}.ckpt"

    def save(self, dest: Path) -> dict:
        import mindspore

        path = self._file(dest)
        self.ctx.progress.start(self.nbytes)
        mindspore.save_checkpoint(self._items, str(path))
        self.ctx.progress.advance(self.nbytes)
        return {}

    def make_durable(self, dest: Path) -> None:
        """Not MindSpore's: the fsync of this rank's file that a durable save would add."""
        fsync_path(dest / f"rank_{self.ctx.rank}.ckpt")

    def async_save(self, dest: Path) -> tuple[Callable[[], None], dict]:
        import mindspore

        path = self._file(dest)
        self.ctx.progress.start(self.nbytes)
        mindspore.save_checkpoint(self._items, str(path), async_save=True)

        def wait() -> None:
            for thread in threading.enumerate():
                if thread.name == self.THREAD:
                    thread.join()
            self.ctx.progress.advance(self.nbytes)

        return wait, {}

    def prepare_load(self, target: dict):
        """A cell holding the target's Parameters under their names (built before the clock)."""
        import mindspore
        from mindspore import nn

        params = []
        for path, s in sharded_leaves(target):
            if math.prod(s.local.shape):
                s.local.name = ".".join(map(str, path))
                params.append(s.local)

        class Holder(nn.Cell):
            def __init__(self, held):
                super().__init__()
                self.held = mindspore.ParameterTuple(held)

        return Holder(params)

    def load(self, dest: Path, net) -> dict:
        import mindspore
        from mindspore.train import serialization

        file = dest / f"rank_{self.ctx.rank}.ckpt"
        bypassed = False
        free = serialization._get_available_memory()  # MemFree: MindSpore refuses a larger .ckpt
        if free is not None and file.stat().st_size > free:
            bypassed = True
        self.ctx.progress.start(self.nbytes)
        with _memfree_guard_off(serialization, bypassed):
            mindspore.load_checkpoint(str(file), net=net, strict_load=True)
        self.ctx.progress.advance(self.nbytes)
        return {"memfree_guard_bypassed": bypassed}


@contextlib.contextmanager
def _memfree_guard_off(serialization, active: bool):
    """Lift MindSpore's "file larger than MemFree" refusal for one load, only when it would refuse
    a file this machine can hold (MemFree leaves out the page cache)."""
    if not active:
        yield
        return
    saved = serialization._get_available_memory
    serialization._get_available_memory = lambda: None
    try:
        yield
    finally:
        serialization._get_available_memory = saved
