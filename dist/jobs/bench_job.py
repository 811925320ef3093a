"""`hpckpt run bench`: hpckpt and the framework's own checkpointing on the same state, in one job.

Every rank builds the state once (the synthetic model, or `--from` a checkpoint loaded into the
job's layout) and, for `rounds` rounds, times six phases: `hpckpt.dist.save`, `async_save` and
`load`, and the framework's own way of doing the same — PyTorch DCP (`save`, `async_save`,
`load` of DTensors made from the same local shards) under torchrun, MindSpore's
`save_checkpoint` / `save_checkpoint(async_save=True)` / `load_checkpoint` of one file per rank
under msrun (how MindSpore itself saves a distributed job). The order of the two contenders
alternates from round to round, so neither always meets a warmer machine.

Each phase starts after a barrier; the job's time of a phase is its slowest rank's (gathered).
Before a save the destination is removed and dirty pages flushed (`os.sync`), untimed; before a
load the checkpoint's files are evicted from the page cache (fsync + `POSIX_FADV_DONTNEED`), so
loads are cold. Memory: the kernel's peak RSS is reset before each phase (`/proc/self/clear_refs`)
and `VmHWM` read after it, the allocator's free pages handed back first (`malloc_trim`) so no
phase runs on memory an earlier one freed. Bytes read: `LoadResult` for hpckpt, the
`/proc/self/io` `rchar` delta for both (read/pread/readv calls: file reads; gloo's `recvmsg`
traffic is not in it, measured: an HSDP load's broadcasts of 380 MiB a rank left no trace).
The first round's loads are compared with the saved state bit for bit (untimed): a bench that
loads wrong values fails.

Top-level imports are the standard library only: the CLI imports `table` to print the report.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from hpckpt.core.commit.durable import fsync_path

KINDS = ("save", "async_save", "load")
NATIVE = {"torch": "torch_dcp", "mindspore": "mindspore"}
LABELS = {"hpckpt": "hpckpt.dist", "torch_dcp": "torch DCP", "mindspore": "MindSpore"}


# -- what a phase costs this process ----------------------------------------------------------

def _trim_heap() -> None:
    """Hand the allocator's free pages back to the kernel (glibc `malloc_trim`): otherwise a phase
    reuses memory an earlier phase freed and its peak RSS understates what it allocated."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so VmHWM after a phase is that phase's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _memory() -> dict[str, int]:
    """VmHWM (peak) and VmRSS (now) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _timed(ctx, call: Callable[[], Any]) -> tuple[Any, dict]:
    """Barrier, then `call()` measured on this rank: seconds, peak RSS, extra RSS, rchar."""
    _trim_heap()
    ctx.comm.barrier()
    _reset_peak_rss()
    before, read_before = _memory(), _rchar()
    started = time.perf_counter()
    value = call()
    seconds = time.perf_counter() - started
    after = _memory()
    return value, {"seconds": seconds, "peak_rss": after["VmHWM"],
                   "peak_rss_extra": max(after["VmHWM"] - before["VmRSS"], 0), "rchar": _rchar() - read_before}


# -- the scratch directory --------------------------------------------------------------------

def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in _files(path))


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _clear(ctx, path: Path) -> None:
    """Untimed, before a save: rank 0 removes the destination, each node flushes its dirty pages."""
    if ctx.rank == 0:
        _remove(path)
    if ctx.local_rank == 0:
        os.sync()
    ctx.comm.barrier()


def _evict(ctx, path: Path) -> None:
    """Untimed, before a load: the checkpoint's pages out of this node's page cache (fsync first:
    dirty pages would stay, and MindSpore does not fsync its files)."""
    if ctx.local_rank == 0:
        for p in _files(path):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    ctx.comm.barrier()


def _scratch(spec: dict, ctx) -> tuple[Path, bool]:
    """A fresh directory of this job under `out` (rank 0 names it), and whether `out` was made
    for it: the bench never removes anything it did not create."""
    root = Path(spec.get("out") or Path(ctx.run_dir) / "bench")
    name, made_root = ctx.comm.all_gather_json([f"bench-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}",
                                                not root.exists()])[0]
    if ctx.rank == 0:
        (root / name).mkdir(parents=True)
    ctx.comm.barrier()
    return root / name, made_root


def _remove_scratch(path: Path, made_root: bool) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if made_root:
        try:
            path.parent.rmdir()
        except OSError:
            pass  # not empty: someone else's files


# -- the state, its empty twin, and the check -------------------------------------------------

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


def _mapped(node: Any, leaf: Callable[[tuple, Any], Any], path: tuple = ()) -> Any:
    """The same nesting with every leaf replaced by `leaf(path, value)`."""
    if isinstance(node, dict):
        return {k: _mapped(v, leaf, (*path, k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_mapped(v, leaf, (*path, i)) for i, v in enumerate(node)]
    return leaf(path, node)


def _empty_like(state: dict, fw, framework: str) -> dict:
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

    return _mapped(state, leaf)


def _sharded(state: dict) -> list[tuple[tuple, Any]]:
    from hpckpt.dist.layouts import Sharded

    return [(path, obj) for path, obj in _walk(state) if isinstance(obj, Sharded)]


def _check(fw, saved: dict, loaded: dict, who: str, rank: int) -> None:
    """Every local tensor of `loaded` bit-equal to the one of `saved` at the same place.

    Raises:
        CheckFailedError: the first tensor that differs, named.
    """
    import numpy as np

    from hpckpt.core.errors import CheckFailedError

    for (path, want), (_p, got) in zip(_sharded(saved), _sharded(loaded)):
        a = np.ascontiguousarray(fw.to_numpy(want.local, copy=False)).reshape(-1).view(np.uint8)
        b = np.ascontiguousarray(fw.to_numpy(got.local, copy=False)).reshape(-1).view(np.uint8)
        if not np.array_equal(a, b):
            raise CheckFailedError(f"rank {rank}: {who} loaded {'.'.join(map(str, path))} with other values "
                                   "than were saved")


# -- hpckpt ---------------------------------------------------------------------------------

class _Hpckpt:
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
                "read_amplification": r.read_amplification, "bytes_broadcast": r.bytes_broadcast}


# -- PyTorch DCP ------------------------------------------------------------------------------

class _TorchDCP:
    """torch.distributed.checkpoint on DTensors sharing the local tensors of the state.

    DTensor cuts uneven dims with the ceil rule (`torch.chunk`); a layout whose boxes differ from
    torch's (hpckpt's default "balanced" split of an uneven dim) cannot be described to DCP, so
    it is refused, naming the tensor."""

    name = "torch_dcp"
    fsync = {"save": True, "async_save": True}  # FileSystemWriter(sync_files=True) by default

    def __init__(self, ctx, state: dict, nbytes: int):
        import torch.distributed.checkpoint  # noqa: F401 - its ~3 s import outside every timed phase

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

        return _mapped(state, lambda path, obj: self._dtensor(".".join(map(str, path)), obj)
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

class _MindSpore:
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
        self._items = [{"name": ".".join(map(str, path)), "data": s.local} for path, s in _sharded(state)
                       if math.prod(s.local.shape)]

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
        for path, s in _sharded(target):
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


# -- the rounds -------------------------------------------------------------------------------

def _save_phase(ctx, who, dest: Path) -> dict:
    _clear(ctx, dest)
    extra, mine = _timed(ctx, lambda: who.save(dest))
    if hasattr(who, "make_durable"):  # a save that does not fsync: what durability would add
        started = time.perf_counter()
        who.make_durable(dest)
        extra["fsync_seconds"] = time.perf_counter() - started
    return {**mine, **extra}


def _async_phase(ctx, who, dest: Path) -> dict:
    """`seconds` until the save is complete; `blocked` until the call returned."""
    _clear(ctx, dest)
    marks: dict = {}

    def call() -> dict:
        started = time.perf_counter()
        wait, extra = who.async_save(dest)
        marks["blocked"] = time.perf_counter() - started
        wait()
        return extra

    extra, mine = _timed(ctx, call)
    return {**mine, **marks, **extra}


def _load_phase(ctx, who, dest: Path, state: dict, fw, check: bool) -> dict:
    _evict(ctx, dest)
    target = _empty_like(state, fw, ctx.framework)
    prepared = who.prepare_load(target)
    extra, mine = _timed(ctx, lambda: who.load(dest, prepared))
    if check:
        _check(fw, state, target, LABELS[who.name], ctx.rank)
    return {**mine, **extra, "checked": check}


def _round(ctx, contenders: list, scratch: Path, state: dict, fw, r: int, rounds: int) -> dict:
    """One round: each contender saves, loads back what it saved (cold), async-saves."""
    out: dict[str, dict] = {}
    for who in contenders:
        label = LABELS[who.name]
        sync_dir, async_dir = scratch / who.name, scratch / f"{who.name}_async"
        ctx.phase(f"round {r + 1}/{rounds}: {label} save")
        out[f"{who.name}_save"] = _save_phase(ctx, who, sync_dir)
        ctx.comm.barrier()  # every rank's files are complete (MindSpore's saves do not meet)
        out[f"{who.name}_save"]["bytes_on_disk"] = _tree_bytes(sync_dir)
        ctx.phase(f"round {r + 1}/{rounds}: {label} load")
        out[f"{who.name}_load"] = _load_phase(ctx, who, sync_dir, state, fw, check=r == 0)
        ctx.phase(f"round {r + 1}/{rounds}: {label} async save")
        out[f"{who.name}_async_save"] = _async_phase(ctx, who, async_dir)
        _clear(ctx, sync_dir)
        _clear(ctx, async_dir)
    return out


def _summary(kind: str, mine: list[dict], job: list[list[dict]], job_state_bytes: int,
             fsync: bool | None) -> dict:
    """One measurement's figures for this rank: `mine` per round, `job` per round every rank's."""
    seconds = [max(p["seconds"] for p in ranks) for ranks in job]
    best = min(seconds)
    out = {"seconds_best": round(best, 4), "seconds_median": round(statistics.median(seconds), 4),
           "gb_per_s": round(job_state_bytes / best / 1e9, 3) if best else None,
           "rounds": [round(s, 4) for s in seconds], "rank_seconds_best": round(min(m["seconds"] for m in mine), 4),
           "peak_rss": max(m["peak_rss"] for m in mine), "peak_rss_extra": max(m["peak_rss_extra"] for m in mine),
           "job_peak_rss": max(p["peak_rss"] for ranks in job for p in ranks),
           "job_peak_rss_extra": max(p["peak_rss_extra"] for ranks in job for p in ranks)}
    if fsync is not None:
        out["fsync"] = fsync
    if kind == "save":
        out["bytes_on_disk"] = mine[-1]["bytes_on_disk"]
    if "fsync_seconds" in mine[0]:
        durable = [max(p["seconds"] + p["fsync_seconds"] for p in ranks) for ranks in job]
        out["durable_seconds_best"] = round(min(durable), 4)  # with an fsync of each rank's file added
    if kind == "async_save":
        blocked = [max(p["blocked"] for p in ranks) for ranks in job]
        out.update(blocked_best=round(min(blocked), 4), blocked_median=round(statistics.median(blocked), 4))
    if kind == "load":
        last = job[-1]
        job_rchar = sum(p["rchar"] for p in last)
        wanted = last[0].get("job_bytes_wanted") or job_state_bytes
        out.update(rchar=mine[-1]["rchar"], job_rchar=job_rchar, job_bytes_wanted=wanted,
                   rchar_amplification=round(job_rchar / wanted, 4) if wanted else None,
                   checked=any(m.get("checked") for m in mine))
        if "read_amplification" in mine[-1]:  # hpckpt's own count of the bytes it read
            out.update(bytes_read=mine[-1]["bytes_read"], job_bytes_read=last[0]["job_bytes_read"],
                       read_amplification=round(mine[-1]["read_amplification"], 4),
                       bytes_broadcast=mine[-1]["bytes_broadcast"])
        else:
            out.update(bytes_read=mine[-1]["rchar"], job_bytes_read=job_rchar,
                       read_amplification=out["rchar_amplification"])
        if any(m.get("memfree_guard_bypassed") for m in mine):
            out["memfree_guard_bypassed"] = True
    return out


def _job_state_bytes(pieces: list, fw) -> int:
    """The state's distinct bytes: every tensor's global size (replicas counted once)."""
    return sum(math.prod(s.shape) * fw.dtype_of(s.local, fqn).itemsize for fqn, s in pieces)


def run(spec: dict, ctx) -> dict:
    from hpckpt.dist import frameworks
    from hpckpt.dist.jobs import save_job, states

    rounds = int(spec.get("rounds") or 3)
    fw = frameworks.named(ctx.framework)
    layout = states.layout_spec(spec, ctx.world_size)
    state, pieces, made = save_job.build_state(spec, ctx, layout)
    state_bytes = states.nbytes_of(pieces, fw, ctx.rank)
    job_state_bytes = _job_state_bytes(pieces, fw)
    native = (_TorchDCP if ctx.framework == "torch" else _MindSpore)(ctx, state, state_bytes)
    hpckpt = _Hpckpt(ctx, state, state_bytes)
    scratch, made_root = _scratch(spec, ctx)
    per_round: list[dict] = []
    try:
        for r in range(rounds):
            order = [hpckpt, native] if r % 2 == 0 else [native, hpckpt]
            per_round.append(_round(ctx, order, scratch, state, fw, r, rounds))
        ctx.phase("gathering the figures")
        everyone = ctx.comm.all_gather_json(per_round)
    finally:
        if ctx.rank == 0:
            _remove_scratch(scratch, made_root)
    figures: dict[str, Any] = {"rank": ctx.rank, "framework": ctx.framework, "rounds": rounds,
                               "tensors": len(pieces), "state_bytes": state_bytes,
                               "job_state_bytes": job_state_bytes, **made}
    for who in (hpckpt, native):
        for kind in KINDS:
            key = f"{who.name}_{kind}"
            figures[key] = _summary(kind, [rnd[key] for rnd in per_round],
                                    [[ranks[r][key] for ranks in everyone] for r in range(rounds)],
                                    job_state_bytes, who.fsync.get(kind))
    return figures


# -- the report ---------------------------------------------------------------------------------

def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) of a bench report: one row per measurement, the job's figures (times are the
    slowest rank's; peak RSS the largest rank's, and what the phase added over its start). The
    last column is the framework's figure over hpckpt's (time; blocked time for async saves)."""
    first = results[0]
    native = NATIVE[first["framework"]]
    columns = ["measurement", "fsync", "best s", "median s", "GB/s", "blocked s", "read x", "job read",
               "peak RSS", "RSS added", "vs hpckpt"]
    rows = []
    for kind in KINDS:
        for who in ("hpckpt", native):
            m = first.get(f"{who}_{kind}")
            if not m:
                continue
            ref = first[f"hpckpt_{kind}"]
            by = "blocked_best" if kind == "async_save" else "seconds_best"
            ratio = f"{m[by] / ref[by]:.2f}x" if who != "hpckpt" and ref.get(by) else ""
            rows.append([f"{LABELS[who]} {kind.replace('_', ' ')}",
                         "" if "fsync" not in m else ("yes" if m["fsync"] else "no"),
                         f"{m['seconds_best']:.3f}", f"{m['seconds_median']:.3f}",
                         "" if m.get("gb_per_s") is None else f"{m['gb_per_s']:.2f}",
                         f"{m['blocked_best']:.3f}" if "blocked_best" in m else "",
                         f"{m['read_amplification']:.2f}" if "read_amplification" in m else "",
                         _gib(m.get("job_bytes_read")), _gib(m["job_peak_rss"]), _gib(m["job_peak_rss_extra"]), ratio])
    return columns, rows
