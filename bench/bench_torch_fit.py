"""hpckpt inside torch DCP against torch's own storage, in one run: `format="torch-dcp"` and
`HpckptWriter` against `FileSystemWriter`; `HpckptReader` against `FileSystemReader`.

    python bench/bench_torch_fit.py                       # 1 GiB, 4 ranks, 4 rounds (the 1st a warm-up)
    python bench/bench_torch_fit.py --size-gib 0.25 --rounds 3 --keep

Launches `bench/torch_fit_job.py` twice under torchrun (save, then load; what each contender does
is in its docstring), then prints, per contender, the best and the median of the timed rounds and
the ratio of its median to torch's own in the same run (below 1.00: faster than torch).
Needs about 5x the state's size free under --work (removed unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = {"save": "dcp-save", "load": "dcp-load"}


def torchrun(ranks: int, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(HERE / "torch_fit_job.py"), *args]
    subprocess.run(command, check=True, env=env)


def table(report: dict, mode: str) -> list[str]:
    timed = [r for r in report["rows"] if r["round"] > 0]  # round 0: the warm-up
    steps = list(dict.fromkeys(r["step"] for r in timed))
    medians = {s: statistics.median(r["seconds"] for r in timed if r["step"] == s) for s in steps}
    peer = medians[PEERS[mode]]
    lines = [f"{mode} ({report['world']} ranks, {report['size_gib']} GiB, {len(timed) // len(steps)} timed rounds)",
             f"  {'contender':24} {'best s':>8} {'median s':>9} {'vs torch':>9}  notes"]
    for step in steps:
        rows = [r for r in timed if r["step"] == step]
        notes = []
        if "rchar" in rows[0]:
            notes.append(f"read {statistics.median(r['read_bytes'] for r in rows) / 2**30:.2f} GiB from disk")
        checks = [r["mismatches"] for r in report["rows"] if r["step"] == step and "mismatches" in r]
        if checks:
            notes.append(f"{sum(map(len, checks))} mismatches" if any(checks) else "values checked")
        if rows[0].get("bytes_on_disk"):
            notes.append(f"{rows[0]['bytes_on_disk'] / 2**30:.2f} GiB on disk")
        lines.append(f"  {step:24} {min(r['seconds'] for r in rows):8.3f} {medians[step]:9.3f} "
                     f"{medians[step] / peer:8.2f}x  {', '.join(notes)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpckpt-bench-torch-fit"))
    parser.add_argument("--json", type=Path, default=None, help="also write both reports here")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    reports = {}
    try:
        for mode in ("save", "load"):
            report = args.work / f"{mode}.json"
            torchrun(args.ranks, mode, "--size-gib", str(args.size_gib), "--work", str(args.work),
                     "--rounds", str(args.rounds), "--report", str(report))
            reports[mode] = json.loads(report.read_text())
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print()
    for mode in ("save", "load"):
        print("\n".join(table(reports[mode], mode)))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
