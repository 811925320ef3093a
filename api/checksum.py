"""`checksum`: a manifest (`core.commit.manifest`) for a checkpoint hpckpt did not write.

Every data file is read once (files on parallel threads) and hashed as the writers hash what they
write: each stored chunk whose bytes are one dense run of its file is a box with its own digest;
a chunk stored strided, or whose bytes overlap another's, is covered by its file's digest only
(the report names them). The manifest is written atomically beside the checkpoint; afterwards
`verify --deep` proves every byte against it. A checkpoint with structural errors (a save still
running, a damaged file) gets none: a manifest would certify the damage.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hpckpt.api.reports import ChecksumReport
from hpckpt.api.stored_boxes import metadata_names, stored_boxes
from hpckpt.api.verify import _Progress, _record_findings, checkpoint_path, workers
from hpckpt.converters import index_cache, open_index
from hpckpt.core.commit import manifest
from hpckpt.core.commit.lock import reading
from hpckpt.core.commit.replace import replace_file
from hpckpt.core.errors import ERROR_CLASSES, CorruptDataError, DestinationExistsError
from hpckpt.core.io import digest
from hpckpt.core.safety import input_files
from hpckpt.core.safety.validate import Finding, exit_code, validate
from hpckpt.core.storage.object_path import is_object
from hpckpt.core.storage.readers import close_handle
from hpckpt.core.storage.urls import lexists

LISTED_FORMATS = ("hyperparallel", "torch-dcp")  # their manifest carries the listing `inspect` reads


def checksum(path: str | Path, *, force: bool = False, jobs: int | None = None, progress: Any = None) -> ChecksumReport:
    """Hash every data file of `path` and write its manifest; `force` replaces an existing one.

    Raises:
        DestinationExistsError: it has a manifest already (without `force`).
        HpckptError: `verify` finds an error (the error of the lowest exit code among them).
    """
    started = time.perf_counter()
    ckpt = checkpoint_path(path)
    with reading(ckpt):
        index = open_index(path)
        sidecar = manifest.path_of(ckpt)
        existed = lexists(sidecar)
        if existed and not force:
            raise DestinationExistsError(f"{sidecar} exists", hint="pass --force to replace it (`hpckpt verify --deep` "
                                         "checks the checkpoint against it first)")
        _refuse_errors(index)
        stored = stored_boxes(index)
        names = list(index.data_files)
        sizes = {}
        for name in names:
            sizes[name] = index.data_path(name).stat().st_size
        if progress is not None:
            progress.start(sum(sizes.values()))
        counted = _Progress(progress)
        with workers(jobs, counted) as pool:
            futures = [pool.submit(_hash_file, index.data_path(name), name, sizes[name], stored.boxes.get(name, []), counted)
                       for name in sorted(names, key=lambda n: -sizes[n])]
            by_name = {f.name: f for f in (future.result() for future in futures)}
        files = [by_name[name] for name in names]
        root = ckpt if ckpt.is_dir() else ckpt.parent
        metadata = [(name, input_files.read_small(root / name, "metadata file", input_files.metadata_limit()))
                    for name in metadata_names(index)]
        listing = index_cache.snapshot(index) if index.format in LISTED_FORMATS else None
        doc = manifest.header(format_name=index.format, world_size=index.world_size if index.world_size_exact else None,
                              files=manifest.summaries(files), metadata=metadata, source=None, index=listing,
                              command=manifest.command_line())
        _write_atomically(sidecar, manifest.encode(doc, files))
    digest_only = [{"file": name, "name": fqn, "reason": reason}
                   for name in names for fqn, reason in stored.digest_only.get(name, [])]
    return ChecksumReport(path=str(path), format=index.format, manifest=str(sidecar), files=len(files),
                          boxes=sum(len(f.boxes) for f in files), bytes_read=counted.bytes,
                          seconds=time.perf_counter() - started, digest_only=tuple(digest_only), replaced=existed)


def _refuse_errors(index) -> None:
    """A checkpoint `verify` finds errors in (being written, damaged) is refused with the
    error of its most fundamental finding."""
    findings: list[Finding] = [*validate(index), *_record_findings(index)]
    errors = [f for f in findings if f.severity == "error"]
    if not errors:
        return
    code = exit_code(errors)
    first = next(f for f in errors if f.exit_code == code)
    cls = next((c for c in ERROR_CLASSES if c.kind == first.kind), CorruptDataError)
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    raise cls(f"{index.root}: {first.message}{more}",
              hint="`hpckpt verify` lists every error; a checkpoint is checksummed once it is complete and sound")


def _hash_file(path: Path, name: str, size: int, boxes: list, progress: _Progress) -> manifest.FileDigest:
    fd = input_files.open_handle(path)
    try:
        got = digest.scan_file(fd, size, [b.extents for b in boxes], progress)
    except digest.ScanError as exc:
        raise CorruptDataError(f"{name}: {exc}", hint="was it changed while it was read?") from None
    finally:
        close_handle(fd)
    return manifest.FileDigest(name, got.size, got.digest, tuple(
        manifest.BoxDigest(b.fqn, b.offsets, b.sizes, b.extents, d) for b, d in zip(boxes, got.boxes)))


def _write_atomically(path: Path, data: bytes) -> None:
    """Temporary file in the same directory, fsynced, renamed over `path`, directory fsynced:
    a reader sees the old manifest or the whole new one (an object's PUT is as whole)."""
    if is_object(path):
        path.store.put(path.key, data)
        return
    replace_file(path, data, fsync=True, fsync_dir=True, aside=path.with_name(f".{path.name}.tmp-{os.getpid()}"))
