"""Live `hpckpt.dist` jobs for tests/test_dist_fixtures.py (run under torchrun, gloo, CPU).

    torchrun --standalone --nproc-per-node N fixtures_job.py load-fixtures FIXTURES_DIR OUT_DIR
    torchrun --standalone --nproc-per-node 2 fixtures_job.py save-live OUT_DIR

`load-fixtures`: for every HyperParallel fixture under FIXTURES_DIR, every rank builds a target
state dict from the fixture's `expected.safetensors` (names, shapes, dtypes) with zero DTensors in
a layout chosen for the world size (Shard(0)/Shard(1)/Replicate over a 1-D mesh of N, and for N=4
also `[R, S1]` / `[S0, S1]` over a 2x2 mesh; plain tensors for 0-d and a few others), `None` for
every value of `expected.json`, calls `hpckpt.dist.load` and compares every local shard with the
matching slice of the expected full tensor (`torch.equal`, same dtype) and every value (value and
Python type). It also checks that the tensors were filled in place (same objects, same storage).
Each rank writes `OUT_DIR/load-rank{r}.json`: per fixture the layout used, the LoadResult fields,
the number of tensors/values checked and every failure (a traceback if `load` raised). Exit 0
only when nothing failed on this rank.

`save-live`: both ranks save the state of `live_state()` three times, with
`coordination="collectives"` (-> OUT_DIR/collectives), `coordination="storage"` (-> OUT_DIR/storage)
and `async_save` (-> OUT_DIR/async); rank 0 writes the full tensors and values to
OUT_DIR/reference.pt; then every rank loads each of the three checkpoints back, into the saved
layout and into a different one, and compares. Results in `OUT_DIR/save-rank{r}.json`.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import hpckpt.dist as hdist
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(int(size), 1)
    return tuple(reversed(stride))


def zeros_dtensor(shape, dtype, mesh, placements) -> DTensor:
    """A zero DTensor built without any collective (gloo has no bool scatter)."""
    local_shape, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
    return DTensor.from_local(torch.zeros(local_shape, dtype=dtype), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=contiguous_stride(shape))


def expected_local(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """The slice of `full` this rank's shard holds, from torch's own shard geometry."""
    local_shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape))
    return full[index]


def describe(placements) -> str:
    return ",".join("R" if isinstance(p, Replicate) else f"S{p.dim}" for p in placements)


def choose_layout(i: int, name: str, t: torch.Tensor, world: int, mesh1, mesh2):
    """(kind, mesh, placements): varied, deterministic layouts for the target of the `i`-th tensor."""
    if t.dim() == 0:
        return "plain", None, None
    if name.endswith(("position_ids", "inv_freq")):
        return "plain", None, None  # a plain tensor, full on every rank
    if mesh2 is not None and t.dim() >= 2 and i % 3 != 0:
        return "dtensor", mesh2, ([Replicate(), Shard(1)] if i % 3 == 1 else [Shard(0), Shard(1)])
    if i % 4 == 1:
        return "dtensor", mesh1, [Replicate()]
    if t.dim() >= 2 and i % 4 == 2:
        return "dtensor", mesh1, [Shard(1)]
    return "dtensor", mesh1, [Shard(0)]


def check_value(name: str, got, exp: dict) -> str | None:
    want_type, want = exp["type"], exp["value"]
    if type(got).__name__ != want_type:
        return f"{name}: type {type(got).__name__} ({got!r}) != {want_type} ({want!r})"
    if want_type == "tuple":
        got = list(got)
    if got != want:
        return f"{name}: value {got!r} != {want!r}"
    return None


def load_one_fixture(fixture: Path, world: int, rank: int, mesh1, mesh2) -> dict:
    report: dict = {"layout": {}, "failures": [], "tensors_checked": 0, "values_checked": 0}
    full = load_file(str(fixture / "expected.safetensors"))
    values = json.loads((fixture / "expected.json").read_text())
    state: dict = {}
    layouts: dict = {}
    for i, name in enumerate(sorted(full)):
        t = full[name]
        kind, mesh, placements = choose_layout(i, name, t, world, mesh1, mesh2)
        layouts[name] = (kind, mesh, placements)
        if kind == "plain":
            state[name] = torch.zeros(t.shape, dtype=t.dtype)
            report["layout"][name] = "plain"
        else:
            state[name] = zeros_dtensor(t.shape, t.dtype, mesh, placements)
            report["layout"][name] = f"{'x'.join(map(str, mesh.shape))}:{describe(placements)}"
    for name in values:
        state[name] = None
    originals = {name: state[name] for name in full}
    storages = {name: (v.to_local() if isinstance(v, DTensor) else v).untyped_storage().data_ptr()
                for name, v in originals.items()}
    try:
        result = hdist.load(state, str(fixture))
    except Exception:  # noqa: BLE001 - reported in the rank's JSON, never lost
        report["failures"].append("load raised:\n" + traceback.format_exc())
        return report
    report["result"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                        for k, v in vars(result).items()} if hasattr(result, "__dict__") else repr(result)
    fails = report["failures"]
    if getattr(result, "world_size", None) != world:
        fails.append(f"LoadResult.world_size {getattr(result, 'world_size', None)} != {world}")
    if getattr(result, "rank", None) != rank:
        fails.append(f"LoadResult.rank {getattr(result, 'rank', None)} != {rank}")
    if tuple(getattr(result, "missing", ())) != ():
        fails.append(f"LoadResult.missing {result.missing!r} (strict load)")
    for name, t in full.items():
        kind, mesh, placements = layouts[name]
        got = state.get(name)
        if got is not originals[name]:
            fails.append(f"{name}: the state dict entry was replaced ({type(got).__name__}), not filled in place")
            continue
        if kind == "plain":
            local, want = got, t
        else:
            if tuple(got.placements) != tuple(placements) or got.device_mesh is not mesh:
                fails.append(f"{name}: layout changed to {got.placements}")
            local, want = got.to_local(), expected_local(t, mesh, placements)
        if local.untyped_storage().data_ptr() != storages[name]:
            fails.append(f"{name}: local tensor storage changed (not filled in place)")
        if local.dtype != want.dtype:
            fails.append(f"{name}: dtype {local.dtype} != {want.dtype}")
        elif local.shape != want.shape:
            fails.append(f"{name}: local shape {tuple(local.shape)} != {tuple(want.shape)}")
        elif not torch.equal(local, want):
            diff = (local != want).nonzero()[:3].tolist()
            fails.append(f"{name} [{report['layout'][name]}]: values differ (first bad local indices {diff}); "
                         f"got {local.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}")
        report["tensors_checked"] += 1
    for name, exp in values.items():
        problem = check_value(name, state.get(name), exp)
        if problem:
            fails.append(problem)
        report["values_checked"] += 1
    extra = sorted(set(state) - set(full) - set(values))
    if extra:
        fails.append(f"load added entries to the state dict: {extra}")
    return report


def load_fixtures(fixtures: Path, out: Path) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2)) if world == 4 else None
    report: dict = {"rank": rank, "world_size": world, "fixtures": {}}
    for fixture in sorted(p for p in fixtures.iterdir() if (p / "expected.safetensors").exists()):
        t0 = time.perf_counter()
        try:
            report["fixtures"][fixture.name] = load_one_fixture(fixture, world, rank, mesh1, mesh2)
        except Exception:  # noqa: BLE001 - reported in the rank's JSON, never lost
            report["fixtures"][fixture.name] = {"failures": ["job raised:\n" + traceback.format_exc()]}
        report["fixtures"][fixture.name]["seconds"] = round(time.perf_counter() - t0, 3)
        dist.barrier()  # keep the ranks in step: a rank that failed early must not desync the next load
    if world == 4:
        async_fixture = fixtures / "m0-torch-4rank-async"
        try:
            report["fixtures"][async_fixture.name + "@saved-layout"] = load_in_saved_layout(async_fixture, rank)
        except Exception:  # noqa: BLE001 - reported in the rank's JSON, never lost
            report["fixtures"][async_fixture.name + "@saved-layout"] = {
                "failures": ["job raised:\n" + traceback.format_exc()]}
    (out / f"load-rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    failed = {k: v["failures"] for k, v in report["fixtures"].items() if v["failures"]}
    for name, problems in failed.items():
        for p in problems:
            print(f"[rank {rank}] {name}: {p}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort: README, "Clean exits"
    return 1 if failed else 0


class _Chunk:
    """HyperParallel's ChunkInfo shape: `chunk.offsets`, `chunk.sizes`, `global_shape`."""

    def __init__(self, offsets, sizes, global_shape):
        self.chunk = type("ChunkStorageMetadata", (), {"offsets": tuple(offsets), "sizes": tuple(sizes)})()
        self.global_shape = tuple(global_shape)


def load_in_saved_layout(fixture: Path, rank: int) -> dict:
    """The async fixture loaded into the very layout each tensor was saved with
    (`expected.layout.json`): HyperParallel's balanced and ceil splits, 2x2 meshes, as plain tensors
    carrying `chunk_info` (the boxes HyperParallel's own layout gives this rank); a ragged layout
    that gives this rank several boxes is loaded whole instead (one tensor holds one box)."""
    from hpckpt.core.geometry.layout import LayoutSpec, Mesh, parse_placements

    spec = json.loads((fixture / "expected.layout.json").read_text())["tensors"]
    full = load_file(str(fixture / "expected.safetensors"))
    values = json.loads((fixture / "expected.json").read_text())
    state, boxes = {}, {}
    for name, t in full.items():
        layout = spec.get(name, "plain")
        mine = None
        if layout != "plain":
            mesh = Mesh(tuple(int(n) for n in layout["mesh"].split("x")))
            tl = LayoutSpec(mesh, parse_placements(layout["placements"])).resolve(name, tuple(t.shape))
            mine = [b for b in tl.all_boxes(tuple(t.shape)).get(rank, []) if not b.is_empty]
        if mine is not None and len(mine) == 1:
            box = mine[0]
            local = torch.zeros(box.sizes, dtype=t.dtype)
            local.chunk_info = _Chunk(box.offsets, box.sizes, t.shape)
            state[name], boxes[name] = local, box
        elif mine is not None and len(mine) == 0:
            continue  # this rank holds nothing of it
        else:
            state[name], boxes[name] = torch.zeros_like(t), None
    for name in values:
        state[name] = None
    result = hdist.load(state, str(fixture))
    failures = []
    for name, box in boxes.items():
        want = full[name] if box is None else full[name][tuple(slice(o, o + z) for o, z in zip(box.offsets, box.sizes))]
        if not torch.equal(state[name], want):
            failures.append(f"{name}: the box {box} differs from expected.safetensors")
    for name, exp in values.items():
        problem = check_value(name, state[name], exp)
        if problem:
            failures.append(problem)
    return {"failures": failures, "tensors_checked": len(boxes), "values_checked": len(values),
            "layout": {n: "chunk_info" if b is not None else "plain" for n, b in boxes.items()},
            "read_amplification": result.read_amplification, "wants_from": result.wants_from}


# ----------------------------------------------------------------------------------- save-live

def live_full() -> dict:
    """The same global tensors on every rank (deterministic)."""
    return {
        "model.rows": (torch.arange(15, dtype=torch.float32) * 0.5).reshape(5, 3),   # S0 uneven: 3 + 2
        "model.even": (torch.arange(24, dtype=torch.float32) - 3).reshape(6, 4),      # S0 even: 3 + 3
        "model.bf": (torch.arange(14, dtype=torch.float32) * 0.25).reshape(7, 2).to(torch.bfloat16),  # S0: 4 + 3
        "model.tiny": torch.arange(3, dtype=torch.int64).reshape(1, 3),                # S0: rank 1 empty
        "model.rep": (torch.arange(6, dtype=torch.float32) + 0.5).reshape(2, 3),      # Replicate
        "optim.step": torch.tensor(7.0),                                              # plain 0-d
    }


LIVE_VALUES = {"extra.epoch": 3, "extra.tag": "live", "extra.betas": (0.9, 0.95)}
LIVE_PLACEMENTS = {"model.rows": [Shard(0)], "model.even": [Shard(0)], "model.bf": [Shard(0)],
                   "model.tiny": [Shard(0)], "model.rep": [Replicate()]}


def live_state(mesh, full: dict, zeros: bool, placements: dict) -> dict:
    state: dict = {}
    for name, t in full.items():
        if name in placements:
            if zeros:
                state[name] = zeros_dtensor(t.shape, t.dtype, mesh, placements[name])
            else:
                d = zeros_dtensor(t.shape, t.dtype, mesh, placements[name])
                d.to_local().copy_(expected_local(t, mesh, placements[name]))
                state[name] = d
        else:
            state[name] = torch.zeros_like(t) if zeros else t.clone()
    for name, v in LIVE_VALUES.items():
        state[name] = None if zeros else v
    return state


def result_json(result) -> dict:
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in vars(result).items()}


def save_live(out: Path) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = live_full()
    report: dict = {"rank": rank, "saves": {}, "loads": {}, "failures": []}
    fails = report["failures"]
    if rank == 0:
        torch.save({"tensors": full, "values": {k: list(v) if isinstance(v, tuple) else v
                                                for k, v in LIVE_VALUES.items()}}, out / "reference.pt")
    for kind in ("collectives", "storage", "async"):
        state = live_state(mesh, full, zeros=False, placements=LIVE_PLACEMENTS)
        try:
            if kind == "async":
                handle = hdist.async_save(state, str(out / kind))
                result = handle.result(120)
            else:
                result = hdist.save(state, str(out / kind), coordination=kind, timeout=60)
            report["saves"][kind] = result_json(result)
        except Exception:  # noqa: BLE001 - reported in the rank's JSON, never lost
            fails.append(f"save {kind} raised:\n{traceback.format_exc()}")
        dist.barrier()
    other = {"model.rows": [Replicate()], "model.even": [Shard(1)], "model.bf": [Replicate()],
             "model.tiny": [Shard(1)], "model.rep": [Shard(0)]}
    for kind in ("collectives", "storage", "async"):
        for layout_name, placements in (("saved", LIVE_PLACEMENTS), ("other", other)):
            state = live_state(mesh, full, zeros=True, placements=placements)
            try:
                result = hdist.load(state, str(out / kind))
                report["loads"][f"{kind}/{layout_name}"] = result_json(result)
            except Exception:  # noqa: BLE001 - reported in the rank's JSON, never lost
                fails.append(f"load {kind} into {layout_name} layout raised:\n{traceback.format_exc()}")
                continue
            for name, t in full.items():
                got = state[name]
                if isinstance(got, DTensor):
                    local, want = got.to_local(), expected_local(t, mesh, placements[name])
                else:
                    local, want = got, t
                if local.dtype != want.dtype or local.shape != want.shape or not torch.equal(local, want):
                    fails.append(f"{kind}/{layout_name} {name}: got {local!r} want {want!r}")
            for name, v in LIVE_VALUES.items():
                if state[name] != v or type(state[name]) is not type(v):
                    fails.append(f"{kind}/{layout_name} {name}: got {state[name]!r} want {v!r}")
    (out / f"save-rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True, default=repr))
    for p in fails:
        print(f"[rank {rank}] {p}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort: README, "Clean exits"
    return 1 if fails else 0


def main() -> int:
    mode = sys.argv[1]
    if mode == "load-fixtures":
        return load_fixtures(Path(sys.argv[2]), Path(sys.argv[3]))
    if mode == "save-live":
        return save_live(Path(sys.argv[2]))
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
