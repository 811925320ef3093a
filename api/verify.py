"""`verify`: a checkpoint's structure checked, every finding reported."""

from __future__ import annotations

from pathlib import Path

from hpckpt.api.reports import VerifyReport
from hpckpt.converters import open_index
from hpckpt.core.validate import validate


def verify(path: str | Path, strict: bool = False) -> VerifyReport:
    """Check files, headers, keys, dtypes, shapes, chunk coverage and values of `path`; the
    report's `exit_code` is what `hpckpt verify` exits with."""
    index = open_index(path)
    return VerifyReport(
        path=str(path), format=index.format,
        checked={"tensors": len(index.tensors), "chunks": sum(t.n_chunks for t in index.tensors.values()),
                 "values": len(index.values), "files": len(index.data_files)},
        findings=tuple(validate(index)), strict=strict)
