"""Run every command of the catalogue's cases (`tests/hostile_catalogue.py`) in this one process.

    python tests/hostile_driver.py MANIFEST.json RESULTS.json WORKDIR

The address space is capped at 4 GiB first (a reader that allocates what a hostile header
declares fails here, not on a user's machine), torch is never imported, and each command runs
through `hpckpt.cli.app.run()` with `sys.argv` set, its file descriptors 1 and 2 redirected to
files (so whatever writes to them is caught), under a wall-clock budget (SIGALRM): a command
that blocks (a FIFO opened for reading) is stopped and recorded as `"timeout"`. Writing commands
get a fresh empty parent directory for their destination, listed afterwards (no destination and
no staging may be left by a failed run).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

BUDGET_SECONDS = 5.0
COMMANDS = {
    "inspect": ["inspect", "{src}"],
    "inspect-json": ["inspect", "--json", "{src}"],
    "verify": ["verify", "{src}"],
    "verify-json": ["verify", "--json", "{src}"],
    "reshard": ["reshard", "{src}", "-o", "{out}/dst", "--world-size", "2"],
    "consolidate": ["consolidate", "{src}", "-o", "{out}/dst.safetensors"],
    "convert": ["convert", "{src}", "--to", "pt", "-o", "{out}/dst.pt"],
}


class Timeout(BaseException):
    """Raised by SIGALRM: a BaseException, so that no `except Exception` in hpckpt swallows it."""


def _alarm(signum, frame):
    raise Timeout()


def limit_memory() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = 4 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))


def run_one(args: list[str], scratch: Path) -> dict:
    """One command in this process: exit code, stdout, stderr, seconds, timed out or not."""
    from hpckpt.cli.app import run

    out_path, err_path = scratch / "stdout", scratch / "stderr"
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    sys.argv = ["hpckpt", *args]
    started = time.perf_counter()
    code, timed_out = None, False
    signal.setitimer(signal.ITIMER_REAL, BUDGET_SECONDS)
    try:
        code = run()
    except Timeout:
        timed_out = True
    except BaseException as exc:  # noqa: BLE001 - recorded, judged by the test
        code = f"escaped {type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    return {"args": args, "code": code, "timeout": timed_out, "seconds": round(time.perf_counter() - started, 3),
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


def memoise_typer() -> None:
    """typer rebuilds the click command tree on every call of the app (45 ms of a 50 ms run, by
    cProfile); it never changes between runs, so the driver builds it once."""
    import typer.main

    built = {}
    original = typer.main.get_command

    def get_command(typer_instance):
        if id(typer_instance) not in built:
            built[id(typer_instance)] = original(typer_instance)
        return built[id(typer_instance)]

    typer.main.get_command = get_command


def main() -> int:
    manifest_path, results_path, work = sys.argv[1:4]
    limit_memory()
    memoise_typer()
    signal.signal(signal.SIGALRM, _alarm)
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
