"""Run the hpckpt command line with its file-system calls counted, and act at one exact call.

Crash points are chosen by number without touching the code under test: the calls below are
wrapped in the process that runs the command, numbered in the order they are made, and at call N
the harness SIGKILLs its own process (before the call is made), pauses it until the test lets it
go on, drops a marker file, or fails the call with an errno (an injected full disk). `--slow`
makes every data write take that long: a slow disk, so that a signal lands in the middle.

As a script (a fresh process, start-up included):

    python tests/kill_harness.py [--kill-at N] [--pause-at P] [--mark-at P] [--fail-at P]
                                 [--dir D] [--slow SECONDS] -- reshard SRC -o DST ...

where P is N or NAME:K (the K-th call of NAME, e.g. pwrite:1). `--pause-at` writes D/paused
(holding the pid) and waits for D/resume; `--mark-at` writes D/marked and goes on.

From a test (`start`/`finish`): the test process forks, so that the hundreds of runs of a kill
sweep do not each pay for starting Python and importing hpckpt; the child reports how many calls
it made through a pipe.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WRAPPED = ("write", "pwrite", "copy_file_range", "fsync", "replace", "rename", "rmdir", "ftruncate",
           "posix_fallocate", "mkdir", "link", "unlink")
SLOWED = ("write", "pwrite", "copy_file_range")
_REAL = {name: getattr(os, name) for name in WRAPPED if hasattr(os, name)}


@dataclass
class Point:
    """Call `number` overall, or the `number`-th call of `name`."""

    number: int
    name: str | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Point | None":
        if text is None:
            return None
        name, _, number = text.rpartition(":")
        return cls(int(number), name or None)


@dataclass
class Actions:
    kill_at: Point | None = None
    pause_at: Point | None = None
    mark_at: Point | None = None
    fail_at: Point | None = None
    fail_errno: int = errno.ENOSPC
    folder: Path | None = None
    slow: float = 0.0


class _Counter:
    def __init__(self, actions: Actions):
        self.actions = actions
        self.total = 0
        self.by_name: dict[str, int] = {}
        self.lock = threading.Lock()

    def _hit(self, point: Point | None, name: str, total: int, nth: int) -> bool:
        return point is not None and (point.number == nth if point.name == name else
                                      point.name is None and point.number == total)

    def before(self, name: str) -> None:
        a = self.actions
        with self.lock:
            self.total += 1
            nth = self.by_name[name] = self.by_name.get(name, 0) + 1
            total = self.total
        if a.slow and name in SLOWED:
            time.sleep(a.slow)
        if self._hit(a.kill_at, name, total, nth):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._hit(a.mark_at, name, total, nth):
            _note(a.folder / "marked")
        if self._hit(a.pause_at, name, total, nth):
            _note(a.folder / "paused")
            while not (a.folder / "resume").exists():
                time.sleep(0.005)
        if self._hit(a.fail_at, name, total, nth):
            raise OSError(a.fail_errno, os.strerror(a.fail_errno))


def _note(path: Path) -> None:
    """A marker file the test waits for, written with the real calls (uncounted)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _REAL["write"](fd, f"{os.getpid()}\n".encode())
    os.close(fd)


def install(actions: Actions) -> _Counter:
    """Wrap the calls in this process; every later call goes through the counter."""
    counter = _Counter(actions)

    def wrap(name: str, real):
        def wrapped(*args, **kwargs):
            counter.before(name)
            return real(*args, **kwargs)
        return wrapped

    for name, real in _REAL.items():
        setattr(os, name, wrap(name, real))
    return counter


def _run_cli(argv: list[str]) -> int:
    from hpckpt.cli.app import run

    sys.argv = ["hpckpt", *argv]
    return run()


# -- forked from a test ---------------------------------------------------------------------


@dataclass
class Child:
    pid: int
    report: int  # read end of the pipe the child writes its call count to


def start(argv: list[str], actions: Actions = Actions(), stderr: Path | None = None) -> Child:
    """Fork a child that runs `hpckpt ARGV` with the calls counted and `actions` taken."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test
        code = 1
        try:
            os.close(read_end)
            quiet = os.open(os.devnull, os.O_RDWR)
            os.dup2(quiet, 0)
            os.dup2(quiet, 1)
            os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if stderr else quiet, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            counter = install(actions)
            code = _run_cli(argv)
            sys.stderr.flush()
            _REAL["write"](write_end, str(counter.total).encode())
        finally:
            os._exit(code)  # a forked child, which the test may kill on purpose: never the parent's teardown
    os.close(write_end)
    return Child(pid, read_end)


def finish(child: Child) -> tuple[int, int | None]:
    """Wait for a child: `(exit code, or -signal if killed; calls made, None if it was killed)`."""
    _, status = os.waitpid(child.pid, 0)
    data = b""
    while chunk := os.read(child.report, 64):
        data += chunk
    os.close(child.report)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    return code, int(data) if data else None


def run(argv: list[str], actions: Actions = Actions(), stderr: Path | None = None) -> tuple[int, int | None]:
    return finish(start(argv, actions, stderr))


# -- as a script ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for option in ("--kill-at", "--pause-at", "--mark-at", "--fail-at"):
        parser.add_argument(option)
    parser.add_argument("--errno", default="ENOSPC")
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    sys.argv = ["hpckpt", *argv]
    from hpckpt.cli import _signals

    _signals.install_early()  # as the console script does, before hpckpt.cli.app is imported
    install(Actions(Point.parse(args.kill_at), Point.parse(args.pause_at), Point.parse(args.mark_at),
                    Point.parse(args.fail_at), getattr(errno, args.errno), args.dir, args.slow))
    code = _run_cli(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (a harness around the CLI: the kill points it installs are not torn down)


if __name__ == "__main__":
    main()
