"""Benchmark hpckpt's copy engine against PyTorch's own tools and `cp -r`, side by side, in one run.

    python bench/bench_engine.py --size-gib 1.5 --out bench/out/engine      # the published table
    python bench/bench_engine.py --size-gib 0.1 --out bench/out/engine-smoke --repeat 1 --no-doc

Steps:
1. Generate (once; reused while its `generated.json` matches the size) the checkpoint with real
   `torch.distributed.checkpoint.save` under `torchrun --standalone --nproc-per-node 4` (gloo, CPU
   DTensors, uneven Shard(0), fp32 + bf16, 0-d tensors, non-tensor values; `torch_dcp_make.py`),
   the same tensors with `HuggingFaceStorageWriter(save_distributed=True)` (the input PyTorch's
   safetensors consolidation needs), and the same state in HyperParallel format made by
   `hpckpt reshard TORCH_DCP -o HP --world-size 4 --split ceil` (same 4-rank layout as torch).
   Both are checked: `hpckpt verify` on each, every element of the HP copy against the pattern
   with hpckpt's reader, and every element of the torch DCP one by `dcp.load` onto 8 ranks.
2. Measure each operation as its own process (wall time from spawn to exit; peak RSS by polling
   the process tree with psutil every 20 ms, summed over the tree, plus the largest single
   process's `ru_maxrss` from `/usr/bin/time -f %M`), `--repeat` times round-robin (best wall,
   highest RSS),
   with the inputs' pages read once before (`warm`) and/or evicted with
   `posix_fadvise(POSIX_FADV_DONTNEED)` (`cold`). Every output is checked once (not timed) and
   deleted after each run.
   Then an RSS probe: one `--rss-probe-gib` GiB tensor (4 ranks) resharded and consolidated by
   hpckpt, since the memory target is for any checkpoint size.
3. Print one Markdown table and write it, with the command, the machine and the explanations, to
   `--doc` (default docs/benchmarks-engine.md); `--notes FILE` appends a Markdown file (the
   profiles, bench/engine_profile_notes.md). Raw numbers go to OUT/results.json; `--doc-only`
   rewrites the doc from them.

Helpers: torch_dcp_make.py / torch_dcp_load.py / torch_consolidate.py (the PyTorch side),
engine_state.py (the state), profile_engine.py (cProfile + phase timers of one hpckpt command),
engine_experiments.py (proposed engine changes as monkeypatches), write_path_micro.py.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import engine_state  # noqa: E402

POLL_SECONDS = 0.02
MIB = 2**20
TARGET_CP_RATIO = 0.8
TARGET_SPEEDUP = 3.0
TARGET_RSS_MIB = 300


# --- processes ---------------------------------------------------------------------------------

def venv_bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if not found:
        sys.exit(f"error: no `{name}` next to this Python or on PATH")
    return found


SNAPSHOT: Path | None = None  # directory holding a `hpckpt` package snapshot (see take_snapshot)
THROTTLE: Path | None = None  # a blkio cgroup every measured process joins (see throttle_writes)


def throttle_writes(spec: str, target: Path) -> Path:
    """A blkio cgroup (v1) that limits writes to the disk holding `target` to `spec` =
    "BYTES_PER_S:IOPS": a disk that limits requests, like the one the durable-write figures of
    issue 8 were measured on. Writeback a process starts itself (sync_file_range, fsync) is
    submitted in its context, so it is throttled too; the kernel's background flusher is not."""
    bps, iops = spec.split(":")
    dev = os.stat(target).st_dev
    device = f"{os.major(dev)}:{os.minor(dev)}"
    group = Path("/sys/fs/cgroup/blkio/hpckpt-bench")
    group.mkdir(exist_ok=True)
    (group / "blkio.throttle.write_bps_device").write_text(f"{device} {int(float(bps))}\n")
    (group / "blkio.throttle.write_iops_device").write_text(f"{device} {int(iops)}\n")
    return group


def _join_throttle() -> None:
    if THROTTLE is not None:
        (THROTTLE / "cgroup.procs").write_text(str(os.getpid()))


def child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", HPCKPT_NO_CACHE="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if SNAPSHOT is not None:  # ahead of the editable install's finder
        env["PYTHONPATH"] = str(SNAPSHOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def take_snapshot(work: Path) -> tuple[Path, str]:
    """Extract the committed sources of HEAD (`git archive`, read-only) as `work/src/SHA/hpckpt`.

    Other sessions commit to this repository while a run lasts; every hpckpt process of the run
    imports this snapshot (PYTHONPATH), so one run measures one commit.
    """
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    base = work / "src" / sha
    if not (base / "hpckpt" / "__init__.py").is_file():
        (base / "hpckpt").mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base / "hpckpt")], input=archive, check=True)
    # Byte-compile it, as `pip install` does: with PYTHONDONTWRITEBYTECODE set (this machine sets
    # it), every run would otherwise compile hpckpt's modules from source (about 60 ms each time).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(base / "hpckpt")], check=True,
                   stdout=subprocess.DEVNULL)
    return base, sha


def use_snapshot(work: Path) -> None:
    """Take the snapshot (`take_snapshot`) and make every later hpckpt process import it."""
    global SNAPSHOT
    SNAPSHOT, sha = take_snapshot(work)
    print(f"measuring hpckpt at commit {sha} (snapshot in {SNAPSHOT})", flush=True)


@dataclass
class Sample:
    wall: float
    tree_peak: int  # bytes: highest sum of RSS over the process tree seen by polling
    single_peak: int  # bytes: ru_maxrss of the largest process (wait4), or the polled max
    returncode: int
    stdout: str


def measure(cmd: list[str], log: Path) -> Sample:
    """Run `cmd` under GNU time, timing spawn to exit and polling the RSS of its process tree.

    The largest single process's peak RSS comes from `/usr/bin/time -f %M` (its `wait4` rusage:
    the max over the command and the descendants it waited for). It is not taken from this
    process's own `wait4`: a child spawned from a big parent inherits the parent's RSS high-water
    mark through fork/exec, which would inflate small commands like `cp`.
    """
    rss_file = log.with_suffix(".rss")
    timed = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *cmd] if Path("/usr/bin/time").is_file() else cmd
    with open(log, "wb") as err, open(log.with_suffix(".out"), "wb") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(timed, stdout=out, stderr=err, env=child_env(), cwd=str(ROOT),
                                preexec_fn=_join_throttle if THROTTLE is not None else None)
        root = psutil.Process(proc.pid)
        members: list[psutil.Process] = [root]
        tree_peak = single_peak = 0
        ticks = 0
        while True:
            pid, status, _usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                wall = time.perf_counter() - started
                break
            if ticks % 5 == 0:  # the tree changes rarely; re-list it every 100 ms
                try:
                    members = [root] + root.children(recursive=True)
                except psutil.Error:
                    pass
            total = 0
            for p in members:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                single_peak = max(single_peak, rss)
            tree_peak = max(tree_peak, total)
            ticks += 1
            time.sleep(POLL_SECONDS)
        proc.returncode = os.waitstatus_to_exitcode(status)
    try:
        lines = rss_file.read_text().split()
        single_peak = max(single_peak, int(lines[-1]) * 1024)  # GNU time prints KiB
        rss_file.unlink()
    except (OSError, ValueError, IndexError):
        pass
    tree_peak = max(tree_peak, single_peak)
    text = log.with_suffix(".out").read_text(errors="replace")
    return Sample(wall, tree_peak, single_peak, proc.returncode, text)


# --- page cache ------------------------------------------------------------------------------

def files_under(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file())
    return out


def warm(paths: list[Path]) -> None:
    buf = bytearray(16 * MIB)
    for f in files_under(paths):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def evict(paths: list[Path]) -> None:
    for f in files_under(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[Path]) -> float | None:
    """Share of the files' pages in the page cache (util-linux `fincore`), to check `evict`."""
    files = files_under(paths)
    if not files or not shutil.which("fincore"):
        return None
    try:
        text = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *map(str, files)],
                              capture_output=True, text=True, check=True).stdout
    except (subprocess.CalledProcessError, OSError):
        return None
    res = size = 0
    for line in text.split("\n"):
        if line.strip():
            r, s = line.split()
            res, size = res + int(r), size + int(s)
    return res / size if size else None


def fresh_scratch(work: Path) -> tuple[Path, Path, Path]:
    """(scratch, logs, ckpt) under `work`: scratch emptied and re-created, logs kept."""
    scratch = work / "scratch"
    remove(scratch)
    scratch.mkdir(parents=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    return scratch, logs, work / "ckpt"


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    for extra in path.parent.glob(f".{path.name}*"):  # hpckpt staging leftovers
        remove(extra) if extra.is_dir() else extra.unlink()


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in files_under([path]))


# --- checks (never timed) --------------------------------------------------------------------

def _expected_torch(size: float, fqn: str):
    import torch

    if fqn in engine_state.ZERO_D:
        dtype, value = engine_state.ZERO_D[fqn]
        return torch.tensor(value, dtype=getattr(torch, dtype))
    for t, (name, shape, dtype) in enumerate(engine_state.spec(size)):
        if name == fqn:
            return engine_state._pattern_torch(t, shape, dtype, 0, shape[0])
    raise KeyError(fqn)


def all_fqns(size: float) -> list[str]:
    return [f for f, _s, _d in engine_state.spec(size)] + list(engine_state.ZERO_D)


def _values_equal(got, want) -> bool:
    if isinstance(want, list):
        return list(got) == want
    return got == want


def check_with_hpckpt(path: Path, size: float, values: bool = True) -> list[str]:
    """Read every tensor of `path` (any format hpckpt reads) with hpckpt's reader; compare."""
    import numpy as np

    from hpckpt.converters import open_index
    from hpckpt.core.io.read import OpenFiles, read_box

    index = open_index(path, use_cache=False)
    bad = []
    with OpenFiles() as files:
        for fqn in all_fqns(size):
            entry = index.tensors.get(fqn)
            if entry is None:
                bad.append(f"{fqn} (missing)")
                continue
            got = read_box(index, entry, files=files)
            want = engine_state.expected_numpy(size, fqn)
            if got.shape != want.shape or got.dtype.itemsize != want.dtype.itemsize or not np.array_equal(
                    got.view(want.dtype) if got.dtype != want.dtype else got, want):
                bad.append(fqn)
    if values:
        for fqn, want in engine_state.VALUES.items():
            try:
                if not _values_equal(index.decode_value(fqn), want):
                    bad.append(fqn)
            except Exception as exc:  # noqa: BLE001
                bad.append(f"{fqn} ({exc})")
    extra = set(index.tensors) - set(all_fqns(size))
    bad += [f"{fqn} (unexpected)" for fqn in sorted(extra)]
    return bad


def check_safetensors(path: Path, size: float, skip: tuple[str, ...] = ()) -> list[str]:
    """Compare a consolidated safetensors file with the pattern, read by the safetensors package."""
    import torch
    from safetensors import safe_open

    bad = []
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for fqn in all_fqns(size):
            if fqn in skip:
                continue
            if fqn not in keys:
                bad.append(f"{fqn} (missing)")
                continue
            got, want = f.get_tensor(fqn), _expected_torch(size, fqn)
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                bad.append(f"{fqn} (got {got.flatten()[:1].tolist()} shape {list(got.shape)}, want {want.flatten()[:1].tolist()} shape {list(want.shape)})"
                           if got.numel() <= 1 or want.numel() <= 1 else fqn)
    side = path.with_name(path.name.removesuffix(".safetensors") + ".values.json")
    if side.is_file():  # hpckpt writes the non-tensor values next to the file
        values = json.loads(side.read_text())
        for fqn, want in engine_state.VALUES.items():
            if fqn not in values or not _values_equal(values[fqn].get("value"), want):
                bad.append(f"{fqn} (values.json)")
    return bad


def check_pt(path: Path, size: float) -> list[str]:
    """Compare a consolidated torch.save file (flat or nested dict) with the pattern."""
    import torch

    state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)

    def lookup(fqn: str):
        if fqn in state:
            return state[fqn]
        node = state
        for part in fqn.split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(fqn)
            node = node[part]
        return node

    bad = []
    for fqn in all_fqns(size):
        try:
            got = lookup(fqn)
        except KeyError:
            bad.append(f"{fqn} (missing)")
            continue
        want = _expected_torch(size, fqn)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            bad.append(fqn)
    for fqn, want in engine_state.VALUES.items():
        try:
            if not _values_equal(lookup(fqn), want):
                bad.append(fqn)
        except KeyError:
            bad.append(f"{fqn} (missing)")
    return bad


CHECKS = {"hpckpt": check_with_hpckpt, "safetensors": check_safetensors, "pt": check_pt}


def last_json(text: str):
    """The JSON document on the last line of a child's output."""
    return json.loads(text.strip().splitlines()[-1])


def check_in_child(kind: str, path: Path, size: float, skip: tuple[str, ...] = (), *, script: str = __file__,
                   cwd: Path | None = None, tail: int = 400) -> list[str]:
    """Run a check in a fresh process: torch and hpckpt stay out of this (measuring) process.

    `script --check KIND PATH --size-gib SIZE` prints the list of problems as JSON on its last line;
    when it fails, the last `tail` characters of its stderr are the one problem.
    """
    cmd = [sys.executable, str(Path(script).resolve()), "--check", kind, str(path), "--size-gib", str(size)]
    cmd += [a for name in skip for a in ("--check-skip", name)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=child_env(),
                            cwd=None if cwd is None else str(cwd))
    if result.returncode != 0:
        return [f"check failed to run: {result.stderr.strip()[-tail:]}"]
    return last_json(result.stdout)


def run_verify(path: Path) -> subprocess.CompletedProcess:
    """`hpckpt verify PATH --json`, output captured."""
    return subprocess.run([venv_bin("hpckpt"), "verify", str(path), "--json"], capture_output=True, text=True,
                          env=child_env())


def hpckpt_verify(path: Path) -> bool:
    return run_verify(path).returncode == 0


# --- generation ------------------------------------------------------------------------------

def torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [venv_bin("torchrun"), "--standalone", "--nproc-per-node", str(nproc), str(HERE / script), *args]


def reuse_inputs(ckpt: Path, size: float, regenerate: bool, what: str) -> dict | None:
    """The inputs' record `ckpt/generated.json` when it is for `size` (and not `regenerate`);
    otherwise None, with `ckpt` emptied and re-created for new inputs."""
    stamp = ckpt / "generated.json"
    if stamp.is_file() and not regenerate:
        info = json.loads(stamp.read_text())
        if info.get("size_gib") == size:
            print(f"using existing {what} in {ckpt}", flush=True)
            return info
    remove(ckpt)
    ckpt.mkdir(parents=True)
    return None


def generate(work: Path, size: float, regenerate: bool) -> dict:
    ckpt = work / "ckpt"
    info = reuse_inputs(ckpt, size, regenerate, "checkpoints")
    if info is not None:
        return info
    dcp, hf, hp = ckpt / "torch-dcp", ckpt / "torch-hf-sharded", ckpt / "hp"
    print(f"generating {size} GiB with torch.distributed.checkpoint.save on 4 ranks ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run(torchrun(4, "torch_dcp_make.py", "--size-gib", str(size), "--dcp", str(dcp), "--hf", str(hf),
                            "--report", str(ckpt / "make.json")), check=True, env=child_env(), cwd=str(ROOT))
    make_seconds = time.perf_counter() - t0
    print(f"  torchrun save job: {make_seconds:.1f} s; converting to HyperParallel with hpckpt ...", flush=True)
    convert = [venv_bin("hpckpt"), "reshard", str(dcp), "-o", str(hp), "--world-size", "4", "--split", "ceil"]
    subprocess.run(convert, check=True, env=child_env(), stdout=subprocess.DEVNULL)
    print("  checking: hpckpt verify (both), every element of HP with hpckpt's reader, torch DCP via dcp.load on 8 ranks ...",
          flush=True)
    checks = {
        "hpckpt_verify_dcp": hpckpt_verify(dcp),
        "hpckpt_verify_hp": hpckpt_verify(hp),
        "hp_elements": check_in_child("hpckpt", hp, size),
        "dcp_elements_hpckpt_reader": check_in_child("hpckpt", dcp, size),
    }
    report = ckpt / "load-verify.json"
    subprocess.run(torchrun(8, "torch_dcp_load.py", "--size-gib", str(size), "--dcp", str(dcp), "--verify",
                            "--report", str(report)), check=True, env=child_env(), cwd=str(ROOT),
                   stdout=subprocess.DEVNULL)
    checks["dcp_elements_torch_load_8"] = json.loads(report.read_text())["mismatches"]
    ok = checks["hpckpt_verify_dcp"] and checks["hpckpt_verify_hp"] and not any(
        checks[k] for k in ("hp_elements", "dcp_elements_hpckpt_reader", "dcp_elements_torch_load_8"))
    if not ok:
        sys.exit(f"error: generated checkpoints fail their checks: {checks}")
    info = {
        "size_gib": size,
        "make": json.loads((ckpt / "make.json").read_text()),
        "make_job_s": make_seconds,
        "convert_command": shlex.join(["hpckpt", *convert[1:]]),
        "checks": checks,
        "bytes": {"torch-dcp": du(dcp), "torch-hf-sharded": du(hf), "hp": du(hp)},
        "files": {"torch-dcp": len(files_under([dcp])), "torch-hf-sharded": len(files_under([hf])),
                  "hp": len(files_under([hp]))},
    }
    (ckpt / "generated.json").write_text(json.dumps(info, indent=1))
    return info


# --- operations ------------------------------------------------------------------------------

@dataclass
class Op:
    key: str
    tool: str
    operation: str
    source: str  # "hp", "torch-dcp", "torch-hf-sharded"
    group: str  # "copy", "reshard", "consolidate"
    command: Callable[[Path, Path], list[str]]  # (source dir, output path) -> argv
    output: str  # name of the output under the scratch directory
    check: Callable[[Path, float], list[str]] | None = None
    torch_report: bool = False
    display: Callable[[Path, Path], str] | None = None  # the command as shown in the doc


def cp_sync(src: Path, dst: Path) -> list[str]:
    return ["sh", "-c", 'cp -r "$1" "$2" && find "$2" -type f -exec sync {} + && sync "$2"', "sh", str(src), str(dst)]


def operations(size: float, scratch: Path, torch_save: bool) -> list[Op]:
    hp_bin = venv_bin("hpckpt")
    py = sys.executable
    s = str(size)
    ops = [
        Op("cp-hp", "cp", "cp -r", "hp", "copy", lambda i, o: ["cp", "-r", str(i), str(o)], "cp-out"),
        Op("cp-sync-hp", "cp", "cp -r + sync (fsync files)", "hp", "copy", cp_sync, "cp-out"),
        Op("cp-dcp", "cp", "cp -r", "torch-dcp", "copy", lambda i, o: ["cp", "-r", str(i), str(o)], "cp-out"),
        Op("cp-sync-dcp", "cp", "cp -r + sync (fsync files)", "torch-dcp", "copy", cp_sync, "cp-out"),
        Op("reshard-hp", "hpckpt", "reshard 4 -> 8", "hp", "reshard",
           lambda i, o: [hp_bin, "reshard", str(i), "-o", str(o), "--world-size", "8"], "reshard-out",
           check=lambda o, sz: check_in_child("hpckpt", o, sz)),
        Op("reshard-dcp", "hpckpt", "reshard 4 -> 8", "torch-dcp", "reshard",
           lambda i, o: [hp_bin, "reshard", str(i), "-o", str(o), "--world-size", "8"], "reshard-out",
           check=lambda o, sz: check_in_child("hpckpt", o, sz)),
        Op("torch-load", "PyTorch", "DCP load onto 8 ranks (torchrun)", "torch-dcp", "reshard",
           lambda i, o: torchrun(8, "torch_dcp_load.py", "--size-gib", s, "--dcp", str(i), "--report", str(o)),
           "torch-load.json", torch_report=True),
    ]
    ops += [
        Op("reshard-hp-nf", "hpckpt", "reshard 4 -> 8 --no-fsync", "hp", "reshard",
           lambda i, o: [hp_bin, "reshard", str(i), "-o", str(o), "--world-size", "8", "--no-fsync"], "reshard-out"),
        Op("reshard-dcp-nf", "hpckpt", "reshard 4 -> 8 --no-fsync", "torch-dcp", "reshard",
           lambda i, o: [hp_bin, "reshard", str(i), "-o", str(o), "--world-size", "8", "--no-fsync"], "reshard-out"),
    ]
    if torch_save:
        ops.append(Op("torch-load-save", "PyTorch", "DCP load onto 8 ranks + dcp.save", "torch-dcp", "reshard",
                      lambda i, o: torchrun(8, "torch_dcp_load.py", "--size-gib", s, "--dcp", str(i), "--report",
                                            str(o.with_suffix(".json")), "--save", str(o)),
                      "torch-load-save", torch_report=True))
    ops += [
        Op("cons-hp-st", "hpckpt", "consolidate -> .safetensors", "hp", "consolidate",
           lambda i, o: [hp_bin, "consolidate", str(i), "-o", str(o)], "x.safetensors",
           check=lambda o, sz: check_in_child("safetensors", o, sz)),
        Op("cons-hp-pt", "hpckpt", "consolidate -> .pt (--format pt)", "hp", "consolidate",
           lambda i, o: [hp_bin, "consolidate", str(i), "-o", str(o), "--format", "pt"], "x.pt",
           check=lambda o, sz: check_in_child("pt", o, sz)),
        Op("cons-dcp-st", "hpckpt", "consolidate -> .safetensors", "torch-dcp", "consolidate",
           lambda i, o: [hp_bin, "consolidate", str(i), "-o", str(o)], "x.safetensors",
           check=lambda o, sz: check_in_child("safetensors", o, sz)),
        Op("cons-dcp-pt", "hpckpt", "consolidate -> .pt (--format pt)", "torch-dcp", "consolidate",
           lambda i, o: [hp_bin, "consolidate", str(i), "-o", str(o), "--format", "pt"], "x.pt",
           check=lambda o, sz: check_in_child("pt", o, sz)),
        Op("cons-hp-st-nf", "hpckpt", "consolidate -> .safetensors --no-fsync", "hp", "consolidate",
           lambda i, o: [hp_bin, "consolidate", str(i), "-o", str(o), "--no-fsync"], "x.safetensors"),
        Op("cons-dcp-st-nf", "hpckpt", "consolidate -> .safetensors --no-fsync", "torch-dcp", "consolidate",
           lambda i, o: [hp_bin, "consolidate", str(i), "-o", str(o), "--no-fsync"], "x.safetensors"),
        Op("cons-dcp-pt-nf", "hpckpt", "consolidate -> .pt --no-fsync", "torch-dcp", "consolidate",
           lambda i, o: [hp_bin, "consolidate", str(i), "-o", str(o), "--format", "pt", "--no-fsync"], "x.pt"),
        Op("torch-dcp-to-pt", "PyTorch", "dcp_to_torch_save -> .pt", "torch-dcp", "consolidate",
           lambda i, o: [py, str(HERE / "torch_consolidate.py"), "dcp-to-torch-save", str(i), str(o)], "x.pt",
           check=lambda o, sz: check_in_child("pt", o, sz)),
        Op("torch-hf-st", "PyTorch", "consolidate_safetensors_files -> .safetensors", "torch-hf-sharded",
           "consolidate",
           lambda i, o: [py, str(HERE / "torch_consolidate.py"), "hf-safetensors", str(i), str(o)], "hf-out",
           check=lambda o, sz: check_in_child("safetensors", o / "model-00001-of-00001.safetensors", sz,
                                               skip=("optim.step",))),
    ]
    return ops


# Which rows are compared with which: (row, hpckpt rows it is compared with).
VERSUS = {
    "torch-load": ["reshard-dcp", "reshard-hp"],
    "torch-load-save": ["reshard-dcp", "reshard-hp"],
    "torch-dcp-to-pt": ["cons-dcp-pt", "cons-dcp-pt-nf", "cons-hp-pt"],
    "torch-hf-st": ["cons-dcp-st", "cons-dcp-st-nf", "cons-hp-st", "cons-hp-st-nf"],
}
CP_OF = {"hp": ("cp-hp", "cp-sync-hp"), "torch-dcp": ("cp-dcp", "cp-sync-dcp"),
         "torch-hf-sharded": ("cp-dcp", "cp-sync-dcp")}


@dataclass
class Result:
    key: str
    cache: str
    walls: list[float] = field(default_factory=list)
    tree_peaks: list[int] = field(default_factory=list)
    single_peaks: list[int] = field(default_factory=list)
    inner: list[dict] = field(default_factory=list)  # torch scripts' own reports / printed JSON
    check: list[str] | None = None
    failed: str | None = None

    @property
    def best(self) -> float | None:
        return min(self.walls) if self.walls else None


def run_all(ops: list[Op], work: Path, info: dict, size: float, caches: list[str], repeat: int,
            verify: bool) -> list[Result]:
    scratch, logs, ckpt = fresh_scratch(work)
    results: dict[tuple[str, str], Result] = {}
    for cache in caches:
        for rep in range(repeat):
            for op in ops:
                res = results.setdefault((op.key, cache), Result(op.key, cache))
                if res.failed:
                    continue
                src = ckpt / op.source
                out = scratch / op.output
                remove(out)
                if cache == "warm":
                    warm([src])
                else:
                    evict([src])
                    resident = resident_fraction([src])
                    if resident is not None and resident > 0.05:
                        print(f"  warning: {resident:.0%} of {src} still cached after eviction", flush=True)
                sample = measure(op.command(src, out), logs / f"{op.key}-{cache}-{rep}.err")
                if sample.returncode != 0:
                    res.failed = f"exit {sample.returncode}: {(logs / f'{op.key}-{cache}-{rep}.err').read_text()[-600:]}"
                    print(f"  {op.key} [{cache}] FAILED ({res.failed[:200]})", flush=True)
                    remove(out)
                    continue
                res.walls.append(sample.wall)
                res.tree_peaks.append(sample.tree_peak)
                res.single_peaks.append(sample.single_peak)
                inner: dict = {}
                if op.torch_report:
                    report = out if out.suffix == ".json" else out.with_suffix(".json")
                    inner = json.loads(report.read_text())
                    report.unlink()
                else:
                    for line in sample.stdout.splitlines()[::-1]:
                        if line.startswith("{"):
                            inner = json.loads(line)
                            break
                res.inner.append(inner)
                if verify and res.check is None and op.check is not None:
                    res.check = op.check(out, size)
                extra = f" (load {inner['load_s']:.2f} s inside)" if "load_s" in inner else ""
                print(f"  {op.key:16} [{cache}] run {rep + 1}/{repeat}: {sample.wall:7.2f} s, "
                      f"tree peak {sample.tree_peak / MIB:7.0f} MiB, largest process {sample.single_peak / MIB:6.0f} MiB"
                      f"{extra}" + (f"; check: {'ok' if not res.check else res.check[:3]}"
                                    if res.check is not None and rep == 0 else ""), flush=True)
                remove(out)
    remove(scratch)
    return list(results.values())


def rss_probe(work: Path, gib: float, repeat: int) -> dict:
    """Peak RSS with one big tensor: the memory target holds "for any checkpoint size", and the
    main checkpoint's tensors (a few MB) never fill the engine's tile budget.

    One fp32 tensor of `gib` GiB (an embedding-like [rows, 4096], rows = 3 mod 8) is written as a
    safetensors file, sharded by hpckpt onto 4 ranks (`--split ceil`), then resharded to 8 and
    consolidated to safetensors and pt, each measured like the main rows (warm, best of `repeat`).
    """
    import struct

    probe = work / "rss-probe"
    remove(probe)
    probe.mkdir(parents=True)
    cols = 4096
    rows = int(gib * 2**30 / (cols * 4))
    rows += (3 - rows % 8) % 8
    header = json.dumps({"emb": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, rows * cols * 4]}}).encode()
    header += b" " * (-len(header) % 8)
    one = probe / "one.safetensors"
    with open(one, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        block = bytes(range(256)) * (cols * 4 * 64 // 256)  # 64 rows
        left = rows
        while left:
            n = min(64, left)
            f.write(block[: n * cols * 4])
            left -= n
    hp4 = probe / "hp4"
    subprocess.run([venv_bin("hpckpt"), "reshard", str(one), "-o", str(hp4), "--world-size", "4", "--split", "ceil"],
                   check=True, env=child_env(), stdout=subprocess.DEVNULL)
    one.unlink()
    hp = venv_bin("hpckpt")
    cases = [
        ("reshard 4 -> 8", lambda o: [hp, "reshard", str(hp4), "-o", str(o), "--world-size", "8"]),
        ("consolidate -> .safetensors", lambda o: [hp, "consolidate", str(hp4), "-o", str(o) + ".safetensors"]),
        ("consolidate -> .pt (--format pt)", lambda o: [hp, "consolidate", str(hp4), "-o", str(o) + ".pt", "--format", "pt"]),
    ]
    out = {"gib": gib, "shape": [rows, cols], "bytes": rows * cols * 4, "rows": []}
    for name, build in cases:
        walls, peaks = [], []
        for rep in range(repeat):
            target = probe / "out"
            warm([hp4])
            sample = measure(build(target), work / "logs" / f"rss-probe-{len(out['rows'])}-{rep}.err")
            for leftover in probe.glob("out*"):
                remove(leftover)
            if sample.returncode != 0:
                break
            walls.append(sample.wall)
            peaks.append(sample.single_peak)
        out["rows"].append({"operation": name, "wall": min(walls) if walls else None,
                            "rss_mib": max(peaks) / MIB if peaks else None})
        print(f"  rss probe {name:34}: {out['rows'][-1]['wall'] or float('nan'):6.2f} s, "
              f"peak RSS {out['rows'][-1]['rss_mib'] or float('nan'):5.0f} MiB", flush=True)
    remove(probe)
    return out


def probe_table(probe: dict) -> str:
    lines = ["| tool | operation | input | wall s (best) | GB/s | peak RSS MiB | RSS target < 300 MiB |", "|---|---|---|---|---|---|---|"]
    for row in probe["rows"]:
        ok = row["rss_mib"] is not None and row["rss_mib"] < TARGET_RSS_MIB
        lines.append(f"| hpckpt | {row['operation']} | one fp32 tensor {probe['shape']} on 4 ranks | {_fmt(row['wall'])} | "
                     f"{_fmt(probe['bytes'] / row['wall'] / 1e9 if row['wall'] else None)} | {_fmt(row['rss_mib'], '.0f')} | "
                     f"{'met' if ok else 'missed'} |")
    return "\n".join(lines)


# --- report ----------------------------------------------------------------------------------

def machine_facts() -> dict:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, env=child_env()).stdout.strip()
        except OSError as exc:
            return f"n/a ({exc})"

    env = run([venv_bin("hpckpt"), "env", "--json"])
    try:
        env_doc = json.loads(env)
    except ValueError:
        env_doc = {"raw": env}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    fs = run(["df", "-T", str(ROOT)]).splitlines()[-1].split()[1] if shutil.which("df") else "?"
    return {
        "nproc": subprocess.run(["nproc"], capture_output=True, text=True,  # nproc obeys OMP_NUM_THREADS
                                env={k: v for k, v in os.environ.items() if not k.startswith("OMP_")}).stdout.strip(),
        "free_g": run(["free", "-g"]),
        "cpu": cpu,
        "kernel": platform.release(),
        "filesystem": fs,
        "hpckpt_env": env_doc,
        "cp": run(["cp", "--version"]).splitlines()[0],
        "git": SNAPSHOT.name if SNAPSHOT is not None else run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "git_dirty": False if SNAPSHOT is not None else bool(
            run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])),
        "snapshot": SNAPSHOT is not None,
        "sources": measured_sources(),
    }


def measured_sources() -> str:
    """Fingerprint of the hpckpt sources the children import: the snapshot's, or the working tree's."""
    return source_fingerprint(SNAPSHOT / "hpckpt" if SNAPSHOT is not None else ROOT)


def source_fingerprint(root: Path = ROOT) -> str:
    files = sorted(p for d in (root, root / "cli", root / "core", root / "converters") for p in d.glob("*.py"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def build_rows(results: list[dict], ops: dict[str, dict], nbytes: int) -> list[dict]:
    by = {(r["key"], r["cache"]): r for r in results}
    rows = []
    for r in results:
        op = ops[r["key"]]
        best = min(r["walls"]) if r["walls"] else None
        row = {"key": r["key"], "cache": r["cache"], "tool": op["tool"], "operation": op["operation"],
               "source": op["source"], "wall": best, "gbps": nbytes / best / 1e9 if best else None,
               "tree_mib": max(r["tree_peaks"]) / MIB if r["tree_peaks"] else None,
               "single_mib": max(r["single_peaks"]) / MIB if r["single_peaks"] else None,
               "failed": r["failed"], "check": r["check"], "runs": len(r["walls"])}
        cp, cp_sync = (by.get((k, r["cache"])) for k in CP_OF[op["source"]])
        row["x_cp"] = (min(cp["walls"]) / best) if cp and cp["walls"] and best else None
        row["x_cp_sync"] = (min(cp_sync["walls"]) / best) if cp_sync and cp_sync["walls"] and best else None
        row["speedups"] = {}
        for ref in VERSUS.get(r["key"], []):
            other = by.get((ref, r["cache"]))
            if other and other["walls"] and best:
                row["speedups"][ref] = best / min(other["walls"])
        if op["tool"] == "PyTorch" and r["inner"]:
            loads = [i["load_s"] for i in r["inner"] if "load_s" in i]
            saves = [i["save_s"] for i in r["inner"] if i.get("save_s")]
            calls = [i["call_s"] for i in r["inner"] if "call_s" in i]
            ranks = [g["maxrss"] for i in r["inner"] for g in i.get("ranks", [])]
            row["inner_load"] = min(loads) if loads else None
            row["inner_save"] = min(saves) if saves else None
            row["inner_call"] = min(calls) if calls else None
            row["rank_max_mib"] = max(ranks) / MIB if ranks else None
        rows.append(row)
    return rows


SHORT = {"reshard-dcp": "reshard (torch-dcp)", "reshard-hp": "reshard (hp)",
         "cons-dcp-pt": "consolidate pt (torch-dcp)", "cons-hp-pt": "consolidate pt (hp)",
         "cons-dcp-pt-nf": "consolidate pt --no-fsync (torch-dcp)",
         "cons-dcp-st": "consolidate st (torch-dcp)", "cons-hp-st": "consolidate st (hp)",
         "cons-dcp-st-nf": "consolidate st --no-fsync (torch-dcp)", "cons-hp-st-nf": "consolidate st --no-fsync (hp)"}


def markdown_table(rows: list[dict]) -> str:
    head = ("| tool | operation | input | cache | wall s (best) | GB/s | peak RSS MiB (tree) | largest process MiB "
            "| x cp -r | x cp -r+sync | hpckpt faster by |")
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        if row["failed"]:
            lines.append(f"| {row['tool']} | {row['operation']} | {row['source']} | {row['cache']} | failed | | | | | | |")
            continue
        speed = ", ".join(f"{v:.2f}x vs {SHORT[k]}"
                          for k, v in row["speedups"].items())
        wall = _fmt(row["wall"])
        if row.get("inner_load") is not None:
            wall += f" (load {row['inner_load']:.2f}" + (f", save {row['inner_save']:.2f}" if row.get("inner_save") else "") + ")"
        elif row.get("inner_call") is not None:
            wall += f" (call {row['inner_call']:.2f})"
        largest = _fmt(row["single_mib"], ".0f")
        lines.append(f"| {row['tool']} | {row['operation']} | {row['source']} | {row['cache']} | {wall} | "
                     f"{_fmt(row['gbps'])} | {_fmt(row['tree_mib'], '.0f')} | {largest} | {_fmt(row['x_cp'])} | "
                     f"{_fmt(row['x_cp_sync'])} | {speed} |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    """One line per target and row: met or missed, with the number."""
    out = []
    for row in rows:
        if row["tool"] != "hpckpt" or row["failed"]:
            continue
        name = f"`{row['operation']}` ({row['source']}, {row['cache']})"
        if row["x_cp"] is not None:
            if "--no-fsync" in row["operation"]:  # like for like: cp -r does not fsync either
                out.append(f"- throughput {name}: {row['x_cp']:.2f}x `cp -r` (target >= {TARGET_CP_RATIO}x): "
                           f"{'met' if row['x_cp'] >= TARGET_CP_RATIO else 'missed'}")
            else:  # fsynced output: like for like is cp -r + sync; plain cp -r given too
                out.append(f"- throughput {name}: {row['x_cp_sync']:.2f}x `cp -r + sync` (target >= {TARGET_CP_RATIO}x): "
                           f"{'met' if row['x_cp_sync'] >= TARGET_CP_RATIO else 'missed'} "
                           f"({row['x_cp']:.2f}x plain `cp -r`)")
        out.append(f"- peak RSS {name}: {row['single_mib']:.0f} MiB (target < {TARGET_RSS_MIB}): "
                   f"{'met' if row['single_mib'] < TARGET_RSS_MIB else 'missed'}")
    for row in rows:
        if row["tool"] == "PyTorch" and not row["failed"]:
            for ref, v in row["speedups"].items():
                out.append(f"- hpckpt {SHORT[ref]} vs PyTorch `{row['operation']}` "
                           f"({row['cache']}): {v:.2f}x faster (target >= {TARGET_SPEEDUP:.0f}x): "
                           f"{'met' if v >= TARGET_SPEEDUP else 'missed'}")
    return out


def torch_read_amplification(size: float, old: int, new: int) -> float:
    """Bytes `dcp.load` reads / bytes of the checkpoint: each target rank loads every source
    record its rows overlap in full (FileSystemReader.read_data: torch.load, then narrow)."""
    read = total = 0
    for _fqn, shape, dtype in engine_state.spec(size):
        row = math.prod(shape[1:]) * (4 if dtype == "float32" else 2)
        total += shape[0] * row
        for r in range(new):
            lo, hi = engine_state.rows_of(r, new, shape[0])
            if hi <= lo:
                continue
            for q in range(old):
                slo, shi = engine_state.rows_of(q, old, shape[0])
                if slo < hi and lo < shi:
                    read += (shi - slo) * row
    return read / total


def render_doc(data: dict) -> str:
    info, facts, rows = data["generated"], data["machine"], data["rows"]
    size = data["size_gib"]
    env = facts["hpckpt_env"]
    by = {(r["key"], r["cache"]): r for r in rows}
    nbytes = data["tensor_bytes"]

    def w(key: str, cache: str = "warm") -> str:
        r = by.get((key, cache))
        return f"{r['wall']:.2f} s" if r and r.get("wall") else "n/a"

    checks = []
    for r in rows:
        if r["check"] is not None and r["cache"] == data["caches"][0]:
            checks.append(f"`{r['tool']} {r['operation']}` ({r['source']}): "
                          + ("every tensor element (and non-tensor value, where the format stores them) as expected" if not r["check"] else "MISMATCH: " + "; ".join(r["check"][:4])))
    torch_amp = torch_read_amplification(size, 4, 8)
    notes_line = ("\n(The profiles at the end were measured apart, with the helpers they name, and appended with "
                  f"`python bench/bench_engine.py --out {data.get('out', 'OUT')} --doc-only --notes {data.get('notes_file', 'NOTES')}`.)\n"
                  if data.get("notes") else "")
    probe = data.get("rss_probe")
    probe_section, probe_targets = "", []
    if probe:
        probe_section = (f"Memory with one big tensor (the target is for any checkpoint size, and the tensors above, a few MB "
                         f"each, never fill the tile budget): one fp32 tensor {probe['shape']} ({probe['bytes'] / 2**30:.2f} GiB, "
                         f"e.g. an embedding) written as safetensors and sharded onto 4 ranks by hpckpt (`--split ceil`), then "
                         f"measured like the rows above (warm, best of {data['repeat']}, highest RSS):\n\n" + probe_table(probe))
        probe_targets = [f"- peak RSS `{r['operation']}` (one {probe['bytes'] / 2**30:.2f} GiB tensor): {_fmt(r['rss_mib'], '.0f')} MiB "
                         f"(target < {TARGET_RSS_MIB}): {'met' if r['rss_mib'] is not None and r['rss_mib'] < TARGET_RSS_MIB else 'missed'}"
                         for r in probe["rows"]]
    text = f"""# Engine benchmark: hpckpt reshard and consolidate vs PyTorch and `cp -r`

Produced by

<!-- not run: a benchmark: minutes of run time and gigabytes of scratch data -->
```bash
{data['command']}
```

on {data['date']}, hpckpt at commit {facts['git']}{' + local changes' if facts['git_dirty'] else ''} (sources {facts['sources']}{'; every hpckpt process imported a `git archive` snapshot of that commit, so commits landing during the run did not mix in' if facts.get('snapshot') else ''}).
Machine: {facts['nproc']} cores ({facts['cpu']}), no GPU, Linux {facts['kernel']}, {facts['filesystem']} on one
virtual disk; Python {env.get('python', '?').split(' ')[0]}, torch {env.get('torch')}, numpy {env.get('numpy')},
safetensors {env.get('safetensors')}, hpckpt {env.get('hpckpt')}; {facts['cp']}. Load average
{data['load_before']} before and {data['load_after']} after the run (other sessions share the 2 cores).
{notes_line}
```text
$ free -g
{facts['free_g']}
```

## The checkpoint

{size} GiB of tensors ({nbytes:,} bytes: the numerator of every GB/s below) saved by real
`torch.distributed.checkpoint.save` under `torchrun --standalone --nproc-per-node 4` (gloo, CPU
DTensors on a 1-D mesh, `Shard(0)` with PyTorch's uneven ceil split): {len(engine_state.spec(size)) - 21} tensors of
about {nbytes / (len(engine_state.spec(size)) - 21) / 2**20:.1f} MiB (fp32 and bf16, 2-D and 3-D, row counts = 3 mod 8 so neither 4 nor 8 ranks
divide them) plus 20 small 1-D vectors, a [3, 64] tensor (fewer rows than ranks: empty shards), two
0-d tensors (int64, fp32) and four non-tensor values (int, str, float, list). Made by
`bench/torch_dcp_make.py` ({info['make']['dcp_save_s']:.1f} s inside `dcp.save`; the whole 4-rank job
{info['make_job_s']:.0f} s). Three copies of the same state:

| input | what | files | bytes |
|---|---|---|---|
| `torch-dcp` | `dcp.save` (FileSystemWriter): `.metadata` + `__{{r}}_0.distcp` | {info['files']['torch-dcp']} | {info['bytes']['torch-dcp']:,} |
| `hp` | HyperParallel DCP made from it by hpckpt: `{info['convert_command'].replace(str(ROOT) + '/', '')}` | {info['files']['hp']} | {info['bytes']['hp']:,} |
| `torch-hf-sharded` | the floating tensors again, saved with `HuggingFaceStorageWriter(save_distributed=True)` (input of PyTorch's safetensors consolidation) | {info['files']['torch-hf-sharded']} | {info['bytes']['torch-hf-sharded']:,} |

Checked before measuring: `hpckpt verify` passes on `torch-dcp` and `hp`; every element and value
of `hp` and of `torch-dcp` read back with hpckpt's reader equals the pattern, and so does every
element `dcp.load` puts on 8 ranks (`bench/torch_dcp_load.py --verify`). The HP copy is hpckpt's own
conversion because HyperParallel itself is not installed here; `--split ceil` keeps torch's 4-rank
layout, so both inputs hold the same shards.

## Results

Each row is its own process, timed from spawn to exit (Python start-up and imports included), best
of {data['repeat']} runs taken round-robin (the operations interleaved, so a burst of load from
another session does not hit all the runs of one row). Peak RSS: the highest sum of RSS over the
process tree seen by polling it with psutil every 20 ms (for torchrun jobs this includes the agent
and the 8 ranks, each with its own `import torch`; shared library pages count once per process),
and the largest single process (`/usr/bin/time -f %M`, i.e. `ru_maxrss` from `wait4`: exact). Both
are the highest of the runs.
`warm`: every input file read once just before the run; `cold`: the input files evicted with
`posix_fadvise(POSIX_FADV_DONTNEED)` just before (checked with `fincore`; Python, torch and hpckpt
themselves stay cached). `x cp -r` = wall of `cp -r` of the same input directory / this wall (>1:
faster than cp); `cp -r + sync` also fsyncs the copied files, as hpckpt (by default) and `dcp.save`
do; `cp`, `torch.save`, PyTorch's safetensors consolidation and hpckpt with `--no-fsync` do not. So
the like-for-like pairs are `cp -r + sync` with the fsynced hpckpt rows and `cp -r` with the
`--no-fsync` rows. "hpckpt faster by" = this wall
/ the wall of the hpckpt row named (same cache state). `torch-hf-sharded` rows are compared with
`cp -r` of `torch-dcp` (the same bytes within 0.1%). In brackets: time inside the script around `dcp.load` /
`dcp.save` (barrier to barrier, slowest rank) or around the consolidation call.

{markdown_table(rows)}

{probe_section}

Outputs, each checked once (untimed) against the pattern with an independent reader (safetensors'
`safe_open`, `torch.load`, or hpckpt's reader for HyperParallel output):

{chr(10).join('- ' + c for c in checks)}

## Targets

{chr(10).join(targets(rows) + probe_targets)}

## What each tool does

**`cp -r`** (coreutils, `copy_file_range` on ext4): the floor for moving these bytes once, read and
write, no parsing. Without `sync` the written pages are only dirtied in the page cache (at this
size the kernel's background writeback, `dirty_background_ratio` 10%, barely starts before cp
ends), so it measures memory bandwidth. `cp -r + sync` adds an fsync per file and so includes the
disk write, like every tool here that fsyncs.

**Reshard 4 -> 8.** `hpckpt reshard SRC -o OUT --world-size 8` plans every target box from the
metadata (an interval index over the source chunks), then fills each target rank's safetensors file
in place, tile by tile (a tile: whole rows, at most the tile budget). When every piece of a tile
is one contiguous byte run both in its source chunk and in the output, the pieces are copied by
the kernel with `copy_file_range` (no user-space buffer); otherwise the tile is gathered with
ranged `preadv`s into the worker's tile buffer (`--max-memory`, split across the workers) and
written with one `pwrite`. Target files are written in parallel, one per thread, `min(8, cores)`
threads (2 here); writeback of each file is started when it is complete (`sync_file_range`), all
are fsynced at the end (unless `--no-fsync`), then the metadata, then the staging directory is
renamed into place. From `torch-dcp` the source chunks are tensor records inside the `.distcp`
zip containers; hpckpt reads only their zip directories and the bytes each target box needs. PyTorch has no offline reshard: its way is to start the new world size
(`torchrun --nproc-per-node 8`), allocate the target DTensors and `dcp.load` them, which on each
rank plans read items against the global metadata (a sweep over sorted chunks in 2.13), then
for every read item `torch.load`s the *whole* source record from a slice of the `.distcp` file,
narrows it and copies the rows it needs into the DTensor's local tensor. A source chunk is thus read
in full by every target rank whose rows it touches: {torch_amp:.2f}x the checkpoint's bytes for
4 -> 8 here (computed from the layouts), against 1.00x for hpckpt, which reads only the byte ranges
each target box needs. Wall time is dominated by starting 8 Python processes that each import
torch on 2 cores; the in-script load time (in brackets) shows
the part that is I/O. The load alone leaves the data in 8 processes' memory, not on disk: the
`+ dcp.save` row is what writing the resharded checkpoint costs PyTorch (fsynced, like hpckpt).

**Consolidate.** `hpckpt consolidate SRC -o x.safetensors` plans each tensor whole and writes one
safetensors file in place with the same engine as reshard (one file, so one writer thread and the
whole `--max-memory` as tile budget). A whole tensor is its 4 row shards, each a contiguous run in
its chunk and in the output, so it is copied by 4 `copy_file_range` calls, with no user-space
buffer; writeback of the file is started when it is complete, then it is fsynced.
`--format pt` streams a torch.save zip archive (stored, 64-byte aligned records, CRC-32 computed on
the way) tensor by tensor through the worker's reused tile buffer (`preadv`, `zlib.crc32`, buffered
`write`), so it moves every byte through user space.
`dcp_to_torch_save` (`torch.distributed.checkpoint.format_utils`) runs a no-process-group
`dcp.load` of the *whole* state into memory (every tensor allocated full size, every record read
and `torch.load`ed), then `torch.save` writes it: peak RSS is the checkpoint size plus torch
(~{by.get(('torch-dcp-to-pt', 'warm'), {}).get('single_mib') or 0:.0f} MiB here), and it does not fsync.
`consolidate_safetensors_files` (`torch.distributed.checkpoint._consolidate_hf_safetensors`, what
`HuggingFaceStorageWriter(enable_consolidation=True)` calls) can only read sharded safetensors
written by `HuggingFaceStorageWriter` with DCP's offsets in their headers, not a normal DCP
checkpoint (hence the separate `torch-hf-sharded` input). For each output tensor it allocates a
`bytearray` of the full tensor, reads every input shard of it with `f.read`, copies the rows in with
Python slicing, and appends it to the output with one `write`; no fsync. It is single-threaded
by default and its memory is one whole tensor (a few MB here, but the largest tensor of a real
model, e.g. an embedding, in general). Found while setting this up (PyTorch 2.13): it raises
`TypeError: torch.finfo() requires a floating point input type` on any integer tensor (so the
int64 0-d tensor is left out of its input), it writes every 0-d tensor as 0 (its row copier
returns early for shape `[]` and the zeroed buffer is written: the check above shows it), and the
HF writer accepts non-tensor values and writes a corrupt file (so they are left out too).
"""
    if data.get("notes"):
        text += "\n" + data["notes"].strip() + "\n"
    return text


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.5)
    parser.add_argument("--out", type=Path, default=HERE / "out" / "engine")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", default="warm,cold", help="warm, cold or warm,cold")
    parser.add_argument("--only", default="", help="comma-separated operation keys (debugging)")
    parser.add_argument("--no-torch-save", action="store_true", help="skip the torch load + dcp.save row")
    parser.add_argument("--no-verify", action="store_true", help="do not check the outputs")
    parser.add_argument("--regenerate", action="store_true")
    parser.add_argument("--generate-only", action="store_true", help="make and check the inputs, measure nothing")
    parser.add_argument("--working-tree", action="store_true",
                        help="measure the working tree as installed, not a snapshot of HEAD")
    parser.add_argument("--rss-probe-gib", type=float, default=1.0,
                        help="size of the one-tensor checkpoint of the RSS probe (0: skip it)")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks-engine.md")
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument("--doc-only", action="store_true", help="rewrite the doc from OUT/results.json")
    parser.add_argument("--notes", type=Path, help="Markdown appended to the doc under 'Notes'")
    parser.add_argument("--throttle", metavar="BYTES_PER_S:IOPS",
                        help="run every measured command in a blkio cgroup limiting its disk writes (root; "
                             "e.g. 650e6:1000); implies --no-doc; raw numbers go to OUT/results-throttled.json")
    parser.add_argument("--check", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--check-skip", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        kind, path = args.check
        kwargs = {"skip": tuple(args.check_skip)} if args.check_skip else {}
        print(json.dumps(CHECKS[kind](Path(path), args.size_gib, **kwargs)))
        return 0

    work = args.out.resolve()
    results_path = work / "results.json"
    if args.doc_only:
        data = json.loads(results_path.read_text())
        if args.notes:
            data["notes"] = args.notes.read_text()
            data["notes_file"] = os.path.relpath(args.notes, ROOT)
            data["out"] = os.path.relpath(work, ROOT)
        args.doc.write_text(render_doc(data))
        print(f"wrote {args.doc}")
        return 0

    argv_shown = ["python", "bench/bench_engine.py"] + (sys.argv[1:] if argv is None else argv)
    load_before = load_avg()
    work.mkdir(parents=True, exist_ok=True)
    if not args.working_tree:
        use_snapshot(work)
    info = generate(work, args.size_gib, args.regenerate)
    if args.generate_only:
        print(json.dumps(info["checks"]))
        return 0
    if args.throttle:
        global THROTTLE
        THROTTLE = throttle_writes(args.throttle, work)
        args.no_doc = True
        results_path = work / "results-throttled.json"
        print(f"writes throttled to {args.throttle} (bytes/s:IOPS) in {THROTTLE}", flush=True)
    ops = operations(args.size_gib, work / "scratch", not args.no_torch_save)
    if args.only:
        wanted = set(args.only.split(","))
        ops = [op for op in ops if op.key in wanted or op.key.startswith("cp")]
    caches = [c for c in args.cache.split(",") if c]
    print(f"measuring {len(ops)} operations x {len(caches)} cache states x {args.repeat} runs", flush=True)
    results = run_all(ops, work, info, args.size_gib, caches, args.repeat, not args.no_verify)
    probe = None
    if args.rss_probe_gib > 0:
        print(f"RSS probe: one {args.rss_probe_gib} GiB tensor", flush=True)
        probe = rss_probe(work, args.rss_probe_gib, args.repeat)
    nbytes = engine_state.tensor_bytes(args.size_gib)
    op_docs = {op.key: {"tool": op.tool, "operation": op.operation, "source": op.source} for op in ops}
    result_docs = [asdict(r) for r in results]
    order = {op.key: i for i, op in enumerate(ops)}
    result_docs.sort(key=lambda r: (caches.index(r["cache"]), order[r["key"]]))
    rows = build_rows(result_docs, op_docs, nbytes)
    data = {
        "command": shlex.join(argv_shown),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "size_gib": args.size_gib,
        "tensor_bytes": nbytes,
        "repeat": args.repeat,
        "caches": caches,
        "load_before": load_before,
        "load_after": load_avg(),
        "generated": info,
        "machine": machine_facts(),
        "results": result_docs,
        "rows": rows,
        "rss_probe": probe,
        "notes": args.notes.read_text() if args.notes else "",
        "throttle": args.throttle,
    }
    results_path.write_text(json.dumps(data, indent=1))
    if THROTTLE is not None:
        THROTTLE.rmdir()  # every measured process has ended, so the group is empty
    print()
    print(markdown_table(rows))
    print()
    if probe:
        print(probe_table(probe))
        print()
    print("\n".join(targets(rows)))
    if not args.no_doc:
        args.doc.write_text(render_doc(data))
        print(f"\nwrote {args.doc} (raw numbers in {results_path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
