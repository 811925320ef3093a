"""The live job of `bench/bench_dist.py`: hpckpt.dist against torch.distributed.checkpoint (under torchrun).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/dist_job.py save \
        --size-gib 1.5 --work DIR --rounds 3 --report DIR/save.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 8 bench/dist_job.py load \
        --size-gib 1.5 --work DIR --rounds 3 --report DIR/load.json

The state is `engine_state.py`'s (200 tensors of a transformer-like model, fp32 and bf16, uneven
first dims, two 0-d tensors, four values) as DTensors on a CPU mesh (gloo). Every element is a
function of its global position, so any layout can be built (or checked) without communication.

`save` (4 ranks), `--rounds` rounds, the order of the contenders alternating from round to round;
before each timed step rank 0 removes the step's destination and calls `os.sync()` (untimed), and
every time is rank 0's from a barrier before the call to a barrier after it (the slowest rank):
  raw        every rank writes the bytes of its local shards to one file (unbuffered `write`
             per tensor, `os.fsync`, close): the machine's durable-write bandwidth.
  hp-save    `hpckpt.dist.save(state, W/hp_fsdp)` (fsyncs, atomic commit); the same path every
             round, so rounds 2.. are plan-cache hits.
  hp-save-miss  the same with `plan_cache=False` (W/hp_nocache): every rank's plan gathered and the
             global plan built, what a miss costs (the cache is keyed by the ranks' plans, not the path).
  dcp-save   `torch.distributed.checkpoint.save(state, checkpoint_id=W/torch_fsdp)` (FileSystemWriter's
             default `sync_files=True`: every data file and `.metadata` fsynced).
  stage      `{fqn: dtensor.to_local().clone()}`: the staging copy alone.
  hp-async   `hpckpt.dist.async_save(state, W/hp_async)`: blocked = until the call returns (max over
             ranks), durable = until `result()` returned on every rank.
  dcp-async  `torch.distributed.checkpoint.async_save(state, checkpoint_id=W/torch_async)` (thread
             executor, DefaultStager): blocked = until the call returns, durable = `.result()`.
Then probes of what a cache hit's planning and async_save's blocked time are made of (see
`planning_probes`, `async_parts`), and the same state on a 2x2 mesh (HSDP: placements [Replicate(), Shard(0)]) is saved once by
each library (W/hp_hsdp, W/torch_hsdp): the sources of the HSDP loads.

`load` (8 ranks, targets Shard(0) over 8, fresh `torch.empty` DTensors before every load): from
hp_fsdp and hp_hsdp with `hpckpt.dist.load`, from torch_fsdp and torch_hsdp with `dcp.load`, and
(an extra) from torch_fsdp/torch_hsdp with `hpckpt.dist.load`. Before each load rank 0 evicts
every file of the source from the page cache (`posix_fadvise(POSIX_FADV_DONTNEED)`). Each rank
records its `/proc/self/io` `rchar` and `read_bytes` deltas over the load (summed over ranks;
`rchar` counts every read/pread/readv, so it also holds the collectives' socket reads, a few
hundred KB here). The first load of each kind is checked element by element against the pattern
(untimed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_state  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

import hpckpt.dist as hdist  # noqa: E402


# --- the state on any mesh -----------------------------------------------------------------------

def build_state(size_gib: float, mesh, placements, *, empty: bool = False) -> dict:
    """engine_state's state as DTensors on `mesh` with `placements` (Shard(0) on one mesh dim,
    Replicate on the others): each rank's rows follow torch.chunk over the Shard dim's size."""
    coord = mesh.get_coordinate()
    shard_dims = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    assert len(shard_dims) == 1
    n_shards = mesh.size(shard_dims[0])
    index = coord[shard_dims[0]]
    state: dict = {}
    for t, (fqn, shape, dtype) in enumerate(engine_state.spec(size_gib)):
        lo, hi = engine_state.rows_of(index, n_shards, shape[0])
        if empty:
            local = torch.empty((hi - lo, *shape[1:]), dtype=getattr(torch, dtype))
        else:
            local = engine_state._pattern_torch(t, shape, dtype, lo, hi)
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        state[fqn] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                        stride=stride)
    for fqn, (dtype, value) in engine_state.ZERO_D.items():
        state[fqn] = torch.zeros((), dtype=getattr(torch, dtype)) if empty else torch.tensor(value, dtype=getattr(torch, dtype))
    for fqn, value in engine_state.VALUES.items():
        state[fqn] = type(value)() if empty else (list(value) if isinstance(value, list) else value)
    return state


def local_tensors(state: dict):
    for v in state.values():
        if isinstance(v, DTensor):
            yield v.to_local()
        elif isinstance(v, torch.Tensor):
            yield v


def local_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in local_tensors(state))


# --- helpers ---------------------------------------------------------------------------------------

def rank() -> int:
    return dist.get_rank()


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def prepare(*paths: Path) -> None:
    """Rank 0 removes the destinations and flushes the machine's dirty pages; untimed."""
    if rank() == 0:
        for p in paths:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        os.sync()
    dist.barrier()


def timed(fn):
    """(result, seconds): barrier, call, barrier; rank 0's clock is the slowest rank's time."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - t0


def cold_load(src: Path, load):
    """(result, seconds, this rank's /proc/self/io delta) of `load()` after evicting `src` from the page cache."""
    if rank() == 0:
        evict(src)
    dist.barrier()
    before = proc_io()
    out, seconds = timed(load)
    after = proc_io()
    return out, seconds, {k: after[k] - before[k] for k in ("rchar", "read_bytes", "syscr")}


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def evict(path: Path) -> int:
    """posix_fadvise(DONTNEED) every file of `path`; returns the bytes still resident (mincore via
    fincore would need a subprocess; the DONTNEED of clean, fsynced pages is reliable here)."""
    total = 0
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def proc_io() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


# --- save --------------------------------------------------------------------------------------

def raw_write(state: dict, path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        for t in local_tensors(state):
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def planning_probes(work: Path, mesh, n: int = 15) -> dict:
    """What a cache hit's planning is made of on this machine: one `all_gather_object` of a short
    string over gloo (the one exchange of a hit), the coordinator's staging directory alone
    (`core.commit.staging.Staging`: lock, fresh directory, fsyncs), and the planning of re-saves of a
    one-tensor state (the fixed cost, without the state's size)."""
    from hpckpt.core.commit.staging import Staging

    gathers = []
    doc = json.dumps({"error": None, "nonce": "0" * 32, "digest": "0" * 40, "plan": None})
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        gather(doc)
        gathers.append(time.perf_counter() - t0)
    staging = []
    if rank() == 0:
        for _ in range(n):
            t0 = time.perf_counter()
            st = Staging(work / "probe", force=True, sync=True, parents=True, shared=True)
            st.__enter__()
            st.__exit__(None, None, None)
            staging.append(time.perf_counter() - t0)
    tiny = {"w": DTensor.from_local(torch.ones(4, 8), mesh, [Shard(0)], run_check=False,
                                    shape=torch.Size((4 * dist.get_world_size(), 8)), stride=(8, 1))}
    tiny_planning = []
    for _ in range(n):
        dist.barrier()
        res = hdist.save(tiny, work / "hp_tiny")
        tiny_planning.append((res.plan_cache, res.planning))
    per = gather({"gather": gathers, "tiny": tiny_planning})
    if rank() == 0:
        shutil.rmtree(work / "hp_tiny", ignore_errors=True)
    return {"gather_max_over_ranks": [max(p["gather"][i] for p in per) for i in range(n)],
            "staging_rank0": staging,
            "tiny_hit_planning_max": [max(p["tiny"][i][1] for p in per) for i in range(n)
                                      if all(p["tiny"][i][0] == "hit" for p in per)],
            "tiny_hit_planning_min": [min(p["tiny"][i][1] for p in per) for i in range(n)
                                      if all(p["tiny"][i][0] == "hit" for p in per)]}


def async_parts(state: dict, n: int = 3) -> dict:
    """What `async_save` blocks on besides its gather: `hpckpt.dist.save_plan._describe` (an internal
    function: flatten, boxes, the staging copy, values pickled and checked, LocalPlan) with and
    without the copy, next to a plain `clone()` of every shard (slowest rank each)."""
    import importlib

    from hpckpt.dist import frameworks
    from hpckpt.dist.flatten import flatten
    from hpckpt.dist.output_formats import FORMATS

    hsave = importlib.import_module("hpckpt.dist.save_plan")  # where a save describes its state
    flat, paths = flatten(state, frameworks.is_any_tensor)
    fw = frameworks.of_state(flat)

    out = {"clone": [], "describe_staged": [], "describe_unstaged": []}
    for _ in range(n):
        for key in out:
            dist.barrier()
            t0 = time.perf_counter()
            if key == "clone":
                kept = [t.clone() for t in local_tensors(state)]
            else:
                kept = hsave._describe(flat, paths, fw, rank(), rank(), stage=key == "describe_staged",
                                       fmt=FORMATS["hyperparallel"])
            mine = time.perf_counter() - t0
            del kept
            out[key].append(max(gather(mine)))
    return {f"async_{k}": v for k, v in out.items()}


def run_save(args) -> None:
    world = dist.get_world_size()
    work = Path(args.work)
    mesh = init_device_mesh("cpu", (world,))
    state = build_state(args.size_gib, mesh, [Shard(0)])
    mine = local_bytes(state)
    rows = []  # one dict per (round, step)
    raw_dir = work / "raw"
    if rank() == 0:
        raw_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    def step_raw(r):
        prepare(*(raw_dir / f"rank{i}.bin" for i in range(world)))
        _, s = timed(lambda: raw_write(state, raw_dir / f"rank{rank()}.bin"))
        rows.append({"round": r, "step": "raw", "seconds": s})

    def step_hp(r):
        dest = work / "hp_fsdp"
        prepare(dest)
        res, s = timed(lambda: hdist.save(state, dest))
        per = gather({"planning": res.planning, "writing": res.writing, "blocked": res.blocked,
                      "plan_cache": res.plan_cache, "bytes_written": res.bytes_written, "files": len(res.files)})
        rows.append({"round": r, "step": "hp-save", "seconds": s, "job_bytes_written": res.job_bytes_written,
                     "ranks": per, "bytes_on_disk": tree_bytes(dest) if rank() == 0 else None})

    def step_hp_miss(r):
        # plan_cache=False: the whole global plan gathered and built, as on a miss (the cache is keyed
        # by the ranks' plans, not by the path, so a new path with the same state is still a hit)
        dest = work / "hp_nocache"
        prepare(dest)
        res, s = timed(lambda: hdist.save(state, dest, plan_cache=False))
        per = gather({"planning": res.planning, "writing": res.writing, "blocked": res.blocked,
                      "plan_cache": res.plan_cache})
        prepare(dest)
        rows.append({"round": r, "step": "hp-save-miss", "seconds": s, "ranks": per})

    def step_dcp(r):
        dest = work / "torch_fsdp"
        prepare(dest)
        _, s = timed(lambda: dcp.save(state, checkpoint_id=str(dest)))
        rows.append({"round": r, "step": "dcp-save", "seconds": s,
                     "bytes_on_disk": tree_bytes(dest) if rank() == 0 else None})

    def step_stage(r):
        dist.barrier()
        t0 = time.perf_counter()
        copies = [t.clone() for t in local_tensors(state)]
        mine_s = time.perf_counter() - t0
        dist.barrier()
        del copies
        rows.append({"round": r, "step": "stage", "seconds": max(gather(mine_s)), "ranks": gather(mine_s)})

    def step_hp_async(r):
        dest = work / "hp_async"
        prepare(dest)
        dist.barrier()
        t0 = time.perf_counter()
        handle = hdist.async_save(state, dest)
        returned = time.perf_counter() - t0
        res = handle.result()
        dist.barrier()
        durable = time.perf_counter() - t0
        per = gather({"returned": returned, "blocked": handle.blocked, "planning": res.planning,
                      "writing": res.writing, "plan_cache": res.plan_cache})
        rows.append({"round": r, "step": "hp-async", "blocked": max(p["returned"] for p in per), "seconds": durable,
                     "ranks": per})

    def step_dcp_async(r):
        dest = work / "torch_async"
        prepare(dest)
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(dest))
        returned = time.perf_counter() - t0
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        dist.barrier()
        durable = time.perf_counter() - t0
        per = gather({"returned": returned})
        rows.append({"round": r, "step": "dcp-async", "blocked": max(p["returned"] for p in per),
                     "seconds": durable, "ranks": per})

    for r in range(args.rounds):
        sync_order = [step_raw, step_hp, step_dcp, step_hp_miss] if r % 2 == 0 else \
            [step_hp_miss, step_dcp, step_hp, step_raw]
        async_order = [step_stage, step_hp_async, step_dcp_async] if r % 2 == 0 else \
            [step_dcp_async, step_hp_async, step_stage]
        for step in sync_order + async_order:
            step(r)
            if rank() == 0:
                last = rows[-1]
                print(f"save round {r} {last['step']}: {last['seconds']:.3f} s"
                      + (f" (blocked {last['blocked']:.3f} s)" if "blocked" in last else ""), flush=True)
    probes = planning_probes(work, mesh)
    probes.update(async_parts(state))
    # sources for the HSDP loads
    state = None  # the memory back before the next job step
    if rank() == 0:
        for name in ("raw", "hp_async", "torch_async", "probe"):
            p = work / name
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    hsdp = build_state(args.size_gib, mesh2, [Replicate(), Shard(0)])
    prepare(work / "hp_hsdp", work / "torch_hsdp")
    res, s_hp = timed(lambda: hdist.save(hsdp, work / "hp_hsdp"))
    _, s_dcp = timed(lambda: dcp.save(hsdp, checkpoint_id=str(work / "torch_hsdp")))
    hsdp_written = gather(res.bytes_written)
    if rank() == 0:
        print(f"hsdp sources: hpckpt {s_hp:.3f} s, torch {s_dcp:.3f} s", flush=True)
        report = {"world": world, "size_gib": args.size_gib, "tensor_bytes": engine_state.tensor_bytes(args.size_gib),
                  "rows": rows, "probes": probes,
                  "hsdp": {"hp_seconds": s_hp, "dcp_seconds": s_dcp, "hp_bytes_written": hsdp_written,
                           "hp_bytes_on_disk": tree_bytes(work / "hp_hsdp"),
                           "dcp_bytes_on_disk": tree_bytes(work / "torch_hsdp")}}
    locals_ = gather(mine)
    if rank() == 0:
        report["local_bytes"] = locals_
        Path(args.report).write_text(json.dumps(report, indent=1))
    dist.barrier()


# --- load --------------------------------------------------------------------------------------

def compare(state: dict, reference: dict) -> list[str]:
    bad = []
    for fqn, want in reference.items():
        got = state[fqn]
        if isinstance(want, torch.Tensor):
            got = got.to_local() if isinstance(got, DTensor) else got
            want = want.to_local() if isinstance(want, DTensor) else want
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                bad.append(fqn)
        elif got != want:
            bad.append(fqn)
    return bad


def run_load(args) -> None:
    world = dist.get_world_size()
    work = Path(args.work)
    mesh = init_device_mesh("cpu", (world,))
    reference = build_state(args.size_gib, mesh, [Shard(0)])
    kinds = [  # (name, source directory, loader)
        ("hp-load fsdp", "hp_fsdp", "hp"),
        ("dcp-load fsdp", "torch_fsdp", "dcp"),
        ("hp-load hsdp", "hp_hsdp", "hp"),
        ("dcp-load hsdp", "torch_hsdp", "dcp"),
        ("hp-load torch-fsdp", "torch_fsdp", "hp"),
        ("hp-load torch-hsdp", "torch_hsdp", "hp"),
    ]
    if args.only:
        kinds = [k for k in kinds if any(o in k[0] for o in args.only.split(","))]
    rows = []
    checked = set()
    for r in range(args.rounds):
        order = kinds if r % 2 == 0 else list(reversed(kinds))
        for name, source, loader in order:
            src = work / source
            state = build_state(args.size_gib, mesh, [Shard(0)], empty=True)
            if loader == "hp":
                res, s, delta = cold_load(src, lambda: hdist.load(state, src))
            else:
                res, s, delta = cold_load(src, lambda: dcp.load(state, checkpoint_id=str(src)))
            mine = {"io": delta}
            if loader == "hp":
                mine.update(bytes_read=res.bytes_read, bytes_broadcast=res.bytes_broadcast,
                            job_bytes_read=res.job_bytes_read, job_bytes_wanted=res.job_bytes_wanted,
                            read_amplification=res.read_amplification, seconds=res.seconds)
            if name not in checked:
                mine["bad"] = compare(state, reference)
            per = gather(mine)
            row = {"round": r, "step": name, "source": source, "loader": loader, "seconds": s, "ranks": per,
                   "rchar": sum(p["io"]["rchar"] for p in per), "read_bytes": sum(p["io"]["read_bytes"] for p in per)}
            if name not in checked:
                row["mismatches"] = sorted({f for p in per for f in p["bad"]})
                checked.add(name)
            rows.append(row)
            if rank() == 0:
                extra = f", hpckpt amplification {per[0]['read_amplification']:.3f}" if loader == "hp" else ""
                check = f", mismatches {len(row['mismatches'])}" if "mismatches" in row else ""
                print(f"load round {r} {name}: {s:.3f} s, rchar {row['rchar'] / 2**30:.3f} GiB{extra}{check}",
                      flush=True)
            state = None  # its memory back before the next load
    if rank() == 0:
        sources = {s: {"bytes_on_disk": tree_bytes(work / s)} for _n, s, _l in kinds}
        Path(args.report).write_text(json.dumps({"world": world, "size_gib": args.size_gib,
                                                 "tensor_bytes": engine_state.tensor_bytes(args.size_gib),
                                                 "sources": sources, "rows": rows}, indent=1))
    dist.barrier()


def main(save=None, load=None) -> None:
    """Parse the job's options and run the save or load half (`save`/`load`: another bench's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--size-gib", type=float, required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, warm-up rounds included")
    parser.add_argument("--only", default="")
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        ((save or run_save) if args.mode == "save" else (load or run_load))(args)
    finally:
        dist.destroy_process_group()
        time.sleep(0.05)  # torch's exit abort: README, "Clean exits"


if __name__ == "__main__":
    main()
