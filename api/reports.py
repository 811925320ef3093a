"""What the library entry points return: frozen reports that render the documented JSON.

`report.to_json()` is exactly what `hpckpt COMMAND --json` prints (schemas in docs/commands.md);
`report["key"]` reads the same document, so scripts can treat a report as that dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from hpckpt import __version__
from hpckpt.core.geometry.plan_stats import RankStats
from hpckpt.core.safety.validate import Finding, exit_code

# 2: `skipped` and `converted` of a write report name the reason of each entry.
# 3: every document starts with one envelope (`command`, `ok`, `written`, `skipped`, `warnings`),
#    a failed command prints one too (`ok: false` and `error`), `gb_per_s` became `gib_per_s`.
SCHEMA_VERSION = 3


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


def envelope(command: str | None, *, ok: bool = True, written=(), skipped=(), warnings=()) -> dict:
    """The fields every document starts with, whatever the command (docs/commands.md, "JSON documents")."""
    return {"schema": SCHEMA_VERSION, "hpckpt_version": __version__, "command": command, "ok": ok,
            "written": list(written), "skipped": list(skipped), "warnings": list(warnings)}


def error_document(command: str | None, kind: str, exit_code: int, message: str, hint: str | None,
                   warnings=()) -> dict:
    """What `--json` prints when a command fails: the envelope, `ok: false`, and the error."""
    return {**envelope(command, ok=False, warnings=warnings),
            "error": {"kind": kind, "exit_code": exit_code, "message": message, "hint": hint}}


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
    written: tuple[str, ...] = ()  # the paths of the files written (data, metadata, side files)
    #: A dry run's plan and its rank statistics, not part of the document: the plan's page
    #: (`api.plan_view`) draws what the run planned instead of planning it again.
    planned: Any = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        written, seconds = self.bytes_written, self.seconds
        doc = {
            **envelope(self.command, written=self.written,
                       skipped=[{"name": name, "reason": reason} for name, reason in self.skipped],
                       warnings=self.warnings),
            "source": self.source,
            "destination": self.destination,
            "source_format": self.source_format,
            "format": self.format,
            "bytes_written": written,
            "bytes_read": self.bytes_read,
            "read_amplification": round(self.bytes_read / written, 3) if written else None,
            "seconds": round(seconds, 3),
            "gib_per_s": round(written / seconds / 2**30, 3) if seconds > 0 else None,
            "files": self.files,
            "dry_run": self.dry_run,
            "converted": [{"name": name, "reason": reason} for name, reason in self.converted],
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
    written: tuple[str, ...]  # every file of the output, now complete: data files, then metadata
    files: int  # the data files

    def to_json(self) -> dict:
        return {**envelope("reshard", written=self.written), "destination": self.destination, "files": self.files,
                "finalized": True}


@dataclass(frozen=True)
class InspectReport(Report):
    """`inspect`: a checkpoint described from its metadata (docs/commands.md documents each field)."""

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
    world_size_exact: bool = False  # True: recorded by hpckpt's writer; False: at least, from file names
    based_on: tuple[str, ...] = ()  # the checkpoints beside it an incremental save points into (`../NAME`)
    summary: dict | None = None  # by dtype, by layout, and the ranks grouped by what they store
    written_by: str | None = None  # "hpckpt VERSION" when hpckpt's manifest describes it

    def to_json(self) -> dict:
        doc = {
            **envelope("inspect"),
            "path": self.path,
            "format": self.format,
            "format_version": self.format_version,
            "based_on": list(self.based_on),
            "framework": self.framework,
            "written_by": self.written_by,
            "world_size": self.world_size,
            "world_size_exact": self.world_size_exact,
            "files": list(self.files),
            "total_bytes": sum(f["bytes"] or 0 for f in self.files),
            "counts": self.counts,
            "summary": self.summary,
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
    deep: dict | None = None  # `--deep`/`--nan`: what was read (manifest, files, boxes, chunks, bytes, seconds)
    nonfinite: tuple[dict, ...] | None = None  # `--nan`: per floating tensor, its NaN, +Inf and -Inf counts

    @property
    def exit_code(self) -> int:
        return exit_code(list(self.findings), self.strict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def to_json(self) -> dict:
        return {
            **envelope("verify", ok=self.ok),
            "path": self.path,
            "format": self.format,
            "exit_code": self.exit_code,
            "checked": self.checked,
            "findings": [f.to_json() for f in self.findings],
            **({"deep": self.deep} if self.deep is not None else {}),
            **({"nonfinite": list(self.nonfinite)} if self.nonfinite is not None else {}),
        }


@dataclass(frozen=True)
class ChecksumReport(Report):
    """`checksum`: the manifest written, what it covers, and the chunks only a file digest covers
    (`digest_only`: `{file, name, reason}`, strided or sharing bytes with another chunk)."""

    path: str
    format: str
    manifest: str
    files: int
    boxes: int
    bytes_read: int
    seconds: float
    digest_only: tuple[dict, ...] = ()
    replaced: bool = False

    def to_json(self) -> dict:
        return {**envelope("checksum", written=(self.manifest,)), "path": self.path, "format": self.format,
                "manifest": self.manifest, "files": self.files, "boxes": self.boxes, "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 3),
                "gib_per_s": round(self.bytes_read / self.seconds / 2**30, 3) if self.seconds > 0 else None,
                "digest_only": list(self.digest_only)}
