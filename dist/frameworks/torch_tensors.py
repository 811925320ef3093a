"""PyTorch for `hpckpt.dist`: DTensor and `chunk_info` shards, host arrays, in-place fills and
collectives over a torch process group. With `hpckpt.dist.torch_storage` (hpckpt inside torch
DCP), the only module of hpckpt that imports torch (interface: `hpckpt.dist.frameworks`).

Every collective here returns only once gloo's worker threads have let go of its tensors
(`_settle`). A gloo worker drops a finished collective's tensors after it has woken the caller,
and dropping a tensor that Python also holds takes the GIL; when that happens after the
interpreter began to finalize (a script that returns right after a collective, with its process
group still alive: FSDP2 keeps it alive past `destroy_process_group()`), CPython 3.11 ends the
worker with `pthread_exit`, whose unwinding through the work's noexcept destructor aborts the
process ("terminate called without an active exception"). Settled, hpckpt's collectives are
never the ones pending at exit. docs/library.md ("Clean exits") tells the whole story.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hpckpt.core.dtypes import DType, dtype as parse_dtype
from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import Box, full_box
from hpckpt.core.geometry.layout import Mesh, Replicate as LayoutReplicate, Shard as LayoutShard, TensorLayout
from hpckpt.dist.shards import Shards, chunk_info_shards

NAME = "torch"


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def dtype_of(t: torch.Tensor, fqn: str) -> DType:
    try:
        return parse_dtype(str(t.dtype))
    except Exception:
        raise GeometryError(f"{fqn}: dtype {t.dtype} has no checkpoint dtype") from None


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def native_shards(fqn: str, value: torch.Tensor) -> Shards:
    """DTensors (their placements), tensors with HyperParallel's `chunk_info`, plain tensors.

    Raises:
        GeometryError: a placement hpckpt cannot store as a box (Partial: unreduced values; a
            strided shard: not one box), or a `chunk_info` that does not fit the tensor.
    """
    if isinstance(value, DTensor):
        return _dtensor(fqn, value)
    info = getattr(value, "chunk_info", None)
    if info is not None:
        return chunk_info_shards(fqn, value.detach(), tuple(value.shape), info, dtype_of(value, fqn))
    local = value.detach()
    shape = tuple(local.shape)
    return Shards(dtype_of(local, fqn), shape, [(full_box(shape), local)], replicated=True)


def _dtensor(fqn: str, value: DTensor) -> Shards:
    for p in value.placements:
        if type(p) not in (Shard, Replicate):  # (subclasses: strided shards, masked partials)
            raise GeometryError(
                f"{fqn}: a DTensor placed {p} cannot be saved as boxes of the global tensor",
                hint="Partial values are not reduced yet (redistribute to Replicate or Shard first); "
                     "strided shards are not one box")
    local = value.to_local().detach()
    shape = tuple(value.shape)
    if value.device_mesh.get_coordinate() is None:  # this rank is not in the tensor's mesh
        return Shards(dtype_of(local, fqn), shape, [])
    sizes, offsets = compute_local_shape_and_global_offset(shape, value.device_mesh, value.placements)
    sizes, offsets = tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)
    if tuple(local.shape) != sizes:
        raise GeometryError(f"{fqn}: the local shard is {list(local.shape)}, its placements give {list(sizes)}")
    if any(s == 0 for s in sizes):
        offsets = tuple(min(o, n) for o, n in zip(offsets, shape))
    return Shards(dtype_of(local, fqn), shape, [(Box(offsets, sizes), local)], layout=_layout(value))


_meshes: dict[int, tuple[Any, Mesh]] = {}  # id(DeviceMesh) -> (the mesh, kept alive; its hpckpt Mesh)


def _layout(value: DTensor) -> TensorLayout:
    """The DTensor's mesh and placements as an hpckpt layout (torch splits like torch.chunk: the
    "ceil" rule); the Mesh made once per DeviceMesh (a mesh of thousands of ranks is not free)."""
    device_mesh = value.device_mesh
    known = _meshes.get(id(device_mesh))
    if known is None or known[0] is not device_mesh:
        if len(_meshes) > 64:
            _meshes.clear()
        known = _meshes[id(device_mesh)] = (device_mesh, Mesh(tuple(device_mesh.shape),
                                                              tuple(device_mesh.mesh.flatten().tolist())))
    placements = tuple(LayoutShard(p.dim, "ceil") if isinstance(p, Shard) else LayoutReplicate()
                       for p in value.placements)
    return TensorLayout(known[1], placements)


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's elements in hpckpt's storage dtype (raw bits for bfloat16
    and float8, which numpy lacks); strides kept, nothing copied."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
        return t.view(torch.uint8).numpy()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        signed = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}[t.dtype]
        return t.view(signed).numpy().view(np.dtype(f"<u{t.dtype.itemsize}"))
    return t.numpy()


def to_numpy(t: torch.Tensor, *, copy: bool) -> np.ndarray:
    """The tensor's elements on the host in storage form. `copy`: a copy the caller may change
    its tensor after (in pinned memory, without waiting, when `t` is on an accelerator: call
    `after_staging()` before reading the arrays)."""
    if copy:
        pinned = t.device.type != "cpu" and torch.cuda.is_available()
        staged = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        staged.copy_(t, non_blocking=pinned)
        return _bits(staged)
    return _bits(t if t.device.type == "cpu" else t.cpu())


def after_staging() -> None:
    """The non-blocking copies into pinned memory are done."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def direct_view(t: torch.Tensor, source: DType) -> np.ndarray | None:
    """`t`'s own memory as an array, when a read in `source` dtype can land there directly."""
    if t.device.type == "cpu" and t.is_contiguous() and str(t.dtype).removeprefix("torch.") == source.name:
        return _bits(t)
    return None


def tensor_of(array: np.ndarray, source: DType) -> torch.Tensor:
    """The tensor over `array`'s bytes with dtype `source` (raw uint16 bits -> bfloat16)."""
    t = torch.from_numpy(np.ascontiguousarray(array) if array.ndim else np.array(array))
    like = getattr(torch, source.name)
    return t if t.dtype == like else t.view(like)


def fill(t: torch.Tensor, array: np.ndarray, source: DType, rows: tuple[int, int] | None = None) -> None:
    """Copy `array` (`source` dtype, storage form) into `t`, or into rows [a, b) of its dim 0,
    converting the dtype on the copy."""
    values = tensor_of(array, source)
    if rows is None:
        t.copy_(values.reshape(t.shape))
    else:
        t[rows[0]:rows[1]].copy_(values.reshape(t[rows[0]:rows[1]].shape))


#: How long a collective waits for gloo's workers to let go of its tensors. They do within
#: microseconds; tensors still held after this are held by something else (a debugging wrapper
#: of torch's, say), and this process stops waiting for any.
SETTLE_SECONDS = 1.0
_settling = {"on": True}


def _refcounts(tensors: list[torch.Tensor]) -> list[int]:
    return [sys.getrefcount(t) for t in tensors]


def _settle(tensors: list[torch.Tensor], before: list[int]) -> None:
    """Wait until no other thread holds `tensors` (their Python reference counts are back to
    `before`, taken the same way before the collective), sleeping so that a worker waiting for
    the GIL gets it."""
    deadline, pause = time.monotonic() + SETTLE_SECONDS, 0.0
    while _refcounts(tensors) != before:
        if time.monotonic() > deadline:
            _settling["on"] = False
            return
        time.sleep(pause)
        pause = min(max(pause * 2, 1e-4), 1e-2)


class Comm:
    """Exchanges over a torch process group (gloo on CPU, nccl on GPUs)."""

    def __init__(self, group: Any = None):
        self.group = group if group is not None else tdist.group.WORLD
        self.rank, self.world_size = tdist.get_rank(self.group), tdist.get_world_size(self.group)
        self.is_world = self.world_size == tdist.get_world_size()  # (group ranks are global ranks)
        self.backend = backend = str(tdist.get_backend(self.group))
        # nccl moves only accelerator tensors (the untested path here: no GPU on this machine)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        # gloo's workers release a work right after finishing it, and gloo has no shutdown: its
        # threads live as long as the group object. nccl's watchdog releases works on its own
        # schedule (a sleep between sweeps: settling would add it to every collective), and
        # `destroy_process_group()` shuts nccl groups down (ProcessGroupNCCL::shutdown).
        self.settles = backend == "gloo"

    def _run(self, start: Any, tensors: list[torch.Tensor]) -> None:
        """Start a collective over `tensors` (`start()` returns its work), wait for it, settle."""
        before = _refcounts(tensors)
        work = start()
        if work is not None:  # None: this rank is not in the group
            work.wait()
        del work  # the work's last reference is then the worker's, or none
        if self.settles and _settling["on"]:
            _settle(tensors, before)

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.to(self.device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._run(lambda: tdist.all_gather(out, t, group=self.group, async_op=True), [t, *out])
        return [o.cpu() for o in out]

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (JSON), in rank order: the lengths, then the padded documents."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = [int(n) for n in self._all_gather(torch.tensor([data.numel()], dtype=torch.int64))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        return [json.loads(bytes(doc[:n].numpy())) for doc, n in zip(self._all_gather(padded), sizes)]

    def barrier(self) -> None:
        tdist.barrier(group=self.group)  # (gloo's barrier holds no tensors: nothing to settle)

    def global_rank(self, group_rank: int) -> int:
        return tdist.get_global_rank(self.group, group_rank)

    def groups(self, sets: list[tuple[int, ...]]) -> dict:
        """A process group per set of (group) ranks; every rank creates every one, in order."""
        world = tuple(range(self.world_size))
        return {ranks: self.group if ranks == world else
                tdist.new_group([self.global_rank(r) for r in ranks], group_desc="hpckpt_load_broadcast")
                for ranks in sets}

    def broadcast(self, buffer: np.ndarray, src: int, handle: Any) -> np.ndarray:
        data = torch.from_numpy(buffer).to(self.device)
        self._run(lambda: tdist.broadcast(data, src=self.global_rank(src), group=handle, async_op=True), [data])
        return data.cpu().numpy() if self.device.type != "cpu" else buffer

    def release(self, handles: dict) -> None:
        for group in handles.values():
            if group is not self.group:
                tdist.destroy_process_group(group)


def comm_of(process_group: Any = None) -> Comm | None:
    if process_group is None and not (tdist.is_available() and tdist.is_initialized()):
        return None
    return Comm(process_group)
