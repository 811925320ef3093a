"""Benchmark MindSpore's own checkpoint tools side by side with hpckpt and `cp`, in one run.

    python bench/bench_mindspore.py                                  # the published table (1 GiB, best of 3)
    python bench/bench_mindspore.py --size-gib 0.05 --repeat 1       # smoke: about a minute, writes no doc

Steps:
1. Build the input once (kept in OUT/ckpt while its `generated.json` matches the size): a state of
   ~40 tensors (fp32, bf16, 1-D vectors, one 0-d; `ms_state.py`) written by MindSpore's own
   `save_checkpoint` (`ms_make.py`) as one .ckpt, one safetensors file, and split over 4 ranks as
   semi-auto parallel saves it (`rank_{r}/checkpoint_{r}.ckpt` and, in another directory, the
   same as `.safetensors`: dim 0 over 4 devices, the 0-d tensor replicated), with hand-written
   strategy files for 4 and for 8 devices (JSON and protobuf forms). Plus the same state as a
   HyperParallel DCP with MindSpore dtype strings, made by
   `hpckpt convert single/model.ckpt -o hp4 --to hp --world-size 4 --framework mindspore`
   (hpckpt does not read MindSpore's per-rank directories + strategy files; see the doc).
   Every input is checked against the pattern with MindSpore's own `load_checkpoint` and with
   hpckpt's reader, and `hpckpt verify` is run on the DCP.
2. Measure each operation as its own process (`bench_engine.measure`: wall time from spawn to exit;
   peak RSS of the process tree by psutil polling every 20 ms, and the largest process's
   `ru_maxrss` from GNU time), `--repeat` runs taken round-robin (best wall, highest RSS), with
   the inputs read once before each run (warm page cache). Each output is checked once (not
   timed) in a child process and deleted after each run.
3. Print a Markdown table and write it, with the command, the machine and the notes, to `--doc`
   (default docs/benchmarks-mindspore.md). Raw numbers go to OUT/results.json; `--doc-only`
   rewrites the doc from them.

Helpers: ms_state.py (the state and the strategy files), ms_make.py (writes the inputs with
MindSpore), ms_tool.py (runs one MindSpore tool), ms_probe.py (small, untimed correctness probes of
MindSpore tools on layouts the main state does not have).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench_engine  # noqa: E402
import ms_state  # noqa: E402
from bench_engine import (MIB, _fmt, check_in_child, child_env, cp_sync, du, files_under,  # noqa: E402
                          fresh_scratch, last_json, load_avg, machine_facts, measure, measured_sources, remove,
                          reuse_inputs, run_verify, venv_bin, warm)

# --- inputs ----------------------------------------------------------------------------------

INPUTS = {
    "ckpt": "single/model.ckpt",
    "st": "single/model.safetensors",
    "ranks-ckpt": "ranks-ckpt",
    "ranks-st": "ranks-st",
    "hp4": "hp4",
    "strategy": "strategy",
}
INPUT_DOC = {
    "ckpt": "the whole state, one MindSpore .ckpt (`save_checkpoint(format=\"ckpt\")`)",
    "st": "the whole state, one MindSpore safetensors file (`save_checkpoint(format=\"safetensors\")`)",
    "ranks-ckpt": "4 ranks, `rank_{r}/checkpoint_{r}.ckpt`, rank r's dim-0 slices (`save_checkpoint` per rank)",
    "ranks-st": "the same 4 ranks as MindSpore safetensors, `rank_{r}/checkpoint_{r}.safetensors`",
    "hp4": "HyperParallel DCP, 4 ranks, MindSpore dtype strings (made by hpckpt from `single/model.ckpt`)",
    "strategy": "hand-written strategy files: `src_4.json`/`dst_8.json` (used) and `src_4.ckpt`/`dst_8.ckpt` (protobuf)",
}


def run_check(kind: str, path: Path, size: float) -> list[str]:
    """Run a check in a fresh process (MindSpore, hpckpt and numpy stay out of this one)."""
    return check_in_child(kind, path, size, script=__file__, cwd=ROOT, tail=600)


def generate(work: Path, size: float, regenerate: bool) -> dict:
    ckpt = work / "ckpt"
    info = reuse_inputs(ckpt, size, regenerate, "inputs")
    if info is not None:
        return info
    print(f"generating {size} GiB with mindspore.save_checkpoint ...", flush=True)
    t0 = time.perf_counter()
    made = subprocess.run([sys.executable, str(HERE / "ms_make.py"), "--size-gib", str(size), "--out", str(ckpt)],
                          check=True, env=child_env(), cwd=str(ROOT), capture_output=True, text=True)
    make_s = time.perf_counter() - t0
    convert = [venv_bin("hpckpt"), "convert", str(ckpt / INPUTS["ckpt"]), "-o", str(ckpt / INPUTS["hp4"]),
               "--to", "hp", "--world-size", "4", "--framework", "mindspore"]
    subprocess.run(convert, check=True, env=child_env(), stdout=subprocess.DEVNULL)
    print(f"  made in {make_s:.1f} s; checking every input with MindSpore's loader and hpckpt's reader ...", flush=True)
    checks = {
        "mindspore_load_single_ckpt": run_check("ms-load", ckpt / INPUTS["ckpt"], size),
        "mindspore_load_single_st": run_check("ms-load", ckpt / INPUTS["st"], size),
        "mindspore_load_ranks_ckpt": run_check("ms-load-ranks", ckpt / INPUTS["ranks-ckpt"], size),
        "mindspore_load_ranks_st": run_check("ms-load-ranks", ckpt / INPUTS["ranks-st"], size),
        "hpckpt_single_ckpt": run_check("whole", ckpt / INPUTS["ckpt"], size),
        "hpckpt_single_st": run_check("whole", ckpt / INPUTS["st"], size),
        "hpckpt_ranks_ckpt": run_check("ranks", ckpt / INPUTS["ranks-ckpt"], size),
        "hpckpt_ranks_st": run_check("ranks", ckpt / INPUTS["ranks-st"], size),
        "hpckpt_hp4": run_check("hp:4", ckpt / INPUTS["hp4"], size),
    }
    verify = run_verify(ckpt / INPUTS["hp4"])
    checks["hpckpt_verify_hp4"] = [] if verify.returncode == 0 else [verify.stdout[-400:] + verify.stderr[-400:]]
    bad = {k: v for k, v in checks.items() if v}
    if bad:
        sys.exit(f"error: generated inputs fail their checks: {json.dumps(bad)[:2000]}")
    info = {
        "size_gib": size,
        "make_s": make_s,
        "save_s": last_json(made.stdout)["save_s"],
        "convert_command": shlex.join(["hpckpt", *[os.path.relpath(a, ROOT) if a.startswith("/") else a
                                                   for a in convert[1:]]]),
        "checks": {k: "ok" for k in checks},
        "bytes": {k: du(ckpt / v) for k, v in INPUTS.items()},
        "files": {k: len(files_under([ckpt / v])) for k, v in INPUTS.items()},
    }
    (ckpt / "generated.json").write_text(json.dumps(info, indent=1))
    return info


# --- checks (never timed; run in a child process) ----------------------------------------------

def _compare(name: str, got, want, got_dtype: str, want_dtype: str) -> str | None:
    import numpy as np

    if got_dtype != want_dtype:
        return f"{name}: dtype {got_dtype}, want {want_dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{name}: shape {list(got.shape)}, want {list(want.shape)}"
    got = got.view(want.dtype) if got.dtype != want.dtype else got
    if not np.array_equal(got, want):
        diff = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        return f"{name}: {diff.size} of {want.size} elements differ (first at flat index {int(diff[0])})"
    return None


def _read_all(path: Path) -> dict:
    """{name: (array, dtype name)} of every tensor of a file or directory hpckpt reads."""
    from hpckpt.converters import open_index
    from hpckpt.core.io.read import OpenFiles, read_box

    index = open_index(path, use_cache=False)
    out = {}
    with OpenFiles() as files:
        for name, entry in index.tensors.items():
            out[name] = (read_box(index, entry, files=files), entry.dtype.name)
    return out


def _check_state(got: dict, size: float, rank: tuple[int, int] | None = None) -> list[str]:
    """Compare {name: (array, dtype name)} with every tensor of the state: whole, or with
    `rank` = (r, world) rank r's dim-0 slice (the 0-d tensor whole). Names not in the state are
    not looked at (see `_unexpected`)."""
    prefix = f"rank {rank[0]} " if rank else ""
    bad = []
    for name, shape, dtype in ms_state.spec(size):
        if name not in got:
            bad.append(f"{prefix}{name}: missing")
            continue
        lo, hi = ms_state.rows_of(*rank, shape[0]) if rank and shape else (None, None)
        problem = _compare(f"{prefix}{name}", got[name][0], ms_state.expected(size, name, lo, hi), got[name][1], dtype)
        if problem:
            bad.append(problem)
    return bad


def _unexpected(got: dict, size: float, prefix: str = "") -> list[str]:
    return [f"{prefix}{n}: unexpected" for n in sorted(set(got) - set(ms_state.names(size)))]


def check_whole(path: Path, size: float) -> list[str]:
    """Every tensor of the state, whole, in one file or in the safetensors files of a directory."""
    got: dict = {}
    # A directory: a checkpoint hpckpt reads as one (a DCP with .metadata), or the part files of
    # unified_safetensors, read one by one.
    files = sorted(path.glob("*.safetensors")) if path.is_dir() and not (path / ".metadata").is_file() else [path]
    for f in files:
        got.update(_read_all(f))
    return _check_state(got, size) + _unexpected(got, size)


def _rank_files(path: Path) -> dict[int, Path]:
    out = {}
    for d in sorted(path.glob("rank_*")):
        files = sorted(p for p in d.iterdir() if p.suffix in (".ckpt", ".safetensors"))
        if len(files) != 1:
            raise SystemExit(f"{d}: {len(files)} checkpoint files")
        out[int(d.name.split("_")[1])] = files[0]
    return out


def check_ranks(path: Path, size: float) -> list[str]:
    """MindSpore per-rank files: rank r holds rows [r*n/W, (r+1)*n/W) of each tensor, the 0-d whole."""
    ranks = _rank_files(path)
    world = len(ranks)
    bad = [] if sorted(ranks) == list(range(world)) else [f"rank directories {sorted(ranks)}"]
    for r, f in ranks.items():
        got = _read_all(f)
        bad += _check_state(got, size, (r, world)) + _unexpected(got, size, f"rank {r} ")
    return bad


def check_hp(path: Path, size: float, world: int) -> list[str]:
    """A HyperParallel DCP: `world` ranks, MindSpore dtype strings, every tensor's values."""
    from hpckpt.converters import open_index

    index = open_index(path, use_cache=False)
    bad = [] if index.format.startswith("hyperparallel") else [f"format {index.format}"]
    if index.framework != "mindspore":
        bad.append(f"framework {index.framework}, want mindspore dtype strings")
    for name, shape, _dtype in ms_state.spec(size):
        entry = index.tensors.get(name)
        if entry is None:
            continue
        spelled = entry.dtype_spelling
        if spelled and spelled != entry.dtype.mindspore:
            bad.append(f"{name}: dtype spelled {spelled!r}, not MindSpore's {entry.dtype.mindspore!r}")
        if shape and len({c.box for c in entry.chunks}) != world:
            bad.append(f"{name}: {len({c.box for c in entry.chunks})} distinct chunks, want {world}")
    return bad + check_whole(path, size)


def _ms_load(path: Path) -> dict:
    import mindspore as ms
    import mindspore.train.serialization as ser

    ser._get_available_memory = lambda: None  # a check, not a measurement: skip the MemFree guard
    fmt = "safetensors" if path.suffix == ".safetensors" else "ckpt"
    params = ms.load_checkpoint(str(path), format=fmt)
    out = {}
    for name, p in params.items():
        a = p.asnumpy()
        dtype = {"Float32": "float32", "BFloat16": "bfloat16"}.get(str(p.dtype), str(p.dtype))
        out[name] = (a.view("<u2") if dtype == "bfloat16" else a, dtype)
    return out


def check_ms_load(path: Path, size: float) -> list[str]:
    """Read a whole-state file with MindSpore's own `load_checkpoint`."""
    got = _ms_load(path)
    return _check_state(got, size) + _unexpected(got, size)


def check_ms_load_ranks(path: Path, size: float) -> list[str]:
    """MindSpore per-rank files read with MindSpore's own `load_checkpoint`, rank by rank."""
    ranks = _rank_files(path)
    return [p for r, f in ranks.items() for p in _check_state(_ms_load(f), size, (r, len(ranks)))]


def run_check_here(kind: str, path: Path, size: float) -> list[str]:
    if kind.startswith("hp:"):
        return check_hp(path, size, int(kind.split(":")[1]))
    return {"whole": check_whole, "ranks": check_ranks, "ms-load": check_ms_load,
            "ms-load-ranks": check_ms_load_ranks}[kind](path, size)


# --- operations ------------------------------------------------------------------------------

@dataclass
class Op:
    key: str
    tool: str
    operation: str
    group: str
    inputs: list[str]  # INPUTS keys read (warmed before each run)
    command: Callable[[Path, Path], list[str]]  # (input directory, output path) -> argv
    output: str | None  # name of the output under the scratch directory
    checks: list[tuple[str, str]] = field(default_factory=list)  # (kind, path under the output, "" = itself)


GROUPS = [
    ("c2s", "one .ckpt -> one safetensors file", "ms-c2s"),
    ("s2c", "one safetensors file -> one .ckpt", "ms-s2c"),
    ("unify", "4 ranks -> one whole safetensors file", "ms-unified"),
    ("reshard", "4 ranks -> 8 ranks", "ms-transform"),
    ("load", "read a whole .ckpt (context)", "ms-load"),
]


def operations() -> list[Op]:
    hp = venv_bin("hpckpt")
    tool = str(HERE / "ms_tool.py")
    ms = lambda *a: [sys.executable, tool, *map(str, a)]  # noqa: E731

    def i(key: str, c: Path) -> Path:
        return c / INPUTS[key]

    ops = [
        # one .ckpt -> one safetensors
        Op("ms-c2s", "MindSpore", "`ckpt_to_safetensors(model.ckpt, save_path=OUT)`", "c2s", ["ckpt"],
           lambda c, o: ms("ckpt-to-st", i("ckpt", c), o), "c2s-out", [("whole", "model.safetensors")]),
        Op("hp-c2s", "hpckpt", "`convert model.ckpt -o x.safetensors`", "c2s", ["ckpt"],
           lambda c, o: [hp, "convert", str(i("ckpt", c)), "-o", str(o)], "x.safetensors",
           [("whole", ""), ("ms-load", "")]),
        Op("hp-c2s-nf", "hpckpt", "`convert model.ckpt -o x.safetensors --no-fsync`", "c2s", ["ckpt"],
           lambda c, o: [hp, "convert", str(i("ckpt", c)), "-o", str(o), "--no-fsync"], "x.safetensors"),
        Op("cp-ckpt", "cp", "`cp model.ckpt` (same bytes)", "c2s", ["ckpt"],
           lambda c, o: ["cp", str(i("ckpt", c)), str(o)], "cp-out"),
        Op("cp-sync-ckpt", "cp", "`cp model.ckpt` + sync", "c2s", ["ckpt"],
           lambda c, o: cp_sync(i("ckpt", c), o), "cp-out"),
        # one safetensors -> one .ckpt
        Op("ms-s2c", "MindSpore", "`safetensors_to_ckpt(model.safetensors, save_path=OUT)`", "s2c", ["st"],
           lambda c, o: ms("st-to-ckpt", i("st", c), o), "s2c-out", [("whole", "model.ckpt")]),
        Op("hp-s2c", "hpckpt", "`convert model.safetensors -o x.ckpt --to ms`", "s2c", ["st"],
           lambda c, o: [hp, "convert", str(i("st", c)), "-o", str(o), "--to", "ms"], "x.ckpt",
           [("whole", ""), ("ms-load", "")]),
        Op("hp-s2c-nf", "hpckpt", "`convert model.safetensors -o x.ckpt --to ms --no-fsync`", "s2c", ["st"],
           lambda c, o: [hp, "convert", str(i("st", c)), "-o", str(o), "--to", "ms", "--no-fsync"], "x.ckpt"),
        Op("cp-st", "cp", "`cp model.safetensors` (same bytes)", "s2c", ["st"],
           lambda c, o: ["cp", str(i("st", c)), str(o)], "cp-out"),
        Op("cp-sync-st", "cp", "`cp model.safetensors` + sync", "s2c", ["st"],
           lambda c, o: cp_sync(i("st", c), o), "cp-out"),
        # 4 ranks -> one whole safetensors file
        Op("ms-unified", "MindSpore", "`unified_safetensors(ranks-st, src_4.json, OUT)` (4 rank safetensors)",
           "unify", ["ranks-st", "strategy"],
           lambda c, o: ms("unified", i("ranks-st", c), c / "strategy" / "src_4.json", o), "unified-out",
           [("whole", "")]),
        Op("hp-cons", "hpckpt", "`consolidate hp4 -o x.safetensors` (4-rank HyperParallel DCP)", "unify", ["hp4"],
           lambda c, o: [hp, "consolidate", str(i("hp4", c)), "-o", str(o)], "x.safetensors",
           [("whole", ""), ("ms-load", "")]),
        Op("hp-cons-nf", "hpckpt", "`consolidate hp4 -o x.safetensors --no-fsync`", "unify", ["hp4"],
           lambda c, o: [hp, "consolidate", str(i("hp4", c)), "-o", str(o), "--no-fsync"], "x.safetensors"),
        Op("cp-ranks-st", "cp", "`cp -r ranks-st` (same bytes)", "unify", ["ranks-st"],
           lambda c, o: ["cp", "-r", str(i("ranks-st", c)), str(o)], "cp-out"),
        Op("cp-sync-ranks-st", "cp", "`cp -r ranks-st` + sync", "unify", ["ranks-st"],
           lambda c, o: cp_sync(i("ranks-st", c), o), "cp-out"),
        # 4 ranks -> 8 ranks
        Op("ms-transform", "MindSpore", "`transform_checkpoints(ranks-ckpt, OUT, \"checkpoint_\", src_4.json, dst_8.json)` "
           "(.ckpt -> .ckpt)", "reshard", ["ranks-ckpt", "strategy"],
           lambda c, o: ms("transform", i("ranks-ckpt", c), c / "strategy" / "src_4.json",
                           c / "strategy" / "dst_8.json", o), "transform-out", [("ranks", "")]),
        Op("ms-transform-st", "MindSpore", "`transform_checkpoints(ranks-st, ..., output_format=\"safetensors\")` "
           "(.safetensors -> .safetensors)", "reshard", ["ranks-st", "strategy"],
           lambda c, o: ms("transform", i("ranks-st", c), c / "strategy" / "src_4.json",
                           c / "strategy" / "dst_8.json", o, "--format", "safetensors"), "transform-st-out",
           [("ranks", "")]),
        Op("hp-reshard", "hpckpt", "`reshard hp4 -o OUT --world-size 8` (HyperParallel DCP -> HyperParallel DCP)",
           "reshard", ["hp4"], lambda c, o: [hp, "reshard", str(i("hp4", c)), "-o", str(o), "--world-size", "8"],
           "reshard-out", [("hp:8", "")]),
        Op("hp-reshard-nf", "hpckpt", "`reshard hp4 -o OUT --world-size 8 --no-fsync`", "reshard", ["hp4"],
           lambda c, o: [hp, "reshard", str(i("hp4", c)), "-o", str(o), "--world-size", "8", "--no-fsync"],
           "reshard-out"),
        Op("cp-ranks-ckpt", "cp", "`cp -r ranks-ckpt` (same bytes)", "reshard", ["ranks-ckpt"],
           lambda c, o: ["cp", "-r", str(i("ranks-ckpt", c)), str(o)], "cp-out"),
        Op("cp-sync-ranks-ckpt", "cp", "`cp -r ranks-ckpt` + sync", "reshard", ["ranks-ckpt"],
           lambda c, o: cp_sync(i("ranks-ckpt", c), o), "cp-out"),
        # reading a whole .ckpt (context)
        Op("ms-load", "MindSpore", "`load_checkpoint(model.ckpt)` (whole file into Parameters; no output)", "load",
           ["ckpt"], lambda c, o: ms("load", i("ckpt", c)), None, []),
        Op("ms-import", "MindSpore", "`python -c \"import mindspore\"` (start-up alone)", "load", [],
           lambda c, o: [sys.executable, "-c", "import mindspore"], None),
        Op("hp-pt", "hpckpt", "`convert model.ckpt -o x.pt` (whole file read, torch.save written)", "load", ["ckpt"],
           lambda c, o: [hp, "convert", str(i("ckpt", c)), "-o", str(o)], "x.pt", [("whole", "")]),
        Op("hp-pt-nf", "hpckpt", "`convert model.ckpt -o x.pt --no-fsync`", "load", ["ckpt"],
           lambda c, o: [hp, "convert", str(i("ckpt", c)), "-o", str(o), "--no-fsync"], "x.pt"),
        Op("hp-inspect", "hpckpt", "`inspect model.ckpt --json` (index only, no data read)", "load", ["ckpt"],
           lambda c, o: [hp, "inspect", str(i("ckpt", c)), "--json"], None),
    ]
    return ops


@dataclass
class Result:
    key: str
    walls: list[float] = field(default_factory=list)
    tree_peaks: list[int] = field(default_factory=list)
    single_peaks: list[int] = field(default_factory=list)
    inner: list[dict] = field(default_factory=list)
    check: list[str] | None = None
    failed: str | None = None


def run_all(ops: list[Op], work: Path, size: float, repeat: int, verify: bool) -> list[Result]:
    scratch, logs, ckpt = fresh_scratch(work)
    results = {op.key: Result(op.key) for op in ops}
    for rep in range(repeat):
        for op in ops:
            res = results[op.key]
            if res.failed:
                continue
            out = scratch / (op.output or "none")
            remove(out)
            warm([ckpt / INPUTS[k] for k in op.inputs])
            log = logs / f"{op.key}-{rep}.err"
            sample = measure(op.command(ckpt, out), log)
            if sample.returncode != 0:
                res.failed = f"exit {sample.returncode}: {log.read_text(errors='replace')[-1500:]}"
                print(f"  {op.key} FAILED ({res.failed[:300]})", flush=True)
                remove(out)
                continue
            res.walls.append(sample.wall)
            res.tree_peaks.append(sample.tree_peak)
            res.single_peaks.append(sample.single_peak)
            inner = {}
            for line in sample.stdout.splitlines()[::-1]:
                if line.startswith('{"import_s"'):
                    inner = json.loads(line)
                    break
            res.inner.append(inner)
            if verify and res.check is None and op.checks:
                res.check = []
                for kind, sub in op.checks:
                    res.check += [f"[{kind}] {p}" for p in run_check(kind, out / sub if sub else out, size)]
            extra = f" (in the call {inner['tool_s']:.2f} s, import {inner['import_s']:.2f} s" + (
                ", MemFree guard patched" if inner.get("memfree_patched") else "") + ")" if inner else ""
            print(f"  {op.key:18} run {rep + 1}/{repeat}: {sample.wall:7.2f} s, tree peak {sample.tree_peak / MIB:6.0f} MiB"
                  f"{extra}" + (f"; check: {'ok' if not res.check else res.check[:3]}"
                                if res.check is not None and rep == 0 and op.checks else ""), flush=True)
            remove(out)
    remove(scratch)
    return list(results.values())


# --- report ----------------------------------------------------------------------------------

NO_BYTES = {"ms-import", "hp-inspect"}  # rows that move no tensor data: no GB/s, no ratio


def build_rows(results: list[dict], ops: dict[str, dict], nbytes: int) -> list[dict]:
    by = {r["key"]: r for r in results}
    refs = {g: ref for g, _t, ref in GROUPS}
    rows = []
    for r in results:
        op = ops[r["key"]]
        best = min(r["walls"]) if r["walls"] else None
        ref = by.get(refs[op["group"]])
        ref_wall = min(ref["walls"]) if ref and ref["walls"] else None
        ref_rss = max(ref["tree_peaks"]) if ref and ref["tree_peaks"] else None
        tree = max(r["tree_peaks"]) if r["tree_peaks"] else None
        inner = [i for i in r["inner"] if i]
        rows.append({
            "key": r["key"], "group": op["group"], "tool": op["tool"], "operation": op["operation"],
            "wall": best, "gbps": nbytes / best / 1e9 if best and r["key"] not in NO_BYTES else None,
            "tree_mib": tree / MIB if tree else None,
            "single_mib": max(r["single_peaks"]) / MIB if r["single_peaks"] else None,
            "x_ms": ref_wall / best if ref_wall and best and r["key"] not in NO_BYTES else None,
            "rss_x_ms": tree / ref_rss if tree and ref_rss and r["key"] not in NO_BYTES else None,
            "is_ref": r["key"] == refs[op["group"]],
            "tool_s": min(i["tool_s"] for i in inner) if inner else None,
            "import_s": min(i["import_s"] for i in inner) if inner else None,
            "memfree_patched": any(i.get("memfree_patched") for i in inner),
            "failed": r["failed"], "check": r["check"], "runs": len(r["walls"]),
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    head = ("| tool | operation | wall s (best) | GB/s | peak RSS MiB (tree) | vs the MindSpore tool: wall "
            "| vs the MindSpore tool: RSS | output check |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---|"]
    titles = {g: t for g, t, _r in GROUPS}
    group = None
    for row in rows:
        if row["group"] != group:
            group = row["group"]
            lines.append(f"| **{titles[group]}** | | | | | | | |")
        if row["failed"]:
            lines.append(f"| {row['tool']} | {row['operation']} | failed | | | | | |")
            continue
        wall = _fmt(row["wall"])
        if row["tool_s"] is not None:
            wall += f" (call {row['tool_s']:.2f})"
        if row["is_ref"]:
            ratio, rss = "1 (reference)", "1"
        elif row["x_ms"] is None:
            ratio = rss = ""
        else:
            ratio = f"{row['x_ms']:.2f}x " + ("faster" if row["x_ms"] >= 1 else "(slower)")
            rss = f"{row['rss_x_ms']:.2f}x" if row["rss_x_ms"] else ""
        check = "" if row["check"] is None else ("ok" if not row["check"] else f"**WRONG** ({len(row['check'])} problems)")
        lines.append(f"| {row['tool']} | {row['operation']}{' ¹' if row['memfree_patched'] else ''} | {wall} | "
                     f"{_fmt(row['gbps'])} | {_fmt(row['tree_mib'], '.0f')} | {ratio} | {rss} | {check} |")
    return "\n".join(lines)


def _versions() -> str:
    out = []
    for dist in ("mindspore", "numpy", "safetensors", "torch", "psutil"):
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def render_doc(data: dict) -> str:
    m = data["machine"]
    g = data["generated"]
    env = m.get("hpckpt_env", {})
    rows = data["rows"]
    by = {r["key"]: r for r in rows}
    py_version = str(env.get("python") or env.get("Python") or "").split(" ")[0]
    inputs = "\n".join(f"| `{k}` | {INPUT_DOC[k]} | {g['files'][k]} | {g['bytes'][k]:,} |" for k in INPUTS)
    wrong = [r for r in rows if r["check"]]
    failed = [r for r in rows if r["failed"]]
    wrong_text = "\n".join(f"- **{r['tool']} {r['operation']}**: " + "; ".join(r["check"][:8])
                           + (f" (and {len(r['check']) - 8} more)" if len(r["check"]) > 8 else "") for r in wrong)
    failed_text = "\n".join(f"- **{r['tool']} {r['operation']}** failed: `{r['failed'][-600:]}`" for r in failed)
    probe = data.get("probe") or {}
    probe_text = "\n".join(f"- {p['what']}: **{p['result']}**" + (f" ({p['detail']})" if p.get("detail") else "")
                           for p in probe.get("probes", []))
    patched = [r for r in rows if r["memfree_patched"]]
    ms_r = [r["tree_mib"] for r in rows if r["tool"] == "MindSpore" and r["tree_mib"] and r["key"] != "ms-import"]
    hp_r = [r["tree_mib"] for r in rows if r["tool"] == "hpckpt" and r["tree_mib"]]
    ms_rss = f"{min(ms_r):.0f} to {max(ms_r):.0f}" if ms_r else "n/a"
    ms_rss_x = (f"{min(ms_r) * MIB / data['tensor_bytes']:.1f}x to {max(ms_r) * MIB / data['tensor_bytes']:.1f}x"
                if ms_r else "n/a")
    hp_rss = f"{min(hp_r):.0f} to {max(hp_r):.0f}" if hp_r else "n/a"
    if m.get("snapshot"):
        source_line = (f"hpckpt at commit {m['git']} (sources `{m['sources']}`; every hpckpt process, commands and "
                       "checks, imported a `git archive` snapshot of that commit, so commits landing during the run "
                       "did not mix in)")
    else:
        source_line = (f"hpckpt from the working tree at commit {m['git']}"
                       f"{' plus uncommitted changes' if m.get('git_dirty') else ''}, sources `{m['sources']}`"
                       f" ({'unchanged' if data.get('sources_after') == m['sources'] else 'CHANGED'} at the end of the run)")
    ms_rows = [r for r in rows if r["tool"] == "MindSpore" and r["tool_s"] is not None and r["wall"]]
    imp = by.get("ms-import", {}).get("wall")
    start_share = (f"{min(imp / r['wall'] for r in ms_rows):.0%} to {max(imp / r['wall'] for r in ms_rows):.0%}"
                   if imp and ms_rows else "n/a")
    results = {p["what"]: p for p in probe.get("probes", [])}
    st_wrong = any("safetensors -> safetensors" in w and p["result"] == "WRONG" for w, p in results.items())
    diag_ok = any("C-contiguous" in w and p["result"] == "correct" for w, p in results.items())
    probe_explain = ""
    if st_wrong and diag_ok:
        probe_explain = (
            "\nThe safetensors path of `transform_checkpoints` hands `safetensors.numpy.save_file` (through "
            "`_save_file_atomically`) a column slice of the redistributed tensor, a non-contiguous numpy view; "
            "safetensors 0.8.0 writes such a view without its strides, so every rank's dim-1 shard holds the wrong "
            "elements and the file still loads without an error. Handing it C-contiguous copies (the diagnosis "
            "probe) makes the same call correct. A dim-0 split, the measured state, gives contiguous row slices, "
            "which is why the measured safetensors transform is right. The .ckpt path is right for both.\n")
    hp_bad = [r for r in rows if r["tool"] == "hpckpt" and (r["failed"] or r["check"])]
    hp_problems = "\n".join(f"- `{r['operation']}`: " + (r["failed"] or "; ".join(r["check"][:8])) for r in hp_bad)
    if not hp_bad:
        hp_problems = ("No failure and no wrong output: every hpckpt command exited 0 and every checked output "
                       "equals the source (hpckpt's .ckpt and safetensors outputs also load in MindSpore's "
                       "`load_checkpoint` with the right values and dtypes).")
    hp_problems += ("\n\nLimitation met: hpckpt reads no MindSpore per-rank directory with a strategy file "
                    "(`hpckpt inspect ranks-ckpt`: \"this directory is not a checkpoint hpckpt recognises\"), "
                    "so its 4-rank rows read the HyperParallel DCP of the same state.")
    footnote = ("\n¹ `load_checkpoint`'s MemFree guard was patched in the measured process (see below).\n"
                if patched else "")

    def wall(key: str) -> str:
        r = by.get(key)
        return _fmt(r["wall"]) if r and r["wall"] else "n/a"

    def x(key: str, ref: str) -> str:
        a, b = by.get(key), by.get(ref)
        if not a or not b or not a["wall"] or not b["wall"]:
            return "n/a"
        return f"{b['wall'] / a['wall']:.1f}x"

    text = f"""# Benchmarks: MindSpore's checkpoint tools and hpckpt

MindSpore's own checkpoint tools (`ckpt_to_safetensors`, `safetensors_to_ckpt`, `unified_safetensors`,
`transform_checkpoints`, `load_checkpoint`) side by side with hpckpt and `cp`, on the same
{data['size_gib']:g} GiB checkpoint split over 4 ranks, in one run. Produced by

<!-- not run: a benchmark: minutes of run time and gigabytes of scratch data -->
```bash
{data['command']}
```

on {data['date']}, {source_line}.
Machine: {m['nproc']} cores ({m['cpu']}), no GPU, Linux {m['kernel']}, {m['filesystem']} on one virtual disk;
Python {py_version or sys.version.split()[0]}, {data['versions']}; {m['cp']}. Load average {data['load_before']} before and
{data['load_after']} after the run. Other sessions share the 2 cores: timings are noisy (best of
{data['repeat']} runs, taken round-robin so a burst of load does not hit all the runs of one row).

```text
$ free -g
{m['free_g']}
```

## The checkpoint

{data['tensor_bytes']:,} bytes of tensors (the numerator of every GB/s below): {len(ms_state.spec(data['size_gib']))}
tensors, 36 2-D weights (float32 and bfloat16, 1024 to 4096 columns, every row count a multiple of 8),
3 float32 1-D vectors and one 0-d float32 (`global_step`), every value a function of its global
position (`bench/ms_state.py`). Written with MindSpore's own `save_checkpoint` by `bench/ms_make.py`
({g['make_s']:.1f} s for all of it), every value wrapped in a `Parameter` (a `dict` of plain Tensors is
silently mangled by `save_checkpoint`). The sharded form is what MindSpore's semi-auto parallel saves:
rank r's file holds rank r's dim-0 slice of every tensor under the tensor's full name, the 0-d tensor
whole on every rank.

| input | what | files | bytes |
|---|---|---:|---:|
{inputs}

The HyperParallel DCP is made by `{g['convert_command']}` (HyperParallel itself is not installed here).

Checked before measuring: every tensor of every input (the single files, and every rank's slices)
read back with MindSpore's own `load_checkpoint` and with hpckpt's reader equals the pattern,
bit for bit, with the right dtype; `hpckpt verify` passes on the DCP.

### Strategy files

MindSpore cannot write a strategy file on a CPU-only machine (semi-auto parallel refuses the CPU
backend), so both are hand-written by `bench/ms_state.py`: one layout per parameter,
`dev_matrix [4]` (or `[8]`), `tensor_map [0, -1]` for a 2-D tensor (dim 0 split over device-matrix
axis 0, counted from the right; `-1` not split), `[0]` for a 1-D one and `[]` for the 0-d one, plus
`param_split_shape: []` (present but empty), `indices_offset: []`, `field: 0`,
`opt_weight_shard_step: 0`, `opt_weight_shard_size: 0`.

MindSpore 2.10 reads **both** forms and picks by file name alone
(`mindspore/parallel/_parallel_serialization.py`, `_build_searched_strategy`): a name ending in
`.json` is parsed as JSON `{{"parallel_layout_item": {{name: {{...}}}}}}` (`_build_json_strategy`; it
assigns `field`, `opt_weight_shard_step` and `opt_weight_shard_size` straight into the protobuf
message, so they must be present: a missing one raises `TypeError: Cannot set
mindspore.straspb.ParallelLayouts.field to None`; `param_split_shape` may be left out there), any other name as a protobuf
`ParallelStrategyMap` (`node_strategy.proto`: `parallel_layout_item {{ param_name, parallel_layouts {{
dev_matrix, tensor_map, param_split_shape, indices_offset, field, opt_weight_shard_step,
opt_weight_shard_size }} }}`, where the protobuf form needs one `param_split_shape` entry even if
empty, since `_convert_to_list` reads `param_split_shape[0]`). `unified_safetensors`'s docstring says
"with the file extension `.ckpt`", but it goes through the same function and reads JSON too. The run
uses the JSON files; `ms_make.py` also writes the protobuf form and checks that MindSpore builds the
same layouts from both. `parallel_strategy_item` (operator strategies) is not needed by these calls
with one pipeline stage (pipeline-stage paths such as `_extract_src_dst_layout_map_by_src` and
`merge_pipeline_strategys` read its `stage`); one dummy item with `stage: 0` is written.

## Results

Each row is its own process, timed from spawn to exit (Python start-up and imports included: a
MindSpore tool pays `import mindspore`, {wall('ms-import')} s here, see its row), with the inputs in the page cache
(read once before every run). Peak RSS: the highest sum of RSS over the process tree, polled every
20 ms. "(call x)" is the time spent inside the MindSpore function (best of the runs), measured by
`bench/ms_tool.py`; the rest is start-up, `import mindspore` and exit.
"vs the MindSpore tool" divides the MindSpore tool's best wall time by the row's (above 1: faster than
MindSpore) and the row's peak RSS by the MindSpore tool's. hpckpt fsyncs its outputs by default;
MindSpore's `save_checkpoint` and `cp` do not, so the `--no-fsync` rows and plain `cp` are the like-for-like
comparisons, the default rows and `cp + sync` the durable ones. Every output was checked once (not
timed): every tensor read back (hpckpt's reader; for hpckpt's .ckpt and safetensors outputs also MindSpore's
`load_checkpoint`)
and compared with the pattern, dtype, shape and every element.

{markdown_table(rows)}
{footnote}
### What each MindSpore tool needed

- `ckpt_to_safetensors(file, save_path=DIR)` and `safetensors_to_ckpt(file, save_path=DIR)`: one file
  in, a file of the same base name in `DIR` (`save_path` must be a directory: a name with an extension
  is refused). Both load the whole file into Parameters (`_load_file_and_convert_name`), then
  `save_checkpoint` it in the other format. `processes_num` only matters for a directory of rank
  subdirectories. The .ckpt side goes through `load_checkpoint`'s MemFree guard.
- `unified_safetensors(src_dir, src_strategy_file, dst_dir)`: the rank files as
  `src_dir/rank_{{r}}/*.safetensors` (a directory holding .ckpt files as well is refused), and the source
  strategy file. It writes `part{{i}}.safetensors` files of about 3 GiB each (here one, `part0`) and a
  `param_name_map.json`; a parameter missing from the strategy would go to `hyper_param.safetensors`,
  so the 0-d tensor has a layout too. It runs up to one process per part (`max_process_num` 64; here
  one part, so in-process) and, after each part, sleeps
  while the machine's memory use is above 50% (`psutil.virtual_memory().percent > 50`). Only
  safetensors input: there is no .ckpt counterpart.
- `transform_checkpoints(src_dir, dst_dir, prefix, src_strategy_file, dst_strategy_file)`: rank files as
  `src_dir/rank_{{r}}/*.ckpt` (or all `.safetensors`), both strategy files; writes
  `dst_dir/rank_{{r}}/{{prefix}}{{r}}.ckpt`. From .ckpt it `load_checkpoint`s the needed source ranks,
  converts bfloat16 Parameters to float32 numpy arrays, deep-copies the set for every target rank,
  slices with its tensor-redistribution operators and `save_checkpoint`s (casting back to bfloat16).
  From safetensors it reads with `safetensors` (numpy) and writes with `safetensors.numpy.save_file`.
- `load_checkpoint(file)`: nothing else; from .ckpt it reads the whole protobuf message into memory
  and builds a Parameter per tensor (the peak RSS shows it).

MemFree: `load_checkpoint` on a .ckpt refuses a file larger than `_get_available_memory()`, which is
`SC_AVPHYS_PAGES`, i.e. MemFree, which excludes the page cache that a warm-cache benchmark fills.
`bench/ms_tool.py` replaces that function with one returning MemAvailable when MemFree is below the
largest .ckpt it will read plus 256 MiB (never otherwise), and reports it.
{'In this run it was patched for: ' + ', '.join(r['key'] for r in patched) + '.' if patched else 'In this run MemFree was large enough every time: nothing was patched.'}

### How the pairs match

- **.ckpt <-> safetensors**: the same file in, the same kind of file out: a fair pair.
- **4 ranks -> one file**: hpckpt does not read MindSpore's `rank_{{r}}/` directories with a strategy
  file, so it consolidates the HyperParallel DCP of the same state (same 4-rank dim-0 layout, same
  bytes, safetensors data files) while `unified_safetensors` reads the 4 MindSpore safetensors files.
  Both read about {data['size_gib']:g} GiB of shards and write one {data['size_gib']:g} GiB safetensors file.
- **4 -> 8 ranks**: `transform_checkpoints` reads the MindSpore per-rank files and writes MindSpore
  per-rank files (.ckpt, or safetensors with `output_format="safetensors"`); `hpckpt reshard` reads
  the HyperParallel DCP and writes a HyperParallel DCP (safetensors data files + `.metadata`, MindSpore
  dtype strings). Same data moved, different containers.
- **load**: `load_checkpoint` leaves the state in memory and writes nothing; the hpckpt rows are given
  as context only (`convert -o x.pt` reads every byte of the .ckpt and writes it; `inspect` reads only
  the index).

### Wrong outputs observed

{wrong_text or 'None in the measured operations: every checked output equals the source, bit for bit, with its dtype.'}
{chr(10) + failed_text + chr(10) if failed_text else ''}
Untimed probes on small layouts the main state does not have (`bench/ms_probe.py`):

{probe_text or '(not run)'}
{probe_explain}
### Problems found in hpckpt

{hp_problems}

### Reading the numbers

- Every MindSpore tool pays `import mindspore` ({wall('ms-import')} s and {_fmt(by.get('ms-import', {}).get('tree_mib'), '.0f')} MiB here) before
  it touches a byte; an hpckpt command that reads only the index (`inspect`) takes {wall('hp-inspect')} s. At
  this size that start-up is {start_share} of the MindSpore rows' wall time.
- Memory: the MindSpore rows peak at {ms_rss} MiB ({ms_rss_x} the checkpoint's bytes; `import mindspore`
  alone is {_fmt(by.get('ms-import', {}).get('tree_mib'), '.0f')} MiB): each holds whole tensors, often the whole state, in memory, and
  `transform_checkpoints` from .ckpt also widens bfloat16 to float32 and deep-copies the loaded set per
  target rank. The hpckpt rows stay at {hp_rss} MiB (copy buffers bounded by `--max-memory`,
  64 MiB by default).
- .ckpt -> safetensors: `ckpt_to_safetensors` {wall('ms-c2s')} s, `hpckpt convert` {wall('hp-c2s')} s
  ({x('hp-c2s', 'ms-c2s')} faster; {x('hp-c2s-nf', 'ms-c2s')} with `--no-fsync`), `cp` of the file {wall('cp-ckpt')} s.
- safetensors -> .ckpt: `safetensors_to_ckpt` {wall('ms-s2c')} s, hpckpt {wall('hp-s2c')} s
  ({x('hp-s2c', 'ms-s2c')}; {x('hp-s2c-nf', 'ms-s2c')} with `--no-fsync`).
- 4 ranks -> one file: `unified_safetensors` {wall('ms-unified')} s, `hpckpt consolidate` {wall('hp-cons')} s
  ({x('hp-cons', 'ms-unified')}; {x('hp-cons-nf', 'ms-unified')} with `--no-fsync`).
- 4 -> 8 ranks: `transform_checkpoints` {wall('ms-transform')} s from .ckpt and {wall('ms-transform-st')} s
  from safetensors, `hpckpt reshard` {wall('hp-reshard')} s ({x('hp-reshard', 'ms-transform')} vs the .ckpt
  path, {x('hp-reshard', 'ms-transform-st')} vs the safetensors path; with `--no-fsync`
  {x('hp-reshard-nf', 'ms-transform')} and {x('hp-reshard-nf', 'ms-transform-st')}).
"""
    if data.get("notes"):
        text += "\n" + data["notes"].strip() + "\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None,
                        help="work directory (default: bench/out/mindspore, or bench/out/mindspore-SIZEgib "
                             "for another --size-gib)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated operation keys (debugging); the groups' "
                                                   "MindSpore rows are kept for the ratios")
    parser.add_argument("--no-verify", action="store_true", help="do not check the outputs")
    parser.add_argument("--no-probe", action="store_true", help="skip the untimed MindSpore correctness probes")
    parser.add_argument("--regenerate", action="store_true")
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--working-tree", action="store_true",
                        help="measure the working tree as installed, not a snapshot of HEAD")
    parser.add_argument("--doc", type=Path, default=None,
                        help="where to write the doc (default: docs/benchmarks-mindspore.md, and only for "
                             "a run of at least 1 GiB and 3 repeats: a smoke run never replaces it)")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--doc-only", action="store_true", help="rewrite the doc from OUT/results.json")
    parser.add_argument("--check", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        print(json.dumps(run_check_here(args.check[0], Path(args.check[1]), args.size_gib)))
        return 0

    if args.out is None:
        args.out = HERE / "out" / ("mindspore" if args.size_gib == 1.0 else f"mindspore-{args.size_gib:g}gib")
    if args.doc is None and (args.doc_only or (args.size_gib >= 1.0 and args.repeat >= 3)):
        args.doc = ROOT / "docs" / "benchmarks-mindspore.md"
    work = args.out.resolve()
    results_path = work / "results.json"
    if args.doc_only:
        args.doc.write_text(render_doc(json.loads(results_path.read_text())))
        print(f"wrote {args.doc}")
        return 0

    argv_shown = ["python", "bench/bench_mindspore.py"] + (sys.argv[1:] if argv is None else argv)
    load_before = load_avg()
    work.mkdir(parents=True, exist_ok=True)
    if not args.working_tree:
        # Other sessions commit while a run lasts: every hpckpt process (commands and checks) imports
        # a `git archive` snapshot of HEAD (bench_engine's mechanism), so one run measures one commit.
        bench_engine.use_snapshot(work)
    facts = machine_facts()
    info = generate(work, args.size_gib, args.regenerate)
    if args.generate_only:
        print(json.dumps(info["checks"]))
        return 0
    ops = operations()
    if args.only:
        wanted = set(args.only.split(","))
        refs = {ref for _g, _t, ref in GROUPS}
        ops = [op for op in ops if op.key in wanted or (op.key in refs and any(
            o.group == op.group and o.key in wanted for o in ops))]
    print(f"measuring {len(ops)} operations x {args.repeat} runs (warm page cache)", flush=True)
    results = run_all(ops, work, args.size_gib, args.repeat, not args.no_verify)
    probe = None
    if not args.no_probe:
        print("untimed probes of MindSpore tools (bench/ms_probe.py) ...", flush=True)
        proc = subprocess.run([sys.executable, str(HERE / "ms_probe.py"), "--work", str(work / "probe")],
                              capture_output=True, text=True, env=child_env(), cwd=str(ROOT))
        try:
            probe = last_json(proc.stdout)
        except (ValueError, IndexError):
            probe = {"probes": [{"what": "ms_probe.py", "result": f"failed to run (exit {proc.returncode})",
                                 "detail": proc.stderr.strip()[-400:]}]}
        for p in probe["probes"]:
            print(f"  {p['what']}: {p['result']}", flush=True)
    nbytes = ms_state.tensor_bytes(args.size_gib)
    op_docs = {op.key: {"tool": op.tool, "operation": op.operation, "group": op.group} for op in ops}
    result_docs = [asdict(r) for r in results]
    rows = build_rows(result_docs, op_docs, nbytes)
    data = {
        "command": shlex.join(argv_shown),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "size_gib": args.size_gib,
        "tensor_bytes": nbytes,
        "repeat": args.repeat,
        "load_before": load_before,
        "load_after": load_avg(),
        "generated": info,
        "machine": facts,
        "sources_after": measured_sources(),
        "versions": _versions(),
        "results": result_docs,
        "rows": rows,
        "probe": probe,
    }
    results_path.write_text(json.dumps(data, indent=1))
    print()
    print(markdown_table(rows))
    if args.doc is None and not args.no_doc:
        print("\n(smoke-sized run: no doc written; pass --doc FILE to write one)")
    elif not args.no_doc:
        args.doc.write_text(render_doc(data))
        print(f"\nwrote {args.doc} (raw numbers in {results_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
