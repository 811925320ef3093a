"""Running `hpckpt` many times in one process, as the hostile-input drivers do: under a 4 GiB
address-space cap, with fds 1 and 2 on scratch files, a wall-clock budget and the peak resident
memory of each run."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import re
import resource
import signal
import sys
import time
from collections.abc import Callable


class Timeout(BaseException):
    """Raised by SIGALRM: a BaseException, so that no `except Exception` in hpckpt swallows it."""


def _alarm(signum, frame):
    raise Timeout()


def limit_memory() -> None:
    """At most 4 GiB of address space: a memory bomb fails here instead of taking the machine."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = 4 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))


#: The peak resident memory every command must stay under on any input up to 1 MiB, hostile or
#: damaged (the drivers' runs are judged against it).
MEMORY_MIB = 512

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def start_peak() -> None:
    """Forget the process's peak resident memory so far (`VmHWM`), after handing the memory the
    previous runs freed back to the system, so that `peak_mib()` measures the next run alone."""
    gc.collect()
    _libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)


def peak_mib() -> float:
    """The peak resident memory since `start_peak()`, in MiB."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) / 1024


def install_alarm() -> None:
    signal.signal(signal.SIGALRM, _alarm)


def run_redirected(run_app: Callable[[], int], args: list[str], out_fd: int, err_fd: int,
                   budget: float) -> tuple[object, bool, float]:
    """`hpckpt ARGS` with stdout/stderr on `out_fd`/`err_fd`: (exit code, or what escaped;
    timed out; seconds)."""
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.argv = ["hpckpt", *args]
    started = time.perf_counter()
    code, timed_out = None, False
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        code = run_app()
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
    return code, timed_out, time.perf_counter() - started


def memoise_typer() -> None:
    """typer rebuilds the click command tree on every call of the app (45 ms of a 50 ms run, by
    cProfile); it never changes between runs, so a driver builds it once."""
    import typer.main

    built = {}
    original = typer.main.get_command

    def get_command(typer_instance):
        if id(typer_instance) not in built:
            built[id(typer_instance)] = original(typer_instance)
        return built[id(typer_instance)]

    typer.main.get_command = get_command
