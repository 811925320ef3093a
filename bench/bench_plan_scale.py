"""The global plan of `hpckpt.dist.save` at internet scale, simulated in one process.

    python bench/bench_plan_scale.py --ranks 1024,4096,16384 --tensors 1000 --layouts fsdp,hsdp,tp

No real ranks: what `hpckpt.dist.save` does with the plans is timed, each (ranks, layout) case
in a fresh child process so that its peak RSS is its own. Ranks whose tensors are DTensor-like
(these layouts) agree on a layout table and send its digest (`plan_from="layouts"`):

  table     one rank's part: its `LayoutTable` (every tensor's name, dtype, shape, layout), the
            table's digest, and the JSON it sends in the plan exchange (its bytes; every rank
            receives that times the ranks);
  layouts   the global plan from the table (`core.geometry.layout_plan`), what every rank does;
  own plan  `global_plan.plan([0])`, the Plan of the boxes rank 0 writes;
  commit    the coordinator's commit (skipped with --no-metadata), as `dist/save_commit.py`
            does it: the files and `.metadata` (its size) from the plan's arrays (from 50,000
            chunks; below, through the Plan of every box), and the metadata read back as a
            loader reads it (the commit's check); one peak for both.

With --boxes, also the path of ranks that send their boxes (`plan_from="boxes"`: a tensor
without a layout, HyperParallel's chunk_info), what every save did before issue 29:

  rank      one rank's part: `LocalPlan` from its boxes, `to_json`, `json.dumps` (the bytes it
            sends in the plan exchange; the table gives rank 0's and the largest of all ranks);
  gather    what every rank does with the gathered plans today: `json.loads` + `from_json` of
            all of them (the all-gather hands every rank every plan);
  global    `build_global_plan(plans, dedup="balanced")`, the coordinator's planning;
  own plan  `global_plan.plan([0])`, the Plan of the boxes one rank writes;
  hit       the plan cache's hit path: every rank's `digest()` (each rank does its own; the
            figure is one rank's) and `plan_key` over all the digests (what every rank does);

Peak RSS is read from the kernel after each phase (VmHWM, reset between phases through
`/proc/self/clear_refs`), so each phase's figure is its own peak. The job's state: `--tensors`
LLM-like tensors (per layer q, k, v, o, gate, up, down, two norms), laid out as
  fsdp  Shard(0) over every rank (torch.chunk's rule; ranks past the rows hold an empty box),
  hsdp  a 2-D mesh (8, N/8): Replicate over dim 0, Shard(0) over dim 1 (8 replicas of each box),
  tp    a 2-D mesh (N/8, 8): Shard(0) over dim 0, Shard(1) over dim 1 (2-D sharding).
Goal (issue 29): under 2 s and 1 GiB for the coordinator at 16,384 ranks x 1,000 tensors, and a
rank's exchange O(its own boxes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from hpckpt.dist.jobs.bench_measure import memory, reset_peak_rss

HIDDEN, KV, MLP = 8192, 1024, 28672


def tensors_of(n: int) -> list[tuple[str, str, tuple[int, ...]]]:
    per_layer = [("q", (HIDDEN, HIDDEN)), ("k", (KV, HIDDEN)), ("v", (KV, HIDDEN)), ("o", (HIDDEN, HIDDEN)),
                 ("gate", (MLP, HIDDEN)), ("up", (MLP, HIDDEN)), ("down", (HIDDEN, MLP)),
                 ("norm1", (HIDDEN,)), ("norm2", (HIDDEN,))]
    out = []
    while len(out) < n:
        layer = len(out) // len(per_layer)
        name, shape = per_layer[len(out) % len(per_layer)]
        out.append((f"model.layers.{layer}.{name}.weight", "bfloat16", shape))
    return out


def chunk_rule(length: int, parts: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """torch.chunk's split of `length` into `parts`: (start, size) of part `index` (an array)."""
    step = -(-length // parts)
    start = np.minimum(index * step, length)
    return start, np.minimum(start + step, length) - start


def rank_boxes(shape: tuple[int, ...], layout: str, world: int) -> tuple[np.ndarray, np.ndarray]:
    """`(offsets, sizes)` `[world, ndim]` of the box each rank holds of a tensor of `shape`."""
    ranks = np.arange(world)
    offsets = np.zeros((world, len(shape)), np.int64)
    sizes = np.tile(np.array(shape, np.int64), (world, 1))
    if layout == "fsdp":
        offsets[:, 0], sizes[:, 0] = chunk_rule(shape[0], world, ranks)
    elif layout == "hsdp":
        offsets[:, 0], sizes[:, 0] = chunk_rule(shape[0], world // 8, ranks % (world // 8))
    elif layout == "tp":
        offsets[:, 0], sizes[:, 0] = chunk_rule(shape[0], world // 8, ranks // 8)
        if len(shape) > 1:
            offsets[:, 1], sizes[:, 1] = chunk_rule(shape[1], 8, ranks % 8)
    return offsets, sizes


def peak_mib() -> float:
    return memory()["VmHWM"] / 2**20


def layout_of(shape: tuple[int, ...], layout: str, world: int, meshes: dict):
    """The `TensorLayout` that `rank_boxes` cuts by (one Mesh per layout, as a job's DeviceMesh)."""
    from hpckpt.core.geometry.layout import Mesh, Replicate, Shard, TensorLayout

    if layout not in meshes:
        meshes[layout] = Mesh((world,) if layout == "fsdp" else (8, world // 8) if layout == "hsdp" else (world // 8, 8))
    mesh = meshes[layout]
    if layout == "fsdp":
        return TensorLayout(mesh, (Shard(0, "ceil"),))
    if layout == "hsdp":
        return TensorLayout(mesh, (Replicate(), Shard(0, "ceil")))
    return TensorLayout(mesh, (Shard(0, "ceil"), Shard(1, "ceil") if len(shape) > 1 else Replicate()))


def layouts_case(world: int, n_tensors: int, layout: str, out: dict) -> object:
    """The path of ranks with layouts: the table, its digest, the exchange, the plan from layouts."""
    from hpckpt.core.geometry.layout_plan import LayoutTable

    tensors = tensors_of(n_tensors)
    t0 = time.perf_counter()
    meshes: dict = {}
    table = LayoutTable([(n, d, s, layout_of(s, layout, world, meshes)) for n, d, s in tensors])
    digest = table.digest()
    # what a rank sends in the plan exchange (dist/save_plan.py `mine`): digests, no boxes
    sent = json.dumps({"error": None, "nonce": "0" * 16, "digest": "0" * 40, "cached": ["0" * 40], "plan": None,
                       "table": digest, "values": [], "value_paths": {}}).encode()
    out["table_s"] = time.perf_counter() - t0
    out["table_sent_b"] = len(sent)
    out["table_received_mib"] = len(sent) * world / 2**20
    out["table_json_kib"] = len(table.to_json()) / 1024

    reset_peak_rss()
    t0 = time.perf_counter()
    gp = table.plan(world, dedup="balanced", values=(), value_lengths={}, nesting={}, key="")
    out["layouts_s"] = time.perf_counter() - t0
    out["layouts_peak_mib"] = peak_mib()
    out["stored_boxes"] = int(len(gp.tid))
    out["gathered_boxes"] = int(sum(len(table.rows[0][3].mesh.ranks) for _ in tensors))

    t0 = time.perf_counter()
    mine = gp.plan([0])
    out["own_plan_s"] = time.perf_counter() - t0
    out["own_boxes"] = sum(len(t.boxes) for t in mine.tensors)
    return gp


def boxes_case(world: int, n_tensors: int, layout: str, out: dict) -> None:
    """The path of ranks that send their boxes: every rank's LocalPlan gathered, the global plan."""
    from hpckpt.core.geometry.global_plan import LocalPlan, build_global_plan, plan_key

    tensors = tensors_of(n_tensors)
    names, dtypes, shapes = [t[0] for t in tensors], [t[1] for t in tensors], [list(t[2]) for t in tensors]
    # the state: per tensor, every rank's box; rows (position, slot, offsets[2], sizes[2]) per rank
    table = np.zeros((world, n_tensors, 6), np.int64)
    for t, (_, _, shape) in enumerate(tensors):
        offsets, sizes = rank_boxes(shape, layout, world)
        table[:, t, 0] = t
        table[:, t, 2:2 + len(shape)] = offsets
        table[:, t, 4:4 + len(shape)] = sizes

    t0 = time.perf_counter()
    wires = []
    sent = []
    for r in range(world):
        wire = json.dumps(LocalPlan(r, names, dtypes, shapes, table[r]).to_json(), separators=(",", ":"))
        sent.append(len(wire))
        wires.append(wire)
    out["rank_s"] = (time.perf_counter() - t0) / world
    out["max_sent_kib"] = max(sent) / 1024
    out["gathered_mib"] = sum(sent) / 2**20
    del table

    reset_peak_rss()
    t0 = time.perf_counter()
    plans = [LocalPlan.from_json(json.loads(w)) for w in wires]
    out["gather_s"] = time.perf_counter() - t0
    out["gather_peak_mib"] = peak_mib()
    del wires

    reset_peak_rss()
    t0 = time.perf_counter()
    gp = build_global_plan(plans, dedup="balanced")
    out["global_s"] = time.perf_counter() - t0
    out["global_peak_mib"] = peak_mib()
    out["boxes_stored"] = int(len(gp.tid))

    t0 = time.perf_counter()
    digest = plans[0].digest()
    out["digest_s"] = time.perf_counter() - t0
    digests = [digest] * world  # (every rank's is its own; the key's cost is in its length)
    t0 = time.perf_counter()
    plan_key(digests, {"dedup": "balanced", "world_size": world})
    out["key_s"] = time.perf_counter() - t0


def load_case(world: int, n_tensors: int, layout: str, out: dict, boxes: bool) -> None:
    """The plan of a live load into these layouts (`hpckpt.dist.load`): which boxes several ranks
    want and who reads each one broadcast, from the digest of the layout table every rank sends
    (`LayoutWants`; every set broadcasts, so every shared box gets its reader); with --boxes also
    from every rank's gathered list of boxes (`ListedWants`), what every load did before."""
    from hpckpt.core.dtypes import dtype
    from hpckpt.core.geometry.layout_plan import LayoutTable, mesh_boxes
    from hpckpt.core.geometry.load_sharing import LayoutWants, ListedWants

    meshes: dict = {}
    rows = [(n, s, layout_of(s, layout, world, meshes), dtype(d).itemsize) for n, d, s in tensors_of(n_tensors)]
    digest = LayoutTable([(n, "bfloat16", s, lay) for n, s, lay, _i in rows]).digest()
    out["load_sent_b"] = len(json.dumps([{"table": digest}, None, "host-0000"]).encode())
    reset_peak_rss()
    t0 = time.perf_counter()
    wants = LayoutWants(rows, world, 0)
    out["load_shared_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mine = wants.mine(set(wants.shared))
    out["load_readers_s"] = time.perf_counter() - t0
    out["load_peak_mib"] = peak_mib()
    out["load_sets"] = len(wants.shared)
    out["load_shared_boxes"] = sum(b for b, _n in wants.shared.values())
    out["load_mine"] = len(mine)
    if not boxes or world > 4096:
        return
    everyone = [[] for _ in range(world)]
    for n, s, lay, itemsize in rows:
        ranks, offsets, sizes = mesh_boxes(lay, s)
        for r, o, z in zip(ranks.tolist(), offsets.tolist(), sizes.tolist()):
            if all(z):
                everyone[r].append([n, o, z, int(np.prod(z)) * itemsize])
    wires = [json.dumps([{"boxes": w}, None, "host-0000"]) for w in everyone]
    out["load_boxes_sent_kib"] = max(len(w) for w in wires) / 1024
    del everyone
    reset_peak_rss()
    t0 = time.perf_counter()
    listed = ListedWants([json.loads(w)[0]["boxes"] for w in wires], 0)
    listed.mine(set(listed.shared))
    out["load_boxes_s"] = time.perf_counter() - t0
    out["load_boxes_peak_mib"] = peak_mib()
    assert listed.shared == wants.shared, "the two paths share different boxes"


def one_case(world: int, n_tensors: int, layout: str, metadata: bool, boxes: bool) -> dict:
    out = {"ranks": world, "tensors": n_tensors, "layout": layout, "state_mib": round(peak_mib())}
    load_case(world, n_tensors, layout, out, boxes)
    gp = layouts_case(world, n_tensors, layout, out)
    if metadata:  # the coordinator's commit, step by step as dist/save_commit.py `_commit` does it
        import tempfile
        from dataclasses import replace
        from pathlib import Path

        from hpckpt.converters.base import WriterOptions
        from hpckpt.converters.hyperparallel.reader import HyperParallelReader
        from hpckpt.converters.hyperparallel.writer import HyperParallelWriter
        from hpckpt.core.io.write import lay_out

        reset_peak_rss()
        t0 = time.perf_counter()
        writer = HyperParallelWriter(WriterOptions(framework="torch"))
        made = writer.from_global_plan(gp)  # from the plan's arrays (50,000 chunks or more)
        if made is None:  # the Plan of every box, as below 50,000 chunks
            full = gp.plan()
            lay_out(replace(full, producing=()), {}, writer)
            data = writer.finish({}).metadata[0][1]
            del full
        else:
            data = made[1].metadata[0][1]
        out["metadata_mib"] = len(data) / 2**20
        out["metadata_s"] = time.perf_counter() - t0
        out["commit_from"] = "Plan" if made is None else "arrays"
        with tempfile.TemporaryDirectory() as scratch:
            (Path(scratch) / ".metadata").write_bytes(data)
            del data
            t0 = time.perf_counter()
            HyperParallelReader().read_index(Path(scratch))
            out["read_back_s"] = time.perf_counter() - t0
        out["metadata_peak_mib"] = peak_mib()
    del gp
    if boxes:
        boxes_case(world, n_tensors, layout, out)
        assert out["boxes_stored"] == out["stored_boxes"], "the two paths store different boxes"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1024,4096,16384")
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--layouts", default="fsdp,hsdp,tp")
    parser.add_argument("--no-metadata", action="store_true")
    parser.add_argument("--boxes", action="store_true", help="also the path of ranks that send their boxes")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        world, layout = args.case.split(":")
        print(json.dumps(one_case(int(world), args.tensors, layout, not args.no_metadata, args.boxes)))
        return
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    loads = []
    print("| ranks | layout | boxes held / stored | table: s, a rank sends B, receives MiB | plan from layouts: s, peak MiB "
          "| own plan s (boxes) | commit: files and .metadata from, s (MiB), read back s; peak MiB | boxes path: a rank sends KiB, receives MiB; parse s, MiB; "
          "global plan s, MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for world in map(int, args.ranks.split(",")):
        for layout in args.layouts.split(","):
            cmd = [sys.executable, __file__, "--case", f"{world}:{layout}", "--tensors", str(args.tensors)]
            cmd += ["--no-metadata"] if args.no_metadata else []
            cmd += ["--boxes"] if args.boxes else []
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"| {world} | {layout} | failed: {done.stderr.strip().splitlines()[-1:]} |", flush=True)
                continue
            r = json.loads(done.stdout)
            meta = (f"{r['commit_from']}: {r['metadata_s']:.1f} ({r['metadata_mib']:.0f} MiB), "
                    f"{r['read_back_s']:.1f}; {r['metadata_peak_mib']:.0f}") if "metadata_mib" in r else "-"
            boxes = (f"{r['max_sent_kib']:.0f}, {r['gathered_mib']:.0f}; {r['gather_s']:.2f}, {r['gather_peak_mib']:.0f}; "
                     f"{r['global_s']:.2f}, {r['global_peak_mib']:.0f}") if "global_s" in r else "-"
            print(f"| {world:,} | {layout} | {r['gathered_boxes']:,} / {r['stored_boxes']:,} | "
                  f"{r['table_s']:.3f}, {r['table_sent_b']}, {r['table_received_mib']:.1f} | "
                  f"{r['layouts_s']:.2f}, {r['layouts_peak_mib']:.0f} | {r['own_plan_s']:.3f} ({r['own_boxes']:,}) | "
                  f"{meta} | {boxes} |", flush=True)
            loads.append(r)
    print("\nA live load into the same layouts (who wants which boxes, who reads each shared one):\n")
    print("| ranks | layout | a rank sends B | shared sets, boxes | shared from layouts s | readers s | peak MiB "
          "| boxes path: a rank sends KiB; s, peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in loads:
        listed = f"{r['load_boxes_sent_kib']:.0f}; {r['load_boxes_s']:.2f}, {r['load_boxes_peak_mib']:.0f}" \
            if "load_boxes_s" in r else "-"
        print(f"| {r['ranks']:,} | {r['layout']} | {r['load_sent_b']} | {r['load_sets']:,}, {r['load_shared_boxes']:,} | "
              f"{r['load_shared_s']:.2f} | {r['load_readers_s']:.2f} | {r['load_peak_mib']:.0f} | {listed} |")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
