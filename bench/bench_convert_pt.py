"""`convert -o X.pt` (a torch.save file) against `convert -o X.safetensors`, on the same bytes.

Both write every tensor of one source into one file; the torch.save file is a zip archive, so it
also needs each tensor's CRC-32 and a data descriptor after it. The goal is `pt` within 1.2x of
`safetensors`. A HyperParallel checkpoint of `--size-mib` MiB on 4 ranks (row-sharded bfloat16
and float32 tensors of about `--tensor-kib` KiB each: small ones give many zip members) is
converted to both, fsynced and with `--no-fsync`, in `--rounds` interleaved rounds (the order of
the two targets alternates: this VM's memory is slow the first time pages are touched, and a
neighbour's load comes and goes). Prints a Markdown table of medians: wall seconds of each
command (imports included), their ratio (median of the per-round ratios), the fastest round of
each, each one's user CPU seconds (steadier than wall time here: a run that lands on memory the
host took back spends its extra time in the kernel), each one's peak RSS, and the load average
at the start and the end.

    python bench/bench_convert_pt.py --size-mib 600 --rounds 5
    python bench/bench_convert_pt.py --size-mib 600 --tensor-kib 512 --rounds 5   # ~1,200 tensors
    python bench/bench_convert_pt.py --src CKPT --rounds 5                        # any source
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HPCKPT = [sys.executable, "-m", "hpckpt"]
TARGETS = ("safetensors", "pt")


def make_source(root: Path, size_mib: float, tensor_kib: int) -> None:
    """A HyperParallel checkpoint on 4 ranks, each tensor split by rows over the ranks."""
    import numpy as np

    from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
    from hpckpt.core import dtypes
    from hpckpt.core.geometry.box import Box

    rng = np.random.default_rng(0)
    cols = 512
    rows = max(4, tensor_kib * 1024 // (cols * 2) // 4 * 4)  # bfloat16 rows; float32 ones are twice the bytes
    tensors, left, i = {}, int(size_mib * 2**20), 0
    while left > 0:
        bf16 = i % 2 == 0
        array = (rng.integers(0, 2**16, (rows, cols), dtype=np.uint16) if bf16
                 else rng.standard_normal((rows // 2, cols), dtype=np.float32))
        quarter = array.shape[0] // 4
        tensors[f"layers.{i}.weight"] = (dtypes.dtype("bfloat16" if bf16 else "float32"), array.shape, [
            ChunkData(r, Box((r * quarter, 0), (quarter, cols)), array[r * quarter:(r + 1) * quarter].tobytes())
            for r in range(4)])
        left -= array.nbytes
        i += 1
    write_checkpoint(root, tensors, {"step": (0, 1)})


def run_once(src: Path, out: Path, flags: list[str]) -> tuple[float, float, int]:
    """Wall seconds, user CPU seconds and peak RSS (bytes) of one `convert` process (this process
    stays small: a child's peak counts what it held before its exec)."""
    for path in out.parent.glob(out.stem + ".*"):  # the last run's output, manifest, values sidecar
        path.unlink()
    started = time.perf_counter()
    process = subprocess.Popen([*HPCKPT, "convert", str(src), "-o", str(out), "--quiet", "--no-progress", *flags])
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"convert -o {out.name} {' '.join(flags)} exited {process.returncode}")
    return seconds, usage.ru_utime, usage.ru_maxrss * 1024


Runs = dict[str, list[tuple[float, float, int]]]  # per target: (wall s, user CPU s, peak RSS) per round


def measure(src: Path, scratch: Path, flags: list[str], rounds: int) -> Runs:
    """Every round runs both targets, alternating which goes first."""
    runs: Runs = {t: [] for t in TARGETS}
    for r in range(rounds):
        for target in (TARGETS if r % 2 == 0 else TARGETS[::-1]):
            runs[target].append(run_once(src, scratch / f"out-{target}.{target}", flags))
    return runs


def row(label: str, size: int, runs: Runs) -> str:
    st, pt = ([wall for wall, _, _ in runs[t]] for t in TARGETS)
    user = {t: statistics.median(u for _, u, _ in runs[t]) for t in TARGETS}
    rss = {t: max(m for _, _, m in runs[t]) / 2**20 for t in TARGETS}
    ratio = statistics.median(p / s for p, s in zip(pt, st))
    rounds = ", ".join(f"{s:.2f}/{p:.2f}" for s, p in zip(st, pt))
    return (f"| {label} | {size / 2**20:.0f} | {statistics.median(st):.2f} | {statistics.median(pt):.2f} | "
            f"**{ratio:.2f}** | {min(st):.2f} / {min(pt):.2f} | {user['safetensors']:.2f} / {user['pt']:.2f} | "
            f"{rss['safetensors']:.0f} / {rss['pt']:.0f} | {rounds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=600)
    parser.add_argument("--tensor-kib", type=int, default=16 * 1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--src", type=Path, help="convert this checkpoint instead of making one")
    parser.add_argument("--scratch", default=tempfile.gettempdir())
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hpckpt-bench-convert-pt-", dir=args.scratch))
    try:
        src = args.src
        if src is None:
            src = scratch / "src"
            maker = multiprocessing.get_context("spawn").Process(target=make_source,
                                                                 args=(src, args.size_mib, args.tensor_kib))
            maker.start()
            maker.join()  # in another process, so that its arrays never count in this one's children
            if maker.exitcode != 0:
                raise SystemExit("making the source failed")
        load_start = os.getloadavg()
        results = [(label, measure(src, scratch, flags, args.rounds))
                   for label, flags in (("fsynced", []), ("--no-fsync", ["--no-fsync"]))]
        load_end = os.getloadavg()
        size = (scratch / "out-pt.pt").stat().st_size
        print(f"`convert SRC -o OUT.{{safetensors,pt}}`, medians of {args.rounds} interleaved rounds "
              f"({os.cpu_count()} cores)\n")
        print("| write | pt size MiB | safetensors s | pt s | pt / safetensors | fastest st / pt s "
              "| user CPU st / pt s | peak RSS st / pt MiB | every round (st/pt s) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, runs in results:
            print(row(label, size, runs))
        print(f"\nload average (1, 5, 15 min): start {', '.join(f'{x:.2f}' for x in load_start)}; "
              f"end {', '.join(f'{x:.2f}' for x in load_end)}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
