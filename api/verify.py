"""`verify`: a checkpoint's structure checked, every finding reported."""

from __future__ import annotations

from pathlib import Path

from hpckpt.api.inspect import rank_of
from hpckpt.api.reports import VerifyReport
from hpckpt.converters import hpckpt_json, open_index
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.validate import Finding, validate


def verify(path: str | Path, strict: bool = False) -> VerifyReport:
    """Check files, headers, keys, dtypes, shapes, chunk coverage and values of `path`; the
    report's `exit_code` is what `hpckpt verify` exits with."""
    index = open_index(path)
    return VerifyReport(
        path=str(path), format=index.format,
        checked={"tensors": len(index.tensors), "chunks": sum(t.n_chunks for t in index.tensors.values()),
                 "values": len(index.values), "files": len(index.data_files)},
        findings=(*validate(index), *_record_findings(index)), strict=strict)


def _record_findings(index: CheckpointIndex) -> list[Finding]:
    """hpckpt's own `.hpckpt.json` is expected; one that does not describe the checkpoint is a
    warning (the loaders never read it; hpckpt then infers the world size from file names)."""
    ranks = [r for f in index.data_files + index.metadata_files if (r := rank_of(f)) is not None]
    inferred = max(ranks) + 1 if ranks else None
    return [Finding("corrupt-metadata", "warning", problem, file=hpckpt_json.NAME)
            for problem in hpckpt_json.problems(index, inferred)]
