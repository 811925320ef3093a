"""The files through which the workers of `hpckpt run` talk to the `run` process that launched them.

Files, not pipes or sockets: the launcher (torchrun, msrun) sits between the two and owns the
workers' standard streams, and several nodes may share nothing but a directory. In the run
directory, per rank r:

- `rank-{r}.log`: the worker's own stdout/stderr (tracebacks included);
- `status-{r}.json`: `{"rank", "state": running|ok|failed, "kind", "exit_code", "error", "time"}`;
- `progress-{r}.json`: `{"done", "total", "phase"}` in bytes, rewritten at most ~5 times a second;
- `result-{r}.json`: the job's figures for this rank (a reshard's writing rank adds its share's
  `RESULT_NOTES`: what its output leaves out, converts or warns of; the report says them once).

Every JSON file is written aside and renamed, so a reader sees the previous or the next version,
never half of one. Framework-free: the CLI and the workers both import it.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpckpt.core.commit import replace

RUNNING, OK, FAILED = "running", "ok", "failed"
PROGRESS_INTERVAL = 0.2  # seconds between two rewrites of a progress file
RESULT_NOTES = ("skipped", "converted", "warnings")  # a reshard result's lists, as its one-process report's
_RANK_FILE = re.compile(r"(status|progress|result)-(\d+)\.json")


def log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank-{rank}.log"


def status_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"status-{rank}.json"


def progress_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"progress-{rank}.json"


def result_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"result-{rank}.json"


def write_json(path: Path, document: Any) -> None:
    """Replaced whole: readers polling the file never see a partial document."""
    replace.write_json(Path(path), document, ensure_ascii=False)


read_json = replace.read_json


def write_status(run_dir: Path, rank: int, state: str, *, kind: str | None = None,
                 exit_code: int | None = None, error: str | None = None, **extra: Any) -> None:
    """`extra`: what else helps the parent (the worker adds its `pid` and `host`)."""
    write_json(status_path(run_dir, rank), {"rank": rank, "state": state, "kind": kind, "exit_code": exit_code,
                                            "error": error, "time": time.time(), **extra})


class ProgressFile:
    """A rank's progress (the `start(total)` / `advance(n)` protocol of `core.io.write.Progress`),
    kept in `progress-{r}.json`; rewritten at most every PROGRESS_INTERVAL seconds so a copy of
    millions of small chunks does not turn into millions of renames. The copy engine advances it
    from its worker threads, hence the lock. A second `start` adds to the total (a job of two
    copies)."""

    def __init__(self, run_dir: Path, rank: int):
        self.path = progress_path(run_dir, rank)
        self.done = 0
        self.total = 0
        self.phase_text = ""
        self._written_at = 0.0
        self._lock = threading.Lock()

    def start(self, total: int) -> None:
        with self._lock:
            self.total += int(total)
            self._write(force=True)

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += int(n)
            self._write()

    def phase(self, text: str) -> None:
        with self._lock:
            self.phase_text = text
            self._write(force=True)

    def flush(self) -> None:
        with self._lock:
            self._write(force=True)

    def _write(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._written_at < PROGRESS_INTERVAL:
            return
        self._written_at = now
        write_json(self.path, {"done": self.done, "total": self.total, "phase": self.phase_text})


@dataclass
class RankFiles:
    """What one rank has left in the run directory so far (None: not written yet)."""

    rank: int
    status: dict | None = None
    progress: dict | None = None
    result: Any | None = None

    @property
    def state(self) -> str | None:
        return (self.status or {}).get("state")


@dataclass
class RunFiles:
    """Every rank's files of one run directory, read in one pass."""

    ranks: dict[int, RankFiles] = field(default_factory=dict)

    def failed(self) -> list[RankFiles]:
        return [r for r in self.ranks.values() if r.state == FAILED]

    def progress(self) -> tuple[int, int]:
        """Bytes done and total, summed over the ranks."""
        done = sum(int((r.progress or {}).get("done", 0)) for r in self.ranks.values())
        total = sum(int((r.progress or {}).get("total", 0)) for r in self.ranks.values())
        return done, total

    def phase(self, rank: int = 0) -> str:
        files = self.ranks.get(rank)
        return str((files.progress or {}).get("phase") or "") if files else ""


def read_run(run_dir: Path, *, results: bool = True) -> RunFiles:
    """Read every rank's status, progress (and result) files; a missing directory reads as empty."""
    run = RunFiles()
    try:
        names = os.listdir(run_dir)
    except OSError:
        return run
    for name in names:
        match = _RANK_FILE.fullmatch(name)
        if match is None or (match.group(1) == "result" and not results):
            continue
        rank = int(match.group(2))
        files = run.ranks.setdefault(rank, RankFiles(rank))
        setattr(files, match.group(1), read_json(Path(run_dir) / name))
    run.ranks = dict(sorted(run.ranks.items()))
    return run
