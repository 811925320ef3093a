"""MindSpore for `hpckpt.dist`: `chunk_info` shards, host arrays, in-place fills and collectives
over `mindspore.communication` (interface: `hpckpt.dist.frameworks`). The only module of hpckpt
that imports MindSpore for the live library.

Facts this module is built on (MindSpore 2.10, CPU backend "mccl", measured):

* On CPU `Tensor.asnumpy()` returns an array over the tensor's own memory, for a Parameter too,
  also after a jitted or graph-mode step: a write through it is seen by the next forward. A
  tensor that is a view (`t[1:]`, a transpose) gets a fresh copy instead, so an alias is only
  trusted when the array's address is `t.data_ptr()`. bfloat16 comes back as MindSpore's own
  numpy `bfloat16` and float8 as a 1-byte void dtype: both are re-viewed as raw unsigned ints.
* `t[a:b] = Tensor(...)` writes rows in place; `t.copy_(src)` writes all of `t` in place and
  converts dtypes; `Parameter.set_data` and `assign_value` swap in new memory (old aliases go
  stale); `t[a:b].copy_(...)` fails on CPU (the kernel takes the view for the whole tensor),
  and so does `t[a:b] = ...` for bfloat16 (the CPU slice-copy kernel has no bfloat16): on CPU
  `fill` writes through the host alias instead.
* CPU collectives: `ops.AllGather` takes only float32/float16/int32 (bytes travel as int32)
  and the world group only ("AllGather only support mccl_world_group on CPU"), so a subgroup's
  `Comm` gathers by broadcasts; `ops.communication.broadcast` takes uint8 (not bool) and works
  over subgroups; `create_group` works for a subset of ranks, called by its members only;
  `ops.communication.barrier` does not wait for the other ranks, so `Comm.barrier` is an
  all-gather of one int.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import mindspore as ms

from hpckpt.core.dtypes import DType, dtype as parse_dtype
from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.box import full_box
from hpckpt.core.io.cast import CASTABLE, cast, check_cast
from hpckpt.dist.shards import Shards, chunk_info_shards

NAME = "mindspore"

# MindSpore spellings `core.dtypes` does not parse (it knows `.ckpt` tensor_types only)
_MS_SPELLINGS = {"Float8E4M3FN": "float8_e4m3fn", "Float8E5M2": "float8_e5m2"}


def is_tensor(obj: Any) -> bool:
    """A `mindspore.Tensor`; a Parameter is one (`isinstance(Parameter(...), Tensor)` is True)."""
    return isinstance(obj, ms.Tensor)


def dtype_of(t: Any, fqn: str = "") -> DType:
    """The checkpoint dtype of `t`.

    Raises:
        GeometryError: a dtype hpckpt has no name for (HiFloat8, ...), naming `fqn`.
    """
    spelling = str(t.dtype)
    try:
        return parse_dtype(_MS_SPELLINGS.get(spelling, spelling))
    except Exception:
        raise GeometryError(f"{fqn or 'a tensor'}: dtype {spelling} has no checkpoint dtype") from None


def shape_of(t: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


def native_shards(fqn: str, obj: Any) -> Shards:
    """What this rank holds of `obj`: the box of HyperParallel's `chunk_info` when it carries
    one, else the whole tensor (replicated: every rank holds it whole).

    Raises:
        GeometryError: a `chunk_info` that is not HyperParallel's, or whose box does not fit the
            local tensor or the global shape; a dtype hpckpt has no name for.
    """
    dtype, local_shape = dtype_of(obj, fqn), shape_of(obj)
    info = getattr(obj, "chunk_info", None)
    if info is None:
        return Shards(dtype, local_shape, [(full_box(local_shape), obj)], replicated=True)
    return chunk_info_shards(fqn, obj, local_shape, info, dtype)


def _storage_view(array: np.ndarray, dtype: DType) -> np.ndarray:
    """`asnumpy()`'s array re-viewed in hpckpt's storage dtype (raw bits for bfloat16, float8)."""
    return array if array.dtype == dtype.np else array.view(dtype.np)


def _host(t: Any) -> np.ndarray:
    """`t`'s elements on the host, 0-d kept 0-d. A Tensor subclass' `asnumpy` may hand back
    a numpy scalar for 0-d: make it an array."""
    array = t.asnumpy()
    return array if isinstance(array, np.ndarray) else np.asarray(array)


def to_numpy(t: Any, *, copy: bool) -> np.ndarray:
    """The tensor's elements on the host in storage form, shape kept. `copy=True`: independent of
    later in-place changes to `t` (on CPU `asnumpy()` aliases the tensor, so it is copied);
    `copy=False`: the alias where MindSpore gives one."""
    array = _storage_view(_host(t), dtype_of(t))
    return array.copy() if copy else array


def after_staging() -> None:
    """Nothing to wait for: `asnumpy()` returns only when the copy is done."""


def direct_view(t: Any, source: DType) -> np.ndarray | None:
    """`t`'s own memory as an array when `t` holds `source` elements and the array MindSpore
    hands out really is that memory (a CPU tensor that is not a view); else None."""
    if str(getattr(t, "device", "CPU")) != "CPU" or dtype_of(t) != source:
        return None
    if not t.is_contiguous():
        return None
    array = _host(t)
    if array.size == 0 or array.ctypes.data != t.data_ptr():
        return None
    return _storage_view(array, source)


def tensor_of(array: np.ndarray, source: DType) -> Any:
    """A MindSpore tensor of dtype `source` holding `array` (`source` in storage form)."""
    array = np.require(array, requirements="C")
    if source.name == "bfloat16":
        from mindspore.common.np_dtype import bfloat16 as np_bfloat16

        return ms.Tensor(array.view(np_bfloat16))
    if source.name.startswith("float8"):
        # a float8 view of a uint8 tensor cannot be read back on CPU (no float8 "contiguous"
        # kernel): write the bits into a new float8 tensor's memory instead
        t = ms.Tensor(np.zeros(array.shape, np.float32), getattr(ms, source.name))
        view = direct_view(t, source)
        if array.size == 0:
            return t
        if view is None:
            raise GeometryError(f"cannot build a {source} tensor on this device from host bits")
        np.copyto(view, array.view(np.uint8))
        return t
    return ms.Tensor(array)


def _converted(array: np.ndarray, source: DType, target: DType) -> np.ndarray:
    """`array` (storage of `source`) as storage of `target`. Floating casts go through
    `core.io.cast` (round to nearest even, as torch and the CLI do); other dtypes numpy can hold
    convert as numpy's `astype` does (what torch's `copy_` gives); the rest is refused.

    Raises:
        UnknownFormatError: a conversion of raw-bit dtypes (float8, ...) other than the floating
            casts.
    """
    if source == target:
        return array
    if source.name in CASTABLE and target.name in CASTABLE:
        return cast(array, source, target)
    if source.is_exact_in_numpy and target.is_exact_in_numpy:
        return array.astype(target.np)
    check_cast(source, target)
    raise AssertionError("unreachable: check_cast refuses every other pair")


def fill(t: Any, array: np.ndarray, source: DType, rows: tuple[int, int] | None = None) -> None:
    """Write `array` (`source` elements, storage form) into `t` in place, or into rows [a, b)
    of its dim 0, converting to `t`'s dtype. `t` keeps its identity and its memory, so a
    Parameter of a Cell sees the values.

    On CPU the values are written through `t`'s own memory (no tensor is built); elsewhere by
    MindSpore's in-place ops: `t[a:b] = ...` for rows, `t.copy_(...)` for the whole.
    """
    target = dtype_of(t)
    values = _converted(np.asarray(array), source, target)
    view = direct_view(t, target)
    if view is not None:
        dest = view if rows is None else view[rows[0]:rows[1]]
        np.copyto(dest, values.reshape(dest.shape), casting="no")
    else:
        fill_by_ops(t, values, target, rows)


def fill_by_ops(t: Any, values: np.ndarray, target: DType, rows: tuple[int, int] | None = None) -> None:
    """`fill` where `t`'s memory is not on the host (an accelerator) or not handed out: `values`
    (already `t`'s dtype) through MindSpore's in-place ops, which keep `t`'s memory."""
    if rows is None:
        t.copy_(tensor_of(values.reshape(shape_of(t)), target))
    else:
        a, b = rows
        t[a:b] = tensor_of(values.reshape((b - a, *shape_of(t)[1:])), target)


# --- jobs and collectives -----------------------------------------------------------------------

def is_scheduler() -> bool:
    """True in msrun's scheduler process (`MS_ROLE=MS_SCHED`).

    msrun runs the script once more as its scheduler. That process must call
    `mindspore.communication.init()`: it hosts the cluster's meta server there, serves until
    every worker has ended and then ends the process inside `init()` (exit 0 when all workers
    ended well). A scheduler that returns before `init()` leaves the workers unable to build
    the cluster: they fail after `--cluster_time_out`. So `init_job` calls `init()` in that
    role too and never returns there; the script must not do anything else before it."""
    return os.environ.get("MS_ROLE") == "MS_SCHED"


def _pin_device() -> None:
    """Fix the device to MindSpore's default target (CPU on a CPU build) unless the job chose
    one, before `init()` picks the backend from it."""
    try:
        from mindspore._c_expression import DeviceManagerConf

        chosen = DeviceManagerConf.get_instance().is_device_enable()
    except (ImportError, AttributeError):  # another MindSpore: leave the context as it is
        return
    if not chosen:
        ms.set_device(ms.get_context("device_target"))


def init_job() -> tuple[int, int]:
    """For a worker launched by msrun: the device, `mindspore.communication.init()` (when
    `RANK_SIZE` > 1 or `MS_ROLE` is set) and (rank, world size). In the scheduler role this
    does not return (see `is_scheduler`)."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init

    if not GlobalComm.INITED:
        if int(os.environ.get("RANK_SIZE", "1")) <= 1 and not os.environ.get("MS_ROLE"):
            return 0, 1
        _pin_device()
        init()
    if is_scheduler():  # init() ends the scheduler process; never run the job's code there
        raise SystemExit(0)
    return get_rank(), get_group_size()


@dataclass(frozen=True)
class _Group:
    """A handle of `Comm.groups`: the set's ranks and the MindSpore group name (None when this
    rank is not a member, or the set is one rank: nothing to create)."""

    ranks: tuple[int, ...]
    name: str | None


FIRST_BLOCK_WORDS = 1024  # the first gather of a JSON exchange: 4 KiB a rank


class Comm:
    """Exchanges over `mindspore.communication` (the CPU backend here, HCCL on Ascend). Ranks
    given to and returned by its methods are ranks of its group."""

    def __init__(self, group: str | None = None):
        from mindspore.communication import GlobalComm, get_group_size, get_rank

        self.group = group or GlobalComm.WORLD_COMM_GROUP
        self.is_world = self.group == GlobalComm.WORLD_COMM_GROUP
        self.rank, self.world_size = get_rank(self.group), get_group_size(self.group)
        self._gather = ms.ops.AllGather(self.group)
        # on CPU AllGather takes the world group only: a subgroup gathers by one broadcast per rank
        self._gather_by_broadcast = not self.is_world and ms.get_context("device_target") == "CPU"
        self._made = 0  # groups made so far: every rank names the n-th the same
        self.backend = str(ms.get_context("device_target"))  # CPU, Ascend (HCCL), GPU

    def global_rank(self, group_rank: int) -> int:
        if self.is_world:
            return group_rank
        from mindspore.communication import get_world_rank_from_group_rank

        return get_world_rank_from_group_rank(self.group, group_rank)

    def _all_gather_int32(self, values: np.ndarray) -> np.ndarray:
        """Every rank's int32 array of one shape, stacked in rank order."""
        values = np.require(values, np.int32, "C")
        if self._gather_by_broadcast:
            return np.stack([self._broadcast_words(values, r) for r in range(self.world_size)])
        out = self._gather(ms.Tensor(values)).asnumpy()
        return out.reshape(self.world_size, *values.shape)

    def _broadcast_words(self, values: np.ndarray, src: int) -> np.ndarray:
        buffer = values.view(np.uint8).copy() if self.rank == src else np.empty(values.nbytes, np.uint8)
        self.broadcast(buffer, src, _Group(tuple(range(self.world_size)), self.group))
        return buffer.view(np.int32).reshape(values.shape)

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-able `obj`, in rank order, as int32 words (the CPU AllGather moves no
        bytes). One gather of a fixed block carries each rank's length and its first bytes, which
        is all of a short document; only when some rank's is longer does a second gather carry
        the rest, padded to the longest. (An AllGather on the CPU backend costs about the same for
        4 bytes as for 4 KiB: docs/design-figures.md.)"""
        data = json.dumps(obj, separators=(",", ":")).encode()
        head = np.zeros(FIRST_BLOCK_WORDS * 4, np.uint8)
        head[:4] = np.frombuffer(np.array([len(data)], np.int32).tobytes(), np.uint8)
        room = len(head) - 4
        head[4:4 + min(len(data), room)] = np.frombuffer(data[:room], np.uint8)
        heads = self._all_gather_int32(head.view(np.int32)).view(np.uint8)
        lengths = [int(n) for n in heads[:, :4].copy().view(np.int32)[:, 0]]
        docs = [heads[r, 4:4 + min(n, room)].tobytes() for r, n in enumerate(lengths)]
        longest = max(lengths)
        if longest > room:
            words = (longest - room + 3) // 4
            rest = np.zeros(words * 4, np.uint8)
            tail = data[room:]
            rest[:len(tail)] = np.frombuffer(tail, np.uint8)
            stacked = self._all_gather_int32(rest.view(np.int32)).view(np.uint8)
            docs = [d + stacked[r, :max(n - room, 0)].tobytes() for r, (d, n) in enumerate(zip(docs, lengths))]
        return [json.loads(d) for d in docs]

    def barrier(self) -> None:
        """Every rank of the group got here (a gathered int: MindSpore's CPU barrier does not
        wait)."""
        self._all_gather_int32(np.zeros(1, np.int32))

    def groups(self, sets: list[tuple[int, ...]]) -> dict:
        """A handle per set of ranks, for `broadcast`; every rank calls this with the same sets
        in the same order (MindSpore needs only the members to create a group: the others make
        no call for it)."""
        from mindspore.communication import create_group

        world = tuple(range(self.world_size))
        handles = {}
        for ranks in sets:
            ranks = tuple(ranks)
            self._made += 1
            if ranks == world:
                handles[ranks] = _Group(ranks, self.group)
            elif self.rank in ranks and len(ranks) > 1:
                name = f"hpckpt_{self._made}_" + "_".join(str(self.global_rank(r)) for r in ranks)
                create_group(name, [self.global_rank(r) for r in ranks])
                handles[ranks] = _Group(ranks, name)
            else:
                handles[ranks] = _Group(ranks, None)
        return handles

    def broadcast(self, buffer: np.ndarray, src: int, handle: _Group) -> np.ndarray:
        """`src`'s bytes into `buffer` on every member of the handle's set (a uint8 array of the
        same size on each); returns `buffer`.

        Raises:
            ValueError: this rank or `src` is not a member of the set.
        """
        if self.rank not in handle.ranks or src not in handle.ranks:
            raise ValueError(f"broadcast from rank {src} over ranks {list(handle.ranks)} called on rank {self.rank}")
        if handle.name is None or buffer.size == 0:  # a set of one rank
            return buffer
        from mindspore.ops.communication import broadcast

        data = ms.Tensor(np.require(buffer, np.uint8, "C"))
        broadcast(data, src=self.global_rank(src), group=handle.name)
        received = data.asnumpy()
        if received.ctypes.data != buffer.ctypes.data:
            np.copyto(buffer, received.reshape(buffer.shape))
        return buffer

    def release(self, handles: dict) -> None:
        from mindspore.communication import destroy_group

        for handle in handles.values():
            if handle.name is not None and handle.name != self.group:
                destroy_group(handle.name)


def comm_of(process_group: Any = None) -> Comm | None:
    """The group's `Comm` (a MindSpore group name; None: the world), None when
    `mindspore.communication` is not initialised."""
    from mindspore.communication import GlobalComm

    if not GlobalComm.INITED:
        return None
    return Comm(process_group)
