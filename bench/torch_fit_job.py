"""The job of `bench/bench_torch_fit.py` (under torchrun): hpckpt inside torch DCP against torch's
own storage, on the same state.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/torch_fit_job.py save \
        --size-gib 1 --work DIR --rounds 4 --report DIR/save.json
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 bench/torch_fit_job.py load \
        --size-gib 1 --work DIR --rounds 4 --report DIR/load.json

The state is `dist_job.build_state`'s (engine_state's transformer-like tensors, fp32 and bf16,
uneven first dims, as DTensors). Every time is rank 0's from a barrier before the call to one after
it (the slowest rank); the order of the contenders alternates from round to round.

`save` (Shard(0) over the job's ranks), each destination removed and `os.sync()`ed first (untimed):
  dcp-save          `dcp.save(state, checkpoint_id=W/torch)`: FileSystemWriter, fsyncs its files.
  dcp+HpckptWriter  `dcp.save(state, storage_writer=HpckptWriter(W/hpwriter))`: torch's planner,
                    hpckpt's writer and engine, fsynced, manifest, atomic commit.
  hdist torch-dcp   `hdist.save(state, W/hptorch, format="torch-dcp")`: hpckpt's planning too.
`load` (targets Shard(0) over the job's ranks, but the state's other dimension order: the save
job's state built on a mesh of the ranks in reverse, so every rank reads another rank's rows),
every source file evicted from the page cache before each load:
  dcp-load                 `dcp.load(state, checkpoint_id=W/torch)`: FileSystemReader.
  dcp+HpckptReader         `dcp.load(state, storage_reader=HpckptReader(W/torch))`, the same source.
  dcp+HpckptReader (hp)    the same reader on hpckpt's HyperParallel save of the state (W/hp).
The first load of each kind is checked element by element against the pattern (untimed).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402

from dist_job import build_state, cold_load, compare, gather, prepare, rank, timed, tree_bytes  # noqa: E402
from dist_job import main as job_main  # noqa: E402

import hpckpt.dist as hdist  # noqa: E402
from hpckpt.dist.torch_storage import HpckptReader, HpckptWriter  # noqa: E402

SAVES = {
    "dcp-save": ("torch", lambda state, dest: dcp.save(state, checkpoint_id=str(dest))),
    "dcp+HpckptWriter": ("hpwriter", lambda state, dest: dcp.save(state, storage_writer=HpckptWriter(dest))),
    "hdist torch-dcp": ("hptorch", lambda state, dest: hdist.save(state, dest, format="torch-dcp")),
}
LOADS = {
    "dcp-load": ("torch", lambda state, src: dcp.load(state, checkpoint_id=str(src))),
    "dcp+HpckptReader": ("torch", lambda state, src: dcp.load(state, storage_reader=HpckptReader(src))),
    "dcp+HpckptReader (hp)": ("hp", lambda state, src: dcp.load(state, storage_reader=HpckptReader(src))),
}


def run_save(args) -> None:
    work = Path(args.work)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = build_state(args.size_gib, mesh, [Shard(0)])
    rows = []
    for r in range(args.rounds):
        order = list(SAVES) if r % 2 == 0 else list(reversed(SAVES))
        for name in order:
            folder, save = SAVES[name]
            dest = work / folder
            prepare(dest)
            _, seconds = timed(lambda: save(state, dest))
            rows.append({"round": r, "step": name, "seconds": seconds,
                         "bytes_on_disk": tree_bytes(dest) if rank() == 0 else None})
            if rank() == 0:
                print(f"save round {r} {name}: {seconds:.3f} s", flush=True)
    prepare(work / "hp")
    hdist.save(state, work / "hp")  # the HyperParallel source of the last load
    if rank() == 0:
        Path(args.report).write_text(json.dumps({"world": dist.get_world_size(), "size_gib": args.size_gib,
                                                 "rows": rows}, indent=1))
    dist.barrier()


def run_load(args) -> None:
    work = Path(args.work)
    world = dist.get_world_size()
    # the ranks in reverse: every rank's rows are another rank's saved rows
    mesh = DeviceMesh("cpu", list(reversed(range(world))))
    reference = build_state(args.size_gib, mesh, [Shard(0)])
    rows, checked = [], set()
    for r in range(args.rounds):
        order = list(LOADS) if r % 2 == 0 else list(reversed(LOADS))
        for name in order:
            folder, load = LOADS[name]
            src = work / folder
            state = build_state(args.size_gib, mesh, [Shard(0)], empty=True)
            _, seconds, io = cold_load(src, lambda: load(state, src))
            mine = {"rchar": io["rchar"], "read_bytes": io["read_bytes"]}
            if name not in checked:
                mine["bad"] = compare(state, reference)
            per = gather(mine)
            row = {"round": r, "step": name, "seconds": seconds, "rchar": sum(p["rchar"] for p in per),
                   "read_bytes": sum(p["read_bytes"] for p in per)}
            if name not in checked:
                row["mismatches"] = sorted({f for p in per for f in p["bad"]})
                checked.add(name)
            rows.append(row)
            if rank() == 0:
                print(f"load round {r} {name}: {seconds:.3f} s, rchar {row['rchar'] / 2**30:.3f} GiB"
                      + (f", mismatches {len(row['mismatches'])}" if "mismatches" in row else ""), flush=True)
            state = None
    if rank() == 0:
        Path(args.report).write_text(json.dumps({"world": world, "size_gib": args.size_gib, "rows": rows}, indent=1))
    dist.barrier()


if __name__ == "__main__":
    job_main(run_save, run_load)  # dist_job's options: mode, --size-gib, --work, --rounds, --report
