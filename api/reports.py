"""What the library entry points return: frozen reports that render the documented JSON.

`report.to_json()` is exactly what `hpckpt COMMAND --json` prints (schemas in the README);
`report["key"]` reads the same document, so scripts can treat a report as that dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from hpckpt import __version__
from hpckpt.core.plan_stats import RankStats
from hpckpt.core.validate import Finding, exit_code

SCHEMA_VERSION = 2  # 2: `skipped` and `converted` of a write report name the reason of each entry


class Report:
    """A report: `to_json()` gives its document, `report[key]` and `report.get(key)` read it."""

    def to_json(self) -> dict:
        raise NotImplementedError

    @cached_property
    def _document(self) -> dict:
        return self.to_json()

    def __getitem__(self, key: str) -> Any:
        return self._document[key]

    def __contains__(self, key: str) -> bool:
        return key in self._document

    def get(self, key: str, default: Any = None) -> Any:
        return self._document.get(key, default)


def _header() -> dict:
    return {"schema": SCHEMA_VERSION, "hpckpt_version": __version__}


@dataclass(frozen=True)
class PlanSummary:
    """Per producing rank, what it writes and reads; `files` is the data files written."""

    world_size: int
    ranks: tuple[RankStats, ...]
    files: int

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "ranks": [{"rank": s.rank, "bytes_written": s.bytes_written, "bytes_read": s.bytes_read,
                       "source_files": s.source_files} for s in self.ranks],
            "files": self.files,
            "bytes": sum(s.bytes_written for s in self.ranks),
            "bytes_read": sum(s.bytes_read for s in self.ranks),
        }


@dataclass(frozen=True)
class WriteReport(Report):
    """What a writing command (reshard, consolidate, convert, convert-ms-torch) did.

    `skipped` are the source entries not written and `converted` those written in another kind,
    each `(name, reason)` (reported, never lost silently); `plan` is there for layout formats
    (HyperParallel, PyTorch DCP).
    """

    command: str
    source: str
    destination: str
    source_format: str
    format: str
    bytes_written: int
    bytes_read: int
    seconds: float
    files: int
    dry_run: bool = False
    plan: PlanSummary | None = None
    finalized: bool | None = None
    skipped: tuple[tuple[str, str], ...] = ()
    converted: tuple[tuple[str, str], ...] = ()
    warnings: tuple[str, ...] = ()  # what the source's reader warns of (a piece read as a tensor, ...)
    names: dict | None = None
    would_write: dict | None = None

    def to_json(self) -> dict:
        written, seconds = self.bytes_written, self.seconds
        doc = {
            **_header(),
            "command": self.command,
            "source": self.source,
            "destination": self.destination,
            "source_format": self.source_format,
            "format": self.format,
            "bytes_written": written,
            "bytes_read": self.bytes_read,
            "read_amplification": round(self.bytes_read / written, 3) if written else None,
            "seconds": round(seconds, 3),
            "gb_per_s": round(written / seconds / 1e9, 3) if seconds > 0 else None,
            "files": self.files,
            "dry_run": self.dry_run,
            "skipped": [{"name": name, "reason": reason} for name, reason in self.skipped],
            "converted": [{"name": name, "reason": reason} for name, reason in self.converted],
            "warnings": list(self.warnings),
        }
        if self.plan is not None:
            doc["plan"] = self.plan.to_json()
        if self.finalized is not None:
            doc["finalized"] = self.finalized
        if self.names is not None:
            doc["names"] = self.names
        if self.would_write is not None:
            doc["would_write"] = self.would_write
        return doc


@dataclass(frozen=True)
class FinalizeReport(Report):
    """`reshard --finalize`: the metadata of a fanned-out output is written."""

    destination: str
    files: int

    def to_json(self) -> dict:
        return {"schema": SCHEMA_VERSION, "destination": self.destination, "files": self.files, "finalized": True}


@dataclass(frozen=True)
class InspectReport(Report):
    """`inspect`: a checkpoint described from its metadata (the README documents each field)."""

    path: str
    format: str
    format_version: str
    framework: str | None
    world_size: int | None
    files: tuple[dict, ...]
    counts: dict
    tensors: tuple[dict, ...]
    values: tuple[dict, ...]
    shards: tuple[dict, ...] | None = None
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        doc = {
            **_header(),
            "path": self.path,
            "format": self.format,
            "format_version": self.format_version,
            "framework": self.framework,
            "world_size": self.world_size,
            "files": list(self.files),
            "total_bytes": sum(f["bytes"] or 0 for f in self.files),
            "counts": self.counts,
            "tensors": list(self.tensors),
            "values": list(self.values),
            "notes": list(self.notes),
        }
        if self.shards is not None:
            doc["shards"] = list(self.shards)
        return doc


@dataclass(frozen=True)
class VerifyReport(Report):
    """`verify`: every finding, and the exit code `hpckpt verify` returns (the lowest among the
    findings' codes; warnings count only with `strict`)."""

    path: str
    format: str
    checked: dict
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    strict: bool = False

    @property
    def exit_code(self) -> int:
        return exit_code(list(self.findings), self.strict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_json(self) -> dict:
        return {
            **_header(),
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "checked": self.checked,
            "findings": [f.to_json() for f in self.findings],
        }
