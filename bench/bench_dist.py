"""Benchmark `hpckpt.dist` (live save and load inside a torch job) against torch.distributed.checkpoint.

    python bench/bench_dist.py                                   # the published run (1.5 GiB, 1 + 5 rounds)
    python bench/bench_dist.py --size-gib 0.05 --rounds 2 --out bench/out/dist-smoke.json   # smoke

Everything in one run, so the ratios compare figures taken minutes apart on the same machine:
1. A snapshot of the working tree's `hpckpt` package (every Python file but tests/ and bench/) is
   copied to WORK/src and put first on PYTHONPATH for every process of the run: other sessions
   edit the tree while it runs; the snapshot's SHA-256 is in the output.
2. Planning at scale in one process (`dist_plan.py`): 64 LocalPlans of 10,000 tensors, their
   JSON round trip, `build_global_plan` (target < 0.5 s).
3. `torchrun --standalone --nproc-per-node 4 dist_job.py save` (gloo, CPU mesh, OMP_NUM_THREADS=1):
   the 1.5 GiB state of `engine_state.py` as Shard(0) DTensors; durable-write bandwidth (python
   write + fsync per rank, in parallel), `hpckpt.dist.save`, `dcp.save`, the staging copy,
   `hpckpt.dist.async_save`, `dcp.async_save`, `--rounds` rounds; then the HSDP 2x2 sources.
4. `torchrun --standalone --nproc-per-node 8 dist_job.py load`: cold-cache loads onto Shard(0) over
   8 ranks from the 4-rank and the HSDP checkpoints, hpckpt and torch each from its own
   checkpoint (and hpckpt from torch's), `--rounds` rounds, checked against the pattern once.
5. One Markdown table on stdout, every raw figure in `--out` (default bench/out/dist.json); WORK
   (default /tmp/hpckpt-bench-dist, about 6.5x the state's size at peak) removed unless `--keep`.

Times are the job's (rank 0's clock between barriers around the call, i.e. the slowest rank);
GB/s = the state's tensor bytes / 1e9 / seconds. "best" is the best round, "median" the median,
of the rounds after `--warmup` (the first round pays first-touch costs: 2-4x slower here).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))


TARGET_DURABLE = 0.8  # hpckpt save GB/s over the durable-write GB/s, at least
TARGET_ASYNC = 0.5  # hpckpt async_save blocked time over torch's, at most
TARGET_GLOBAL_S = 0.5  # build_global_plan, 64 ranks x 10,000 tensors
TARGET_HIT_S = 0.010  # planning of a cached re-save on 4 ranks
SKIP = {".venv", ".git", "tests", "bench", "docs", "__pycache__", "hpckpt.egg-info", "examples", "completions"}


def snapshot(work: Path) -> tuple[Path, str]:
    """Copy the package's Python files to work/src/hpckpt; returns (src dir, sha256 of them)."""
    src = work / "src"
    dest = src / "hpckpt"
    if src.exists():
        shutil.rmtree(src)
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
        rel = Path(dirpath).relative_to(ROOT)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            data = (Path(dirpath) / name).read_bytes()
            h.update(str(rel / name).encode() + b"\0" + data)
            (dest / rel).mkdir(parents=True, exist_ok=True)
            (dest / rel / name).write_bytes(data)
    return src, h.hexdigest()


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()


def env_for(src: Path) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", HPCKPT_NO_CACHE="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(cmd: list[str], env: dict, log: Path) -> None:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for line in proc.stdout:
            f.write(line)
            if not line.startswith(("[rank", "W1", "*****", "Setting OMP", "[W")) and line.strip():
                print("  " + line.rstrip(), flush=True)
        proc.wait()
    if proc.returncode:
        sys.exit(f"error: {cmd[0]} exited {proc.returncode} after {time.perf_counter() - t0:.0f} s; log: {log}")


def torchrun() -> str:
    local = Path(sys.executable).parent / "torchrun"
    return str(local) if local.is_file() else "torchrun"


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --- the table ----------------------------------------------------------------------------------

def stats(values: list[float]) -> tuple[float, float]:
    return min(values), statistics.median(values)


def summarize(plan: dict | None, save: dict | None, load: dict | None, warmup: int = 0) -> dict:
    """The figures of the table; rounds before `warmup` are left out of every statistic."""
    s: dict = {}
    if plan:
        s["plan"] = {"best": plan["best"], "json_bytes": plan["json_bytes"], "boxes_gathered": plan["boxes_gathered"],
                     "boxes_stored": plan["boxes_stored"], "global_ok": plan["best"]["global"] < TARGET_GLOBAL_S}
    if save:
        nbytes = save["tensor_bytes"]
        by = {}
        for row in save["rows"]:
            if row["round"] >= warmup:
                by.setdefault(row["step"], []).append(row)
        sec = {k: stats([r["seconds"] for r in v]) for k, v in by.items()}
        gbs = {k: nbytes / 1e9 / b for k, (b, _m) in sec.items()}
        gbs_med = {k: nbytes / 1e9 / m for k, (_b, m) in sec.items()}
        hits = [r for r in by["hp-save"] if all(p["plan_cache"] == "hit" for p in r["ranks"])]
        hit_planning = [max(p["planning"] for p in r["ranks"]) for r in hits]
        hit_planning_min = [min(p["planning"] for p in r["ranks"]) for r in hits]
        misses = by.get("hp-save-miss", [])
        blocked = {k: stats([r["blocked"] for r in by[k]]) for k in ("hp-async", "dcp-async")}
        s["save"] = {
            "tensor_bytes": nbytes, "seconds": sec, "gbs_best": gbs, "gbs_median": gbs_med,
            "hp_over_dcp_best": gbs["hp-save"] / gbs["dcp-save"], "hp_over_dcp_median": gbs_med["hp-save"] / gbs_med["dcp-save"],
            "hp_over_raw_best": gbs["hp-save"] / gbs["raw"], "hp_over_raw_median": gbs_med["hp-save"] / gbs_med["raw"],
            "dcp_over_raw_best": gbs["dcp-save"] / gbs["raw"],
            "miss_planning_max": [max(p["planning"] for p in r["ranks"]) for r in misses],
            "miss_caches": sorted({p["plan_cache"] for r in misses for p in r["ranks"]}),
            "hit_caches": sorted({p["plan_cache"] for r in by["hp-save"] for p in r["ranks"]}),
            "hit_planning_max": hit_planning, "hit_planning_min": hit_planning_min,
            "hp_writing_max": [max(p["writing"] for p in r["ranks"]) for r in by["hp-save"]],
            "blocked": blocked,
            "async_ratio_best": blocked["hp-async"][0] / blocked["dcp-async"][0],
            "async_ratio_median": blocked["hp-async"][1] / blocked["dcp-async"][1],
            "hsdp": save["hsdp"],
            "probes": {k: stats(v) for k, v in save.get("probes", {}).items() if v},
        }
        s["save"]["durable_ok"] = s["save"]["hp_over_raw_best"] >= TARGET_DURABLE
        s["save"]["async_ok"] = s["save"]["async_ratio_best"] <= TARGET_ASYNC
        s["save"]["hit_ok"] = bool(hit_planning) and min(hit_planning) < TARGET_HIT_S
    if load:
        nbytes = load["tensor_bytes"]
        by, checked = {}, {}
        for row in load["rows"]:
            if "mismatches" in row:
                checked[row["step"]] = row["mismatches"]
            if row["round"] >= warmup:
                by.setdefault(row["step"], []).append(row)
        out = {}
        for k, rows in by.items():
            best, med = stats([r["seconds"] for r in rows])
            item = {"best": best, "median": med, "gbs_best": nbytes / 1e9 / best,
                    "rchar_x": [r["rchar"] / nbytes for r in rows], "read_bytes_x": [r["read_bytes"] / nbytes for r in rows],
                    "mismatches": checked.get(k), "source": rows[0]["source"], "loader": rows[0]["loader"]}
            if rows[0]["loader"] == "hp":
                item["reported_x"] = [r["ranks"][0]["read_amplification"] for r in rows]
                item["job_bytes_read"] = rows[0]["ranks"][0]["job_bytes_read"]
                item["job_bytes_wanted"] = rows[0]["ranks"][0]["job_bytes_wanted"]
                item["bytes_broadcast"] = sum(p["bytes_broadcast"] for p in rows[0]["ranks"])
            out[k] = item
        s["load"] = {"tensor_bytes": nbytes, "sources": load["sources"], "kinds": out}
        for src in ("fsdp", "hsdp"):
            if f"hp-load {src}" in out and f"dcp-load {src}" in out:
                s["load"][f"time_ratio_{src}_best"] = out[f"hp-load {src}"]["best"] / out[f"dcp-load {src}"]["best"]
                s["load"][f"time_ratio_{src}_median"] = out[f"hp-load {src}"]["median"] / out[f"dcp-load {src}"]["median"]
    return s


def table(s: dict, rounds: int) -> str:
    lines = ["| measurement | best | median | figure | against | target |", "|---|---:|---:|---|---|---|"]
    add = lines.append
    if "save" in s:
        v = s["save"]
        sec, g = v["seconds"], v["gbs_best"]
        add(f"| durable write: python `write` + `fsync`, 4 ranks in parallel | {sec['raw'][0]:.3f} s | "
            f"{sec['raw'][1]:.3f} s | {g['raw']:.2f} GB/s | | |")
        add(f"| `torch.distributed.checkpoint.save` (sync_files=True) | {sec['dcp-save'][0]:.3f} s | "
            f"{sec['dcp-save'][1]:.3f} s | {g['dcp-save']:.2f} GB/s | {v['dcp_over_raw_best']:.2f}x durable write | |")
        ok = ("met" if v["durable_ok"] else "**missed**") + " on best, " + \
            ("met" if v["hp_over_raw_median"] >= TARGET_DURABLE else "**missed**") + " on median"
        add(f"| `hpckpt.dist.save` | {sec['hp-save'][0]:.3f} s | {sec['hp-save'][1]:.3f} s | {g['hp-save']:.2f} GB/s | "
            f"{v['hp_over_dcp_best']:.2f}x torch DCP's GB/s (median {v['hp_over_dcp_median']:.2f}x); "
            f"{v['hp_over_raw_best']:.2f}x durable write (median {v['hp_over_raw_median']:.2f}x) | >= {TARGET_DURABLE}x durable: {ok} |")
        if "hp-save-miss" in sec:
            mb, mm = sec["hp-save-miss"]
            add(f"| `hpckpt.dist.save(plan_cache=False)`: full planning (plan cache {'/'.join(v['miss_caches'])}) | "
                f"{mb:.3f} s | {mm:.3f} s | "
                f"{g['hp-save-miss']:.2f} GB/s; planning {statistics.median(v['miss_planning_max']) * 1e3:.1f} ms "
                f"(median, slowest rank) | | |")
        sb, sm = sec["stage"]
        add(f"| staging copy alone (`to_local().clone()` of every shard) | {sb:.3f} s | {sm:.3f} s | | | |")
        pr = v.get("probes", {})
        if "async_describe_staged" in pr:
            add(f"| hpckpt's describe step with the copy (`dist.save_plan._describe(stage=True)`; without: "
                f"{pr['async_describe_unstaged'][0]:.3f} s) | {pr['async_describe_staged'][0]:.3f} s | "
                f"{pr['async_describe_staged'][1]:.3f} s | clone next to it: {pr['async_clone'][0]:.3f} s | | |")
        hb, hm = v["blocked"]["hp-async"]
        tb, tm = v["blocked"]["dcp-async"]
        ok = ("met" if v["async_ok"] else "**missed**") + " on best, " + \
            ("met" if v["async_ratio_median"] <= TARGET_ASYNC else "**missed**") + " on median"
        add(f"| `torch.distributed.checkpoint.async_save` blocked | {tb:.3f} s | {tm:.3f} s | "
            f"durable after {sec['dcp-async'][0]:.3f} s (best) | | |")
        add(f"| `hpckpt.dist.async_save` blocked | {hb:.3f} s | {hm:.3f} s | durable after {sec['hp-async'][0]:.3f} s "
            f"(best) | {v['async_ratio_best']:.2f}x torch's blocked (median {v['async_ratio_median']:.2f}x) | "
            f"<= {TARGET_ASYNC}x: {ok} |")
        hp = v["hit_planning_max"]
        if hp:
            ok = "met" if v["hit_ok"] else "**missed**"
            add(f"| cached re-save planning, 4 ranks (`SaveResult.planning`, slowest rank, {len(hp)} hits) | "
                f"{min(hp) * 1e3:.1f} ms | {statistics.median(hp) * 1e3:.1f} ms | fastest rank "
                f"{min(v['hit_planning_min']) * 1e3:.1f} ms | | < {TARGET_HIT_S * 1e3:.0f} ms: {ok} |")
        if "tiny_hit_planning_max" in pr:
            add(f"| ... the same for a one-tensor state (fixed cost; slowest rank) | "
                f"{pr['tiny_hit_planning_max'][0] * 1e3:.1f} ms | {pr['tiny_hit_planning_max'][1] * 1e3:.1f} ms | | | |")
        if "gather_max_over_ranks" in pr:
            add(f"| ... one `all_gather_object` of a short string, gloo, 4 ranks (slowest rank) | "
                f"{pr['gather_max_over_ranks'][0] * 1e3:.1f} ms | {pr['gather_max_over_ranks'][1] * 1e3:.1f} ms | | | |")
        if "staging_rank0" in pr:
            add(f"| ... the coordinator's staging directory alone (`Staging` open + close) | "
                f"{pr['staging_rank0'][0] * 1e3:.1f} ms | {pr['staging_rank0'][1] * 1e3:.1f} ms | | | |")
    if "load" in s:
        v = s["load"]
        names = {"hp-load fsdp": "`hpckpt.dist.load` 4 -> 8 (own checkpoint)",
                 "dcp-load fsdp": "`torch.distributed.checkpoint.load` 4 -> 8 (own checkpoint)",
                 "hp-load hsdp": "`hpckpt.dist.load` HSDP 2x2 -> 8 (own checkpoint)",
                 "dcp-load hsdp": "`torch.distributed.checkpoint.load` HSDP 2x2 -> 8 (own checkpoint)",
                 "hp-load torch-fsdp": "`hpckpt.dist.load` 4 -> 8 from torch's checkpoint",
                 "hp-load torch-hsdp": "`hpckpt.dist.load` HSDP 2x2 -> 8 from torch's checkpoint"}
        for k, label in names.items():
            if k not in v["kinds"]:
                continue
            it = v["kinds"][k]
            amp = f"read {min(it['rchar_x']):.2f}x the tensor bytes (rchar)"
            if "reported_x" in it:
                amp += f"; LoadResult says {it['reported_x'][0]:.2f}x"
            against = ""
            src = k.split()[-1]
            if k.startswith("hp-load") and src in ("fsdp", "hsdp"):
                against = f"{v[f'time_ratio_{src}_best']:.2f}x torch's time (median {v[f'time_ratio_{src}_median']:.2f}x)"
            bad = it["mismatches"]
            check = "" if bad is None else (", values checked" if not bad else f", **{len(bad)} mismatches**")
            add(f"| {label}, cold | {it['best']:.3f} s | {it['median']:.3f} s | {it['gbs_best']:.2f} GB/s; {amp}{check} | "
                f"{against} | |")
    if "plan" in s:
        b = s["plan"]["best"]
        ok = "met" if s["plan"]["global_ok"] else "**missed**"
        add(f"| planning 64 ranks x 10,000 tensors: 64 x `LocalPlan.build` | {b['build']:.3f} s | | "
            f"{b['build'] / 64 * 1e3:.1f} ms per rank | | |")
        add(f"| ... 64 x `to_json` + `json.dumps` ({s['plan']['json_bytes'] / 1e6:.1f} MB) | {b['to_json']:.3f} s | | "
            f"{b['to_json'] / 64 * 1e3:.1f} ms per rank | | |")
        add(f"| ... 64 x `json.loads` + `from_json` (every rank, after the gather) | {b['from_json']:.3f} s | | | | |")
        add(f"| ... 64 x `digest` | {b['digest']:.3f} s | | {b['digest'] / 64 * 1e3:.1f} ms per rank | | |")
        add(f"| ... `build_global_plan` ({s['plan']['boxes_gathered']:,} boxes -> {s['plan']['boxes_stored']:,} stored) | "
            f"{b['global']:.3f} s | | | | < {TARGET_GLOBAL_S} s: {ok} |")
        add(f"| ... `GlobalPlan.plan([0])` (rank 0's boxes) | {b['rank_plan']:.3f} s | | | | |")
    return "\n".join(lines) + f"\n\n(best / median of {rounds} rounds after the warm-up for the save and load rows)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of the save and load jobs (warm-up included)")
    parser.add_argument("--warmup", type=int, default=1, help="first rounds left out of the statistics")
    parser.add_argument("--plan-repeat", type=int, default=3)
    parser.add_argument("--work", default="/tmp/hpckpt-bench-dist")
    parser.add_argument("--out", default=str(HERE / "out" / "dist.json"))
    parser.add_argument("--only", default="plan,save,load", help="comma list of plan, save, load (load needs save's "
                        "sources in WORK: run save with --keep first)")
    parser.add_argument("--keep", action="store_true", help="leave WORK (the checkpoints) in place")
    parser.add_argument("--from-json", help="print the table of an earlier --out file and exit")
    args = parser.parse_args()
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        print(table(doc["summary"], doc["rounds"] - doc.get("warmup", 0)))
        return
    only = set(args.only.split(","))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    need = 7 * args.size_gib * 2**30
    free = shutil.disk_usage(work).free
    if "save" in only and free < need:
        sys.exit(f"error: {work} has {free / 2**30:.1f} GiB free; the run needs about {need / 2**30:.1f} GiB")
    src, sha = snapshot(work)
    env = env_for(src)
    started = datetime.datetime.now(datetime.timezone.utc)
    meta = {"started": started.isoformat(timespec="seconds"), "loadavg_start": loadavg(), "size_gib": args.size_gib,
            "rounds": args.rounds, "warmup": args.warmup, "work": str(work), "sources_sha256": sha, "git_head": git("rev-parse", "--short", "HEAD"),
            "git_dirty_files": len(git("status", "--short").splitlines()), "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "command": " ".join([Path(sys.executable).name, *sys.argv])}
    try:
        import torch
        meta["torch"] = torch.__version__
    except ImportError:
        pass
    print(f"snapshot {sha[:12]} (HEAD {meta['git_head']} + {meta['git_dirty_files']} changed files), "
          f"load average {meta['loadavg_start']}", flush=True)
    plan = save = load = None
    ok = False
    try:
        if "plan" in only:
            report = work / "plan.json"
            run([sys.executable, str(HERE / "dist_plan.py"), "--repeat", str(args.plan_repeat), "--report", str(report)],
                env, work / "plan.log")
            plan = json.loads(report.read_text())
        def job(kind: str, nproc: int) -> dict:
            report = work / f"{kind}.json"
            t0 = time.perf_counter()
            run([torchrun(), "--standalone", "--nproc-per-node", str(nproc), str(HERE / "dist_job.py"), kind,
                 "--size-gib", str(args.size_gib), "--work", str(work), "--rounds", str(args.rounds),
                 "--report", str(report)], env, work / f"{kind}.log")
            result = json.loads(report.read_text())
            result["job_seconds"] = time.perf_counter() - t0
            return result

        if "save" in only:
            save = job("save", 4)
        if "load" in only:
            load = job("load", 8)
        ok = True
    finally:
        meta["loadavg_end"] = loadavg()
        meta["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        elif not ok:  # the logs stay; the checkpoints go (they are several GiB)
            for name in os.listdir(work):
                if (work / name).is_dir() and name != "src":
                    shutil.rmtree(work / name, ignore_errors=True)
            print(f"(logs kept in {work})", file=sys.stderr)
    summary = summarize(plan, save, load, args.warmup)
    doc = {**meta, "summary": summary, "plan": plan, "save": save, "load": load}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print()
    print(table(summary, args.rounds - args.warmup))
    print(f"\nstarted {meta['started']}, load average {meta['loadavg_start']} at the start, {meta['loadavg_end']} at "
          f"the end; raw figures: {out}")


if __name__ == "__main__":
    main()
