"""How the ranks of a save exchange what they must agree on: collectives, or files on storage.

Every exchange is an `all_gather` of a JSON-able object under a phase name; each rank then
decides the same thing from the same list, so nothing is ever broadcast and no rank waits for a
verdict it could compute itself.

- `Collectives`: the framework's gather (an all_gather over torch's process group, MindSpore's AllGather);
  when it fails (a peer died: connection closed; or the group's timeout) it raises a
  `CoordinationTimeoutError`, as a storage wait does, not the framework's RuntimeError.
- `Storage`: no collectives at all. Each rank writes `.hpckpt-PHASE-RANK.json` (written aside and
  renamed, so a reader never sees half a file) into the shared staging directory and polls for the
  others', for a bounded time: a rank that never arrives ends the wait with a
  `CoordinationTimeoutError` naming it. JSON, never pickles: a file on shared storage is not
  trusted code. Every file carries the save's nonce, which the coordinator puts in
  `.hpckpt-start.json` when it creates the staging directory, so files a killed save left are never
  taken for this one's. The other ranks end their save only once they see the coordinator's
  rename (`confirm_and_wait`): none reports a commit the coordinator did not make.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from hpckpt.core.commit import replace
from hpckpt.core.errors import CoordinationTimeoutError

START = ".hpckpt-start.json"
PROTOCOL_PREFIX = ".hpckpt-"  # every exchange file; none is left in a committed checkpoint
DEFAULT_TIMEOUT = 600.0


class Restarted(Exception):
    """The coordinator began the save anew (it found and removed a staging directory a killed
    job left, which this rank had already joined): start over with the new nonce."""


def new_nonce() -> str:
    return secrets.token_hex(8)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


class Collectives:
    """Exchanges over the framework's collectives (`frameworks` Comm: a torch process group,
    mindspore.communication)."""

    kind = "collectives"

    def __init__(self, comm: Any):
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size

    def all_gather(self, phase: str, obj: Any, what: str | None = None) -> list[Any]:
        try:
            return self.comm.all_gather_json(obj)
        except RuntimeError as exc:  # the framework's own error: a peer died (connection closed) or hangs
            said = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise CoordinationTimeoutError(
                f"collectives: the process group failed while the ranks gathered '{phase}' ({said})",
                hint="a rank died or hangs (see its log); a checkpoint is committed only once every rank "
                     "reported its files") from exc


def write_json(path: Path, obj: Any) -> None:
    """`obj` at `path`, replaced whole; the temporary name keeps the exchange files' prefix, so a
    killed write leaves nothing a committed checkpoint could keep."""
    replace.write_json(path, obj, aside=path.with_name(f"{path.name}.{os.getpid()}.part"), separators=(",", ":"))


read_json = replace.read_json  # None: not there, not ours, or being replaced: read again


class Storage:
    """Exchanges through files in the staging directory shared by every rank.

    The coordinator gathers first and then publishes its own answer, which lists the token each
    rank sent (a random one per save attempt); the other ranks accept a phase only when the
    coordinator's answer lists their own token, and take each peer's file only with the token
    listed for it. So files a killed attempt left (same job, same save, other processes) are
    never taken for this one's, even before the coordinator arrives to remove them.
    """

    kind = "storage"
    #: whether the others learn of the commit from the staging directory's rename (`confirm_and_wait`)
    confirms_by_rename = True

    def __init__(self, directory: Path, rank: int, world_size: int, nonce: str, timeout: float, *,
                 coordinator: int = 0, token: str = ""):
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.nonce, self.timeout, self.coordinator = nonce, timeout, coordinator
        self.token = token or new_nonce()

    def _path(self, phase: str, rank: int) -> Path:
        return self.directory / f"{PROTOCOL_PREFIX}{phase}-{rank}.json"

    def publish(self, phase: str, obj: Any, tokens: dict | None = None) -> None:
        doc = {"nonce": self.nonce, "token": self.token, "data": obj}
        if tokens is not None:
            doc["tokens"] = tokens
        try:
            write_json(self._path(phase, self.rank), doc)
        except FileNotFoundError:
            self._check_restarted()
            raise

    def _check_restarted(self) -> None:
        start = read_json(self.directory / START)
        if start is not None and start.get("nonce") != self.nonce:
            raise Restarted()

    def _read(self, phase: str, rank: int) -> dict | None:
        doc = read_json(self._path(phase, rank))
        if isinstance(doc, dict) and doc.get("nonce") == self.nonce:
            return doc
        return None

    def _wait(self, ready, what: str, waiting_for) -> Any:
        deadline = time.monotonic() + self.timeout
        pause = 0.002
        while True:
            answer = ready()
            if answer is not None:
                return answer
            if time.monotonic() > deadline:
                raise CoordinationTimeoutError(
                    f"storage coordination: {_ranks(waiting_for())} did not {what} within {self.timeout:g} s "
                    f"(waiting in {self.directory})",
                    hint="a rank died or hangs; no checkpoint was committed")
            self._check_restarted()
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)

    def all_gather(self, phase: str, obj: Any, what: str | None = None) -> list[Any]:
        """Every rank's object of `phase`, each wait at most `timeout`."""
        what = what or f"reach '{phase}'"
        peers = [r for r in range(self.world_size) if r != self.coordinator]
        found: dict[int, dict] = {}
        if self.rank == self.coordinator:
            def everyone():
                for r in peers:
                    if r not in found:
                        doc = self._read(phase, r)
                        if doc is not None:
                            found[r] = doc
                return found if len(found) == len(peers) else None
            self._wait(everyone, what, lambda: [r for r in peers if r not in found])
            tokens = {str(r): found[r]["token"] for r in peers}
            self.publish(phase, obj, tokens)
            found[self.rank] = {"data": obj}
            return [found[r]["data"] for r in range(self.world_size)]
        self.publish(phase, obj)
        coordinator: dict = {}

        def listed():
            if not coordinator:
                doc = self._read(phase, self.coordinator)
                if doc is None or doc.get("tokens", {}).get(str(self.rank)) != self.token:
                    return None
                coordinator.update(doc)
            tokens = coordinator["tokens"]
            for r in peers:
                if r not in found:
                    doc = self._read(phase, r)
                    if doc is not None and doc.get("token") == tokens.get(str(r)):
                        found[r] = doc
            return found if len(found) == len(peers) else None
        def absent() -> list[int]:  # the ranks with no file of this attempt, else the coordinator
            missing = [r for r in range(self.world_size) if r != self.rank and self._read(phase, r) is None]
            return missing or [self.coordinator]
        self._wait(listed, what, absent)
        found[self.coordinator] = coordinator
        found[self.rank] = {"data": obj}
        return [found[r]["data"] for r in range(self.world_size)]


class ObjectExchange(Storage):
    """`Storage` through objects beside a checkpoint in an object store (`.NAME.hpckpt-exchange/`),
    for an async save there: the same phases, files and tokens, each written whole by a PUT and
    polled by GETs. The nonce comes from the plan, agreed over the process group in the caller, so
    there is no start file and no restart; the commit's outcome is one more phase (no rename to
    watch). The objects stay (a few small ones per rank), overwritten by the next save."""

    confirms_by_rename = False

    def publish(self, phase: str, obj: Any, tokens: dict | None = None) -> None:
        doc = {"nonce": self.nonce, "token": self.token, "data": obj}
        if tokens is not None:
            doc["tokens"] = tokens
        path = self._path(phase, self.rank)
        path.store.put(path.key, json.dumps(doc, separators=(",", ":")).encode())

    def _read(self, phase: str, rank: int) -> dict | None:
        path = self._path(phase, rank)
        raw = path.store.read_fresh(path.key)
        try:
            doc = json.loads(raw) if raw is not None else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) and doc.get("nonce") == self.nonce else None

    def _check_restarted(self) -> None:
        pass


def _identity(path: Path) -> tuple[int, int] | None:
    """The directory `path` is (device, inode), which a rename keeps; None when there is none."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino)


def confirm_and_wait(exchange: Storage, phase: str, dest: Path) -> bool:
    """A rank other than the coordinator, last: publish `phase` (the coordinator commits once
    every rank has) and wait, at most `timeout`, for the outcome: True once the staging directory
    has been renamed onto `dest` (the same inode), False when it is gone without that (the
    coordinator failed and removed it: it raises the error). Without this wait a rank would
    report a commit that the coordinator never made (it died, or its commit failed).

    Raises:
        CoordinationTimeoutError: the coordinator neither committed nor gave up within `timeout`.
    """
    staging = exchange.directory
    ours = _identity(staging)
    exchange.publish(phase, {})
    deadline = time.monotonic() + exchange.timeout
    pause = 0.002
    while True:
        if _identity(dest) == ours:
            return True
        start = read_json(staging / START)  # removed by the coordinator just before it commits
        if _identity(staging) != ours or (isinstance(start, dict) and start.get("nonce") != exchange.nonce):
            return _identity(dest) == ours  # (renamed in the meantime?)
        if time.monotonic() > deadline:
            raise CoordinationTimeoutError(
                f"storage coordination: rank {exchange.coordinator} (the coordinator) did not commit {dest} within "
                f"{exchange.timeout:g} s (waiting in {staging})",
                hint="the coordinator died or hangs; no checkpoint was committed")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)


def wait_for_start(directory: Path, save_id: str, timeout: float, coordinator: int = 0) -> str:
    """A rank other than the coordinator: the nonce of save `save_id`, once the coordinator has
    created the staging directory for it."""
    deadline = time.monotonic() + timeout
    pause = 0.002
    while True:
        start = read_json(directory / START)
        if isinstance(start, dict) and start.get("save") == save_id and isinstance(start.get("nonce"), str):
            return start["nonce"]
        if time.monotonic() > deadline:
            raise CoordinationTimeoutError(
                f"storage coordination: rank {coordinator} (the coordinator) did not start save {save_id} within "
                f"{timeout:g} s "
                f"(waiting for {directory / START})",
                hint="the coordinator died, hangs, or runs another sequence of saves; no checkpoint was committed")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)
