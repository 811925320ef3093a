"""The launcher's process tree, read from /proc, and stopping all of it at once (a job's ranks
live and die together)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

STOP_GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL


def _process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, start time) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "(comm)", which may hold spaces
        table[int(entry)] = (int(fields[1]), fields[0], fields[19])
    return table


def descendants(root: int) -> dict[int, str]:
    """Every process under `root` (pid -> start time). msrun puts each worker in a session of
    its own, so killing the launcher's process group does not reach them (measured): they are
    followed through the process tree instead."""
    if not os.path.isdir("/proc"):
        return {}
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][2]
        todo.extend(children.get(pid, []))
    return found


def _alive(pid: int, started: str | None) -> bool:
    """Running, and still the process we saw (not a reused pid, not a zombie left unreaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] not in ("Z", "X") and (started is None or fields[19] == started)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_job(launcher: Any, known: dict[int, str], grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM to the launcher's process group and every process seen under it, SIGKILL to what
    is left after `grace` seconds; the launcher is reaped."""
    known = {**known, **descendants(launcher.pid)}
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    for pid, started in known.items():
        if _alive(pid, started):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        known.update(descendants(launcher.pid))
        if launcher.poll() is not None and not any(_alive(p, s) for p, s in known.items()):
            break
        time.sleep(0.05)
    for pid, started in known.items():
        if _alive(pid, started):
            _signal(pid, signal.SIGKILL)
    if launcher.poll() is None:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    launcher.wait()
