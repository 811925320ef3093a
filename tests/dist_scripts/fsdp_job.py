"""An FSDP2 training job that saves and loads its model + optimizer with `hpckpt.dist`
(run under torchrun, gloo, CPU).

Usage:
  torchrun --standalone --nproc-per-node 4 fsdp_job.py save OUTDIR
  torchrun --standalone --nproc-per-node N fsdp_job.py load OUTDIR MESH     (MESH: 2, 3 or 2x2)

`save` (4 ranks, `fully_shard` per layer + root on a 1-D mesh of 4): trains 2 AdamW steps on fixed
data, saves `{"model", "optim", "meta", "extra"}` with `hpckpt.dist.save` to OUTDIR/ckpt and
writes, on rank 0 only, the full state dict (`full_state_dict=True, cpu_offload=True`) to
OUTDIR/reference.pt and the step-3 loss to OUTDIR/save.json. In the same job:
  (a) a second save of the same state to OUTDIR/ckpt_again is a plan-cache hit and its files are
      byte-identical to the first's;
  (b) a state with one more tensor (OUTDIR/ckpt_new_tensor), then with that tensor reshaped
      (OUTDIR/ckpt_reshaped), is a miss each time; the reshaped state saved again is a hit;
  (c) `async_save` to OUTDIR/ckpt_async, every tensor of the state modified in place right after
      it returns, `result()`, then the checkpoint loaded into a zeroed copy holds the values at
      the call.
`load` builds the same model fresh (another seed) on MESH (`2x2`: HSDP, mesh dims
("replicate", "shard")), initialises the optimizer state (`get_state_dict` does, with lr=0),
loads OUTDIR/ckpt into the sharded state dict with `hpckpt.dist.load`, applies it with
`set_state_dict`, and compares the full state dict bit for bit with the reference and the step-3
loss exactly with the saved one; it also checks the job's read accounting (every box read from
storage once: read amplification 1.0; with 2x2 some rank received bytes from a peer). That load
runs with `broadcast_shared="auto"` and configured bandwidths that make broadcasting pay (the
network 1,024x the storage, and faster than any copy in memory), so every shared box is
broadcast. With 2x2 the same job then loads fresh zeroed copies of the state three more ways and
compares them bit for bit with the first:
  (d) figures from HPCKPT_STORAGE_BANDWIDTH / HPCKPT_NETWORK_BANDWIDTH (storage 2 GiB/s, network
      1 GiB/s) for which a model blind to machines would broadcast the boxes all 4 ranks want
      (3 x network > storage), but the ranks are on one machine, whose page cache they share:
      every group reads ("read", each group on 1 machine), the read accounting exact;
  (e) measured figures (a timed broadcast over the group, the storage's read probe): every rank
      agrees on them and on the choice; a second such load takes the network figure from the cache;
  (f) `broadcast_shared=False`: forced, nothing broadcast, no figure measured.

Every failed check is written to stderr as `rank R: FAIL ...`; the job then exits 1.
Each rank also writes a one-line JSON summary to stdout (`rank R: SUMMARY {...}`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hpckpt.dist as hdist

SAVE_SEED, LOAD_SEED, DATA_SEED = 1234, 98765, 7
GLOBAL_BATCH = 12  # divisible by 4 (save job) ; the step-3 loss always uses the whole batch
META = {"step": 2, "note": "fsdp2", "milestones": [3, 6]}
FAILURES: list[str] = []


class Net(nn.Module):
    """Uneven first dims: 13 rows over 4 ranks -> 4,4,4,1 (torch.chunk), over 3 -> 5,5,3;
    5 rows over 4 -> 2,2,1,0 (one rank holds an empty shard)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 13)
        self.norm = nn.LayerNorm(13)
        self.l2 = nn.Linear(13, 16)
        self.l3 = nn.Linear(16, 5)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(self.norm(torch.tanh(self.l1(x))))))


def rank() -> int:
    return dist.get_rank()


def check(ok: bool, message: str) -> bool:
    if not ok:
        FAILURES.append(message)
        print(f"rank {rank()}: FAIL {message}", file=sys.stderr, flush=True)
    return ok


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def build(mesh, seed: int):
    torch.manual_seed(seed)  # the same full initial values on every rank, sharded by fully_shard
    model = Net()
    for layer in (model.l1, model.norm, model.l2, model.l3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def step3_loss(model) -> float:
    """The forward loss of the 3rd step: the whole global batch on every rank (depends only on
    the parameters), the same on every rank."""
    x, y = data()
    with torch.no_grad():
        loss = F.mse_loss(model(x), y).item()
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss)
    check(len(set(losses)) == 1, f"the step-3 loss differs between ranks: {losses}")
    return loss


def plain_loss(full_model_sd: dict) -> float:
    """The same loss from the full parameters on one process, without FSDP (rank 0)."""
    net = Net()
    net.load_state_dict(full_model_sd)
    x, y = data()
    with torch.no_grad():
        return F.mse_loss(net(x), y).item()


def full_state(model, optim) -> tuple[dict, dict]:
    """Only rank 0 receives it (the others get empty dicts)."""
    return get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# --- walking the nested state dict ------------------------------------------------------------


def leaves(tree, path=()):
    """(path, leaf) for every leaf; dicts and lists are descended (lists only when they hold a
    tensor or a dict, as hpckpt flattens them)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, path + (k,))
    elif isinstance(tree, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in tree):
        for i, v in enumerate(tree):
            yield from leaves(v, path + (i,))
    else:
        yield path, tree


def name(path) -> str:
    return ".".join(map(str, path))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def map_tree(tree, fn):
    if isinstance(tree, dict):
        return {k: map_tree(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict)) for v in tree):
        return type(tree)(map_tree(v, fn) for v in tree)
    return fn(tree)


def describe(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return f"DTensor{tuple(t.shape)} {t.placements} local {tuple(t.to_local().shape)}"
    return f"tensor{tuple(t.shape)}"


def same_tensor(got: torch.Tensor, want: torch.Tensor, what: str) -> bool:
    if not check(got.dtype == want.dtype and got.shape == want.shape,
                 f"{what}: dtype/shape {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"):
        return False
    if not torch.equal(got, want):
        diff = (got.double() - want.double()).abs()
        return check(False, f"{what}: values differ (max |diff| {diff.max().item():.3g} at "
                            f"{(diff > 0).sum().item()} of {diff.numel()} elements)")
    return True


def compare_trees(got, want, what: str) -> int:
    """Bit-exact comparison of two nested state dicts; returns the number of tensors compared."""
    got_leaves, want_leaves = dict(leaves(got)), dict(leaves(want))
    check(sorted(map(name, got_leaves)) == sorted(map(name, want_leaves)),
          f"{what}: entries differ: only got {sorted(set(map(name, got_leaves)) - set(map(name, want_leaves)))}, "
          f"only wanted {sorted(set(map(name, want_leaves)) - set(map(name, got_leaves)))}")
    n = 0
    for path, w in want_leaves.items():
        if path not in got_leaves:
            continue
        g = got_leaves[path]
        if isinstance(w, torch.Tensor):
            n += 1
            if check(isinstance(g, torch.Tensor), f"{what} {name(path)}: not a tensor but {type(g).__name__}"):
                same_tensor(local(g), local(w), f"{what} {name(path)}")
        else:
            check(type(g) is type(w) and g == w, f"{what} {name(path)}: value {g!r} != {w!r}")
    return n


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def summary(**fields) -> None:
    print(f"rank {rank()}: SUMMARY {json.dumps(fields, default=str, sort_keys=True)}", flush=True)


# --- save ----------------------------------------------------------------------------------------


def check_save_result(res, path: Path, what: str, mesh_size: int) -> None:
    check(Path(res.path).resolve() == path.resolve(), f"{what}: path {res.path} != {path}")
    check(res.rank == rank() and res.world_size == mesh_size, f"{what}: rank/world {res.rank}/{res.world_size}")
    check(res.coordinator == 0 and res.coordination == "collectives",
          f"{what}: coordinator/coordination {res.coordinator}/{res.coordination}")
    check(res.committed is True, f"{what}: committed={res.committed}")
    check(len(res.files) > 0 and res.bytes_written > 0, f"{what}: files {res.files}, bytes_written {res.bytes_written}")
    everyone = gather((res.bytes_written, res.job_bytes_written, res.plan_cache))
    check(len({j for _, j, _ in everyone}) == 1 and everyone[0][1] == sum(b for b, _, _ in everyone),
          f"{what}: job_bytes_written is not the sum of the ranks' bytes_written: {everyone}")
    check(len({c for _, _, c in everyone}) == 1, f"{what}: ranks disagree on plan_cache: {everyone}")


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def run_save(out: Path) -> dict:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, optim = build(mesh, SAVE_SEED)
    x, y = data()
    per_rank = GLOBAL_BATCH // world
    for _ in range(2):  # data parallel: each rank its slice of the fixed global batch
        xs, ys = x[rank() * per_rank:(rank() + 1) * per_rank], y[rank() * per_rank:(rank() + 1) * per_rank]
        loss = F.mse_loss(model(xs), ys)
        loss.backward()
        optim.step()
        optim.zero_grad()

    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "meta": dict(META),
             "extra": {"seen": torch.arange(6, dtype=torch.int64).reshape(2, 3)}}
    shapes = {name(p): describe(t) for p, t in leaves(state) if isinstance(t, torch.Tensor)}

    ckpt = out / "ckpt"
    res = hdist.save(state, ckpt)
    check_save_result(res, ckpt, "save", world)
    check(res.plan_cache == "miss", f"first save in the job: plan_cache {res.plan_cache!r}, want 'miss'")

    # the reference: the full state dict, on rank 0 only; and the step-3 loss
    full_m, full_o = full_state(model, optim)
    loss3 = step3_loss(model)
    info = {"loss3": loss3, "world_size": world}
    if rank() == 0:
        torch.save({"model": full_m, "optim": full_o, "meta": META, "extra": {"seen": state["extra"]["seen"]}},
                   out / "reference.pt")
        info["plain_loss3"] = plain_loss(full_m)
    else:
        check(not full_m and not full_o.get("state"), "a rank other than 0 received a full state dict")

    # (a) the same state again: the cached plan, the same bytes
    again = out / "ckpt_again"
    res_again = hdist.save(state, again)
    check_save_result(res_again, again, "second save", world)
    check(res_again.plan_cache == "hit", f"second save of the same state: plan_cache {res_again.plan_cache!r}, want 'hit'")
    check(res_again.files == res.files and res_again.bytes_written == res.bytes_written,
          f"second save wrote {res_again.files} ({res_again.bytes_written} B), first {res.files} ({res.bytes_written} B)")
    dist.barrier()
    if rank() == 0:
        first, second = files_of(ckpt), files_of(again)
        check(sorted(first) == sorted(second), f"files of the two saves differ: {sorted(first)} vs {sorted(second)}")
        for f in sorted(set(first) & set(second)):
            check(first[f] == second[f], f"file {f} differs between the two saves of the same state "
                                         f"({len(first[f])} vs {len(second[f])} bytes)")
        info["files"] = sorted(first)

    # (b) a changed shape is a miss: one more tensor, then that tensor reshaped
    state_new = dict(state, added={"t": distribute_tensor(torch.arange(21.0).reshape(7, 3), mesh, [Shard(0)])})
    res_new = hdist.save(state_new, out / "ckpt_new_tensor")
    check_save_result(res_new, out / "ckpt_new_tensor", "save with a new tensor", world)
    check(res_new.plan_cache == "miss", f"save with one more tensor: plan_cache {res_new.plan_cache!r}, want 'miss'")
    state_reshaped = dict(state, added={"t": distribute_tensor(torch.arange(27.0).reshape(9, 3), mesh, [Shard(0)])})
    res_reshaped = hdist.save(state_reshaped, out / "ckpt_reshaped")
    check_save_result(res_reshaped, out / "ckpt_reshaped", "save with a reshaped tensor", world)
    check(res_reshaped.plan_cache == "miss",
          f"save with a tensor reshaped (7,3) -> (9,3): plan_cache {res_reshaped.plan_cache!r}, want 'miss'")
    res_reshaped2 = hdist.save(state_reshaped, out / "ckpt_reshaped_again")
    check(res_reshaped2.plan_cache == "hit",
          f"the reshaped state saved again: plan_cache {res_reshaped2.plan_cache!r}, want 'hit'")

    # (c) async_save: the checkpoint holds the values at the call, whatever the caller does next
    at_call = map_tree(state, lambda v: local(v).clone() if isinstance(v, torch.Tensor) else v)
    handle = hdist.async_save(state, out / "ckpt_async")
    with torch.no_grad():
        for _, t in leaves(state):
            if isinstance(t, torch.Tensor):
                local(t).add_(1)  # in place, on the very tensors handed to async_save
        for p in model.parameters():
            p.mul_(3)  # and through the model (msd may or may not share its storage)
    res_async = handle.result(timeout=120)
    check(handle.done(), "async handle not done after result()")
    check_save_result(res_async, out / "ckpt_async", "async_save", world)
    changed = sum(not torch.equal(local(t), at_call_t) for (_, t), (_, at_call_t) in zip(leaves(state), leaves(at_call))
                  if isinstance(t, torch.Tensor))
    check(changed > 0, "the in-place modification after async_save changed nothing (test bug)")
    fresh = map_tree(state, lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "<not loaded>")
    lres = hdist.load(fresh, out / "ckpt_async")
    check(not lres.missing and not lres.unused, f"load of the async checkpoint: missing {lres.missing}, unused {lres.unused}")
    n = compare_trees(map_tree(fresh, lambda v: local(v) if isinstance(v, torch.Tensor) else v), at_call,
                      "async checkpoint vs the values at the call")
    check(n == len(shapes), f"compared {n} tensors of {len(shapes)}")

    info.update(plan_cache=[r.plan_cache for r in (res, res_again, res_new, res_reshaped, res_reshaped2, res_async)],
                plan_from=[r.plan_from for r in (res, res_again, res_new, res_reshaped, res_reshaped2, res_async)],
                checkpoints=["ckpt", "ckpt_again", "ckpt_new_tensor", "ckpt_reshaped", "ckpt_reshaped_again", "ckpt_async"],
                async_blocked=res_async.blocked, job_bytes_written=res.job_bytes_written)
    summary(mode="save", rank=rank(), tensors=len(shapes), shapes=shapes if rank() == 0 else None,
            bytes_written=res.bytes_written, files=res.files, loss3=loss3)
    return info


# --- load ----------------------------------------------------------------------------------------


def nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for _, t in leaves(tree) if isinstance(t, torch.Tensor))


def check_auto_loads(out: Path, state: dict, loaded: dict) -> None:
    """HSDP 2x2: loads (d), (e) and (f) of the module's docstring into fresh zeroed copies of
    `state`, each compared with `loaded` (the first load's values)."""
    def load_fresh(what: str, **kwargs):
        fresh = map_tree(state, lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "<not loaded>")
        r = hdist.load(fresh, out / "ckpt", **kwargs)
        compare_trees(map_tree(fresh, lambda v: local(v) if isinstance(v, torch.Tensor) else v), loaded, what)
        everyone = gather(r)
        route = lambda x: (x.broadcast, x.broadcast_reason, x.shared_groups, x.storage_bandwidth,  # noqa: E731
                           x.storage_bandwidth_from, x.network_bandwidth, x.network_bandwidth_from)
        check(all(route(x) == route(r) for x in everyone), f"{what}: ranks decided apart: {[route(x) for x in everyone]}")
        extra = sum(g.nbytes * (len(g.ranks) - 1) for g in r.shared_groups if g.choice == "read")
        received = sum(g.nbytes * (len(g.ranks) - 1) for g in r.shared_groups if g.choice == "broadcast")
        check(r.job_bytes_read == r.job_bytes_wanted + extra and sum(x.bytes_read for x in everyone) == r.job_bytes_read,
              f"{what}: job_bytes_read {r.job_bytes_read}, wanted {r.job_bytes_wanted} + {extra} read again by replicas")
        check(sum(x.bytes_broadcast for x in everyone) == received,
              f"{what}: bytes_broadcast {[x.bytes_broadcast for x in everyone]}, want {received} in all")
        return r

    os.environ["HPCKPT_STORAGE_BANDWIDTH"], os.environ["HPCKPT_NETWORK_BANDWIDTH"] = "2GiB", "1GiB/s"
    try:
        r = load_fresh("load (d), mixed")
    finally:
        del os.environ["HPCKPT_STORAGE_BANDWIDTH"], os.environ["HPCKPT_NETWORK_BANDWIDTH"]
    check((r.broadcast, r.storage_bandwidth_from, r.network_bandwidth_from) == ("read", "environment", "environment")
          and {g.ranks: (g.choice, g.machines) for g in r.shared_groups}
          == {(0, 2): ("read", 1), (1, 3): ("read", 1), (0, 1, 2, 3): ("read", 1)}
          and r.memory_bandwidth > 0 and r.read_amplification > 1.0, f"load (d): {r}")
    r = load_fresh("load (e), measured")
    # (this checkpoint's few KiB are too little for the storage probe to tell: "unknown", which broadcasts)
    check(r.broadcast_reason == "auto" and r.network_bandwidth_from == "probe" and r.network_bandwidth > 0
          and (r.storage_bandwidth_from in ("probe", "cache") and r.storage_bandwidth > 0
               or (r.storage_bandwidth_from, r.storage_bandwidth, r.broadcast) == ("unknown", None, "broadcast"))
          and r.broadcast in ("read", "broadcast", "mixed"), f"load (e): {r}")
    r = load_fresh("load (e), measured again")
    check(r.network_bandwidth_from == "cache", f"load (e) again: the network figure from {r.network_bandwidth_from}")
    r = load_fresh("load (f), forced", broadcast_shared=False, network_bandwidth="64GiB")
    check((r.broadcast, r.broadcast_reason, r.storage_bandwidth, r.network_bandwidth_from) == ("read", "forced", None, "")
          and all(g.choice == "read" and g.read_seconds is None for g in r.shared_groups), f"load (f): {r}")


class _Chunk:
    """HyperParallel's ChunkInfo shape: `chunk.offsets`, `chunk.sizes`, `global_shape`."""

    def __init__(self, offsets, sizes, global_shape):
        self.chunk = type("ChunkStorageMetadata", (), {"offsets": tuple(offsets), "sizes": tuple(sizes)})()
        self.global_shape = tuple(global_shape)


def check_mixed_wants(out: Path, want: torch.Tensor) -> None:
    """Rank 0's tensor carries HyperParallel's chunk_info (no layout: it sends its boxes), the
    others' are plain (a layout: they send their table's digest); the ranks that sent a digest
    then send their boxes too, and the box they all want is read once and broadcast."""
    seen = torch.zeros_like(want)
    if rank() == 0:
        seen.chunk_info = _Chunk((0, 0), tuple(want.shape), tuple(want.shape))
    r = hdist.load({"extra": {"seen": seen}}, out / "ckpt", broadcast_shared=True)
    check(torch.equal(seen, want), f"mixed wants: extra.seen {seen.tolist()} != {want.tolist()}")
    check((r.wants_from, [g.ranks for g in r.shared_groups], r.read_amplification)
          == ("boxes", [tuple(range(dist.get_world_size()))], 1.0), f"mixed wants: {r}")


def run_load(out: Path, mesh_spec: str) -> None:
    world = dist.get_world_size()
    if mesh_spec == "2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # HSDP
    else:
        mesh = init_device_mesh("cpu", (int(mesh_spec),))
    check(mesh.size() == world, f"mesh {mesh_spec} on {world} ranks")
    saved = json.loads((out / "save.json").read_text())

    model, optim = build(mesh, LOAD_SEED)
    msd, osd = get_state_dict(model, optim)  # initialises AdamW's state (a step with lr=0)
    check(bool(osd.get("state")), "get_state_dict did not initialise the optimizer state")
    before = step3_loss(model)
    check(before != saved["loss3"], "the fresh model already has the saved loss (test bug)")
    state = {"model": msd, "optim": osd, "meta": {"step": -1, "note": None, "milestones": []},
             "extra": {"seen": torch.zeros(2, 3, dtype=torch.int64)}}
    placements = {name(p): describe(t) for p, t in leaves(state) if isinstance(t, torch.Tensor)}

    # broadcasting pays here: the network 1,024x the storage, and faster than a copy in memory
    res = hdist.load(state, out / "ckpt", storage_bandwidth="1GiB", network_bandwidth=2**40)
    check(res.rank == rank() and res.world_size == world, f"load: rank/world {res.rank}/{res.world_size}")
    check((res.broadcast, res.broadcast_reason) == ("broadcast", "auto") and res.shared_groups
          and all(g.choice == "broadcast" and g.broadcast_seconds < g.read_seconds for g in res.shared_groups),
          f"load with the network 64x the storage: {res.broadcast} ({res.broadcast_reason}), {res.shared_groups}")
    check((res.storage_bandwidth, res.storage_bandwidth_from, res.network_bandwidth, res.network_bandwidth_from)
          == (2**30, "argument", 2**40, "argument"), f"load: the figures used {res}")
    # DTensors and plain tensors all have layouts: the ranks sent a digest of them, not their boxes
    check(res.wants_from == "layouts", f"load: the ranks' wants came from {res.wants_from!r}")
    loaded = map_tree(state, lambda v: local(v).clone() if isinstance(v, torch.Tensor) else v)
    check(not res.missing and not res.unused, f"load: missing {res.missing}, unused {res.unused}")
    check(not res.converted, f"load converted dtypes: {res.converted}")
    check(res.tensors == len(placements), f"load: tensors {res.tensors}, the state dict has {len(placements)}")
    check(state["meta"] == META, f"values not replaced: meta {state['meta']}")
    check(all(isinstance(t, torch.Tensor) for _, t in leaves(state["optim"]["state"])),
          "load replaced a tensor of the optimizer state by something else")

    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_m, full_o = full_state(model, optim)
    loss3 = step3_loss(model)
    check(loss3 == saved["loss3"], f"step-3 loss after load {loss3!r} != saved {saved['loss3']!r}")

    # the job's accounting: every distinct box wanted once, read from storage once
    everyone = gather(res)
    job_read, job_wanted = res.job_bytes_read, res.job_bytes_wanted
    check(all(r.job_bytes_read == job_read and r.job_bytes_wanted == job_wanted for r in everyone),
          f"ranks disagree on the job totals: {[(r.job_bytes_read, r.job_bytes_wanted) for r in everyone]}")
    check(sum(r.bytes_read for r in everyone) == job_read,
          f"job_bytes_read {job_read} != sum of bytes_read {[r.bytes_read for r in everyone]}")
    check(job_read == job_wanted and res.read_amplification == 1.0,
          f"read amplification {res.read_amplification}: job_bytes_read {job_read}, job_bytes_wanted {job_wanted}, "
          f"bytes_read per rank {[r.bytes_read for r in everyone]}, bytes_broadcast {[r.bytes_broadcast for r in everyone]}")
    if mesh_spec == "2x2":
        check(any(r.bytes_broadcast > 0 for r in everyone),
              f"HSDP 2x2: no rank received a replicated box from a peer: {[r.bytes_broadcast for r in everyone]}")
        check(sorted(g.ranks for g in res.shared_groups) == [(0, 1, 2, 3), (0, 2), (1, 3)],
              f"HSDP 2x2: the sets of ranks sharing boxes {[g.ranks for g in res.shared_groups]}")
        check_auto_loads(out, state, loaded)
    check_mixed_wants(out, loaded["extra"]["seen"])

    if rank() == 0:
        ref = torch.load(out / "reference.pt", weights_only=True)
        check(job_wanted == nbytes(ref), f"job_bytes_wanted {job_wanted} != the checkpoint's tensor bytes {nbytes(ref)}")
        n_model = compare_trees(full_m, ref["model"], "model")
        check(n_model == len(ref["model"]) and n_model > 0, f"compared {n_model} model tensors")
        n_optim = compare_trees(full_o["state"], ref["optim"]["state"], "optimizer state")
        check(n_optim == 3 * len(ref["model"]), f"compared {n_optim} optimizer tensors, want 3 per parameter")
        check(full_o["param_groups"] == ref["optim"]["param_groups"],
              f"param_groups {full_o['param_groups']} != {ref['optim']['param_groups']}")
        same_tensor(state["extra"]["seen"], ref["extra"]["seen"], "extra.seen")
        plain = plain_loss(full_m)
        check(plain == saved["plain_loss3"], f"plain (non-FSDP) step-3 loss {plain!r} != saved {saved['plain_loss3']!r}")
    summary(mode="load", mesh=mesh_spec, rank=rank(), placements=placements if rank() == 0 else None,
            result={k: getattr(res, k) for k in ("format", "tensors", "values", "bytes_read", "bytes_broadcast",
                                                 "job_bytes_read", "job_bytes_wanted", "read_amplification", "seconds")},
            loss3=loss3)


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    try:
        if mode == "save":
            info = run_save(out)
            if rank() == 0:
                (out / "save.json").write_text(json.dumps(info, indent=1))
        elif mode == "load":
            run_load(out, sys.argv[3])
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except Exception:  # noqa: BLE001 - any error: report it and leave (torchrun then stops the other
        # ranks), without destroy_process_group(), which could wait for them
        print(f"rank {rank()}: FAIL exception\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    me, failed = rank(), gather(len(FAILURES))
    dist.barrier()
    dist.destroy_process_group()
    # the README's workaround ("Clean exits"): this job's last collective is its own gather, and
    # FSDP2 keeps the group (and gloo's threads) alive; let them release its tensors before the
    # interpreter finalizes
    time.sleep(0.05)
    if any(failed):
        print(f"rank {me}: {len(FAILURES)} failed check(s); failed checks per rank {failed}", file=sys.stderr, flush=True)
        return 1
    print(f"rank {me}: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
