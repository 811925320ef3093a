"""Run every command of the catalogue's cases (`tests/hostile_catalogue.py`) in this one process.

    python tests/hostile_driver.py MANIFEST.json RESULTS.json WORKDIR

The address space is capped at 4 GiB first (a reader that allocates what a hostile header
declares fails here, not on a user's machine), torch is never imported, each command's peak
resident memory is recorded (`peak_mib`, the process's VmHWM reset before it), and each command runs
through `hpckpt.cli.app.run()` with `sys.argv` set, its file descriptors 1 and 2 redirected to
files (so whatever writes to them is caught), under a wall-clock budget (SIGALRM): a command
that blocks (a FIFO opened for reading) is stopped and recorded as `"timeout"`. Writing commands
get a fresh empty parent directory for their destination, listed afterwards (no destination and
no staging may be left by a failed run).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from inprocess import install_alarm, limit_memory, memoise_typer, peak_mib, run_redirected, start_peak

BUDGET_SECONDS = 5.0
COMMANDS = {
    "inspect": ["inspect", "{src}"],
    "inspect-json": ["inspect", "--json", "{src}"],
    "verify": ["verify", "{src}"],
    "verify-json": ["verify", "--json", "{src}"],
    "verify-deep": ["verify", "--deep", "--nan", "{src}"],
    "reshard": ["reshard", "{src}", "-o", "{out}/dst", "--world-size", "2"],
    "consolidate": ["consolidate", "{src}", "-o", "{out}/dst.safetensors"],
    "convert": ["convert", "{src}", "--to", "pt", "-o", "{out}/dst.pt"],
    "diff": ["diff", "{src}", "{src}"],
}


def run_one(args: list[str], scratch: Path) -> dict:
    """One command in this process: exit code, stdout, stderr, seconds, timed out or not."""
    from hpckpt.cli.app import run

    out_path, err_path = scratch / "stdout", scratch / "stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        start_peak()
        code, timed_out, seconds = run_redirected(run, args, out.fileno(), err.fileno(), BUDGET_SECONDS)
        peak = peak_mib()
    return {"args": args, "code": code, "timeout": timed_out, "seconds": round(seconds, 3), "peak_mib": round(peak, 1),
            "stdout": out_path.read_bytes().decode("utf-8", "backslashreplace"),
            "stderr": err_path.read_bytes().decode("utf-8", "backslashreplace")}


def run_case(name: str, spec: dict, work: Path) -> dict:
    results = {}
    for command, template in COMMANDS.items():
        out = work / name / command
        out.mkdir(parents=True)
        args = [a.format(src=spec["path"], out=out) for a in template]
        result = run_one(args, work)
        result["left"] = sorted(p.name for p in out.iterdir())
        results[command] = result
    return results


def main() -> int:
    manifest_path, results_path, work = sys.argv[1:4]
    limit_memory()
    memoise_typer()
    install_alarm()
    os.environ.setdefault("HPCKPT_CACHE_DIR", tempfile.mkdtemp(prefix="hpckpt-hostile-cache-"))
    os.environ["COLUMNS"] = "200"
    manifest = json.loads(Path(manifest_path).read_text())
    work_dir = Path(work)
    started = time.perf_counter()
    results = {name: run_case(name, spec, work_dir) for name, spec in manifest.items()}
    report = {"seconds": round(time.perf_counter() - started, 2), "torch_imported": "torch" in sys.modules,
              "cases": results}
    Path(results_path).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
