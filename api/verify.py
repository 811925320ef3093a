"""`verify`: a checkpoint's structure checked, every finding reported; with `deep`, every byte.

`verify --deep` proves the data intact. With a manifest (`core.commit.manifest`) that describes the
checkpoint (its metadata files' digests, its data files, and for each file the boxes the metadata
lists), every data file is read once and its file and box digests compared with the manifest's.
Without one (or with one that describes another checkpoint), every stored chunk is read through
the format's locator, so every tensor's bytes are shown readable; the values are decoded by the
structural checks. `nan` also counts NaN and infinities of every floating tensor (bit patterns
of each float format, bfloat16 and float8 included), read a block at a time.

Work runs on `jobs` threads (xxhash, `preadv` and most numpy operations release the GIL): a file
scan holds one `digest.SCAN_BLOCK` buffer, a chunk reader one `READ_BLOCK` buffer plus, counting
NaN, temporaries of at most that size again; memory is a few blocks a thread, whatever the size.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.api.inspect import rank_of
from hpckpt.api.nonfinite import nonfinite_counts, nonfinite_report
from hpckpt.api.reports import VerifyReport
from hpckpt.api.stored_boxes import StoredBox, StoredBoxes, located_chunks, metadata_names, stored_boxes
from hpckpt.converters import hpckpt_json, open_index
from hpckpt.core.commit import manifest
from hpckpt.core.commit.lock import reading
from hpckpt.core.errors import CorruptMetadataError, HpckptError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.tiles import contiguous_tiles
from hpckpt.core.index import CheckpointIndex, Chunk, Location, TensorEntry
from hpckpt.core.io import digest
from hpckpt.core.io.read import OpenFiles, read_region
from hpckpt.core.safety import input_files
from hpckpt.core.safety.validate import Finding, validate
from hpckpt.core.storage.readers import close_handle, handle_size
from hpckpt.core.storage.urls import as_path


READ_BLOCK = 8 * 1024 * 1024  # bytes of one chunk read (and of the NaN count's temporaries)
TASK_BYTES = 256 * 1024 * 1024  # chunks of one file read by one task: a large file uses every thread
MAX_LISTED = 8  # differing boxes (or unreadable chunks) listed per file; the rest are counted


def verify(path: str | Path, strict: bool = False, *, deep: bool = False, nan: bool = False,
           jobs: int | None = None, progress: Any = None) -> VerifyReport:
    """Check files, headers, keys, dtypes, shapes, chunk coverage and values of `path`; with
    `deep` every data byte too (against the manifest when there is one), with `nan` the NaN
    and infinities of every floating tensor (implies reading the data). The report's
    `exit_code` is what `hpckpt verify` exits with; `progress` gets `start(total)` and
    `advance(n)` for the bytes read."""
    with reading(path) if deep or nan else contextlib.nullcontext():
        index = open_index(path)
        findings = [*validate(index), *_record_findings(index)]
        checked = {"tensors": len(index.tensors), "chunks": sum(t.n_chunks for t in index.tensors.values()),
                   "values": len(index.values), "files": len(index.data_files)}
        deep_doc = counts = None
        if deep or nan:
            deep_doc, counts = _deep(index, checkpoint_path(path), findings, nan, jobs, progress)
    return VerifyReport(path=str(path), format=index.format, checked=checked, findings=tuple(findings),
                        strict=strict, deep=deep_doc, nonfinite=counts)


def checkpoint_path(path: str | Path) -> Path:
    """The checkpoint a command line names: `DIR/.metadata` means DIR (as `open_index` takes it)."""
    path = as_path(path)
    return path.parent if path.is_file() and path.name.endswith("metadata") else path


def _record_findings(index: CheckpointIndex) -> list[Finding]:
    """hpckpt's own record (the manifest, or `.hpckpt.json`) is expected; one that does not describe the checkpoint is a
    warning (the loaders never read it; hpckpt then infers the world size from file names)."""
    ranks = [r for f in index.data_files + index.metadata_files if (r := rank_of(f)) is not None]
    inferred = max(ranks) + 1 if ranks else None
    return [Finding("corrupt-metadata", "warning", problem, file=hpckpt_json.record_name(index) or hpckpt_json.NAME)
            for problem in hpckpt_json.problems(index, inferred)]


@dataclass(frozen=True)
# -- the deep checks ----------------------------------------------------------------------------


class _Stopped(Exception):
    """Raised in a worker once the run is failing (Ctrl-C, an error): it stops at its next block."""


class _Progress:
    """Thread-safe byte counting that feeds the caller's progress (which may be None); every
    block read reports here, so this is also where a worker learns that it must stop."""

    def __init__(self, progress: Any):
        self.progress, self.bytes = progress, 0
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        if self.stop.is_set():
            raise _Stopped()
        with self._lock:
            self.bytes += n
            if self.progress is not None:
                self.progress.advance(n)


@contextlib.contextmanager
def workers(jobs: int | None, progress: _Progress):
    """A thread pool that, when the block fails (an interrupt included), drops the queued work
    and stops the running workers at their next block instead of finishing everything."""
    pool = ThreadPoolExecutor(max_workers=max(1, jobs or min(8, os.cpu_count() or 1)),
                              thread_name_prefix="hpckpt-verify")
    try:
        yield pool
    except BaseException:
        progress.stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _deep(index: CheckpointIndex, ckpt: Path, findings: list[Finding], nan: bool, jobs: int | None,
          progress: Any) -> tuple[dict, tuple[dict, ...] | None]:
    started = time.perf_counter()
    bad = {f.file for f in findings if f.severity == "error" and f.file}  # reported already: not read again
    # ... but scanned against the manifest, unless missing: its digests say which bytes changed
    gone = {f.file for f in findings if f.kind in ("missing-file", "unsafe-path") and f.file}
    sidecar = manifest.path_of(ckpt)
    doc: dict[str, Any] = {"manifest": None, "manifest_used": False, "files_scanned": 0, "boxes_checked": 0,
                           "chunks_read": 0}
    try:
        found = manifest.read(sidecar)
    except CorruptMetadataError as exc:
        findings.append(Finding(exc.kind, "error", exc.message, file=sidecar.name))
        found = None
    lines = None
    if found is not None:
        doc["manifest"] = str(sidecar)
        lines = _described(found, index, ckpt, stored_boxes(index, bad), bad, findings)
    reads = _chunk_reads(index, bad) if lines is None or nan else []
    total = sum(f.size for f in lines or () if f.name not in gone) + sum(n for *_, n in reads)
    if progress is not None:
        progress.start(total)
    counted = _Progress(progress)
    counts = None
    with workers(jobs, counted) as pool:
        scans = []
        if lines is not None:
            doc["manifest_used"] = True
            scans = [pool.submit(_scan, index, f, counted) for f in lines if f.name not in gone]
        tasks = [pool.submit(_read_task, index, task, nan, counted) for task in _tasks(reads)]
        for future in scans:
            found_here, boxes = future.result()
            findings.extend(found_here)
            doc["files_scanned"] += 1
            doc["boxes_checked"] += boxes
        per_tensor: dict[str, list[int]] = {}
        unreadable: dict[str, list[Finding]] = {}
        for future in tasks:
            got, tallies, chunks = future.result()
            doc["chunks_read"] += chunks
            for f in got:
                unreadable.setdefault(f.file or "", []).append(f)
            for fqn, tally in tallies.items():
                into = per_tensor.setdefault(fqn, [0, 0, 0])
                for k in range(3):
                    into[k] += tally[k]
    for name, listed in unreadable.items():
        findings.extend(listed[:MAX_LISTED])
        if len(listed) > MAX_LISTED:
            findings.append(Finding(listed[0].kind, "error", f"{name}: {len(listed) - MAX_LISTED} more chunks "
                                    "cannot be read", file=name))
    if nan:
        counts = nonfinite_report(index, per_tensor, findings)
    doc["bytes_read"] = counted.bytes
    doc["seconds"] = round(time.perf_counter() - started, 3)
    return doc, counts


def _described(found: manifest.Manifest, index: CheckpointIndex, ckpt: Path, stored: StoredBoxes,
               unlisted: set[str], findings: list[Finding]) -> list[manifest.FileDigest] | None:
    """The manifest's file lines when it describes this checkpoint (its metadata files, data
    files and each file's boxes, but for the `unlisted` files, whose chunks cannot be listed),
    else None with a finding for each difference."""
    where = found.path.name
    problems: list[str] = []
    root = ckpt if ckpt.is_dir() else ckpt.parent
    why = found.mismatch(root, metadata_names(index))
    if why is not None:
        problems.append(why)
    data = set(index.data_files)
    missing = [n for n in index.data_files if n not in found.files]
    extra = [n for n in found.files if n not in data]
    if missing:
        problems.append(f"data file {missing[0]} is not in it" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        problems.append(f"it lists {extra[0]}, which the metadata does not name" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    lines = []
    if not problems:
        try:
            for line in found.file_digests():
                differ = None if line.name in unlisted else _boxes_differ(line, stored.boxes.get(line.name, []))
                if differ is not None:
                    problems.append(f"{line.name}: {differ}")
                    if len(problems) >= MAX_LISTED:
                        break
                lines.append(line)
        except CorruptMetadataError as exc:
            findings.append(Finding(exc.kind, "error", exc.message, file=where))
            return None
    if not problems:
        return lines
    for problem in problems:
        findings.append(Finding("corrupt-metadata", "error", f"{where}: the manifest does not describe this "
                                f"checkpoint: {problem} (the data is read without it)", file=where))
    return None


def _boxes_differ(line: manifest.FileDigest, expected: list[StoredBox]) -> str | None:
    """Why the manifest's boxes of one file are not chunks its metadata lists (None: they are).
    A chunk may be no box of the manifest (a value a writer stored as a tensor among its fixed
    bytes: the file digest covers it), and a box may span several chunks of its tensor (a
    MindSpore tensor split over several Values is one box of the writer's, several of the
    reader's): then the tensor's boxes must cover exactly its chunks' bytes."""
    theirs = {(b.fqn, b.offsets, b.sizes, b.extents) for b in expected}
    odd: dict[str, list[tuple[int, int]]] = {}
    for b in line.boxes:
        extents = tuple(e for e in b.extents if e[1])
        if extents and (b.fqn, b.offsets, b.sizes, extents) not in theirs:
            odd.setdefault(b.fqn, []).extend(extents)
    for fqn, extents in odd.items():
        listed = [e for b in expected if b.fqn == fqn for e in b.extents]
        if not listed or _merged(extents) != _merged(listed):
            return f"its boxes of {fqn!r} are not chunks the metadata lists"
    return None


def _merged(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for offset, nbytes in sorted(extents):
        if out and offset <= out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + nbytes)
        else:
            out.append([offset, offset + nbytes])
    return [(a, b) for a, b in out]


def _scan(index: CheckpointIndex, line: manifest.FileDigest, progress: _Progress) -> tuple[list[Finding], int]:
    """One data file read once and compared with its manifest line."""
    name = line.name
    try:
        path = index.data_path(name)
        fd = input_files.open_handle(path)
    except HpckptError as exc:
        return [Finding(exc.kind, "error", exc.message, file=name)], 0
    try:
        size = handle_size(fd)
        if size != line.size:
            what = "truncated" if size < line.size else "appended to"
            return [Finding("corrupt-data", "error", f"{name}: {size} bytes, the manifest records {line.size} "
                            f"({what} since it was written)", file=name)], 0
        try:
            got = digest.scan_file(fd, size, [b.extents for b in line.boxes], progress)
        except digest.ScanError as exc:
            return [Finding("corrupt-data", "error", f"{name}: {exc}", file=name)], 0
        except OSError as exc:
            return [Finding("corrupt-data", "error", f"{name}: cannot be read ({exc.strerror})", file=name)], 0
    finally:
        close_handle(fd)
    out = []
    differing = [b for b, d in zip(line.boxes, got.boxes) if b.digest != d]
    for box in differing[:MAX_LISTED]:
        where = Box(box.offsets, box.sizes)
        out.append(Finding("corrupt-data", "error", f"{name}: tensor {box.fqn}, box {where}: its bytes differ "
                           "from the manifest's digest", fqn=box.fqn, file=name, boxes=(str(where),)))
    if len(differing) > MAX_LISTED:
        out.append(Finding("corrupt-data", "error", f"{name}: {len(differing) - MAX_LISTED} more boxes differ "
                           "from the manifest's digests", file=name))
    if not differing and got.digest != line.digest:
        out.append(Finding("corrupt-data", "error", f"{name}: bytes outside tensor data differ from the manifest "
                           "(headers, records, padding, or a chunk only the file digest covers)", file=name))
    return out, len(line.boxes)


# -- reading every chunk ------------------------------------------------------------------------


def _chunk_reads(index: CheckpointIndex, skip: set[str]) -> list[tuple[TensorEntry, Chunk, Location, bool, int]]:
    """Every stored chunk to read: `(entry, chunk, location, counted, nbytes)`, located here (on
    one thread); `counted` is False for a second copy of a box (a replica is read, not counted)."""
    out = []
    seen: set[tuple[str, Box]] = set()
    for entry, chunk, loc in located_chunks(index, skip):
        out.append((entry, chunk, loc, (entry.fqn, chunk.box) not in seen, chunk.box.volume * entry.dtype.itemsize))
        seen.add((entry.fqn, chunk.box))
    return out


def _tasks(reads: list) -> list[list]:
    """The reads cut into tasks of at most `TASK_BYTES`, a file's chunks together in file order."""
    by_file: dict[str, list] = {}
    for read in reads:
        by_file.setdefault(read[1].file, []).append(read)
    tasks = []
    for items in by_file.values():
        items.sort(key=lambda r: getattr(r[2], "offset", 0))
        task, size = [], 0
        for item in items:
            if task and size + item[4] > TASK_BYTES:
                tasks.append(task)
                task, size = [], 0
            task.append(item)
            size += item[4]
        if task:
            tasks.append(task)
    tasks.sort(key=lambda t: -sum(r[4] for r in t))  # the largest first: the threads finish together
    return tasks


def _read_task(index: CheckpointIndex, task: list, nan: bool,
               progress: _Progress) -> tuple[list[Finding], dict[str, list[int]], int]:
    """Read a task's chunks a block at a time; returns the unreadable ones as findings, the
    NaN/+Inf/-Inf tallies of the counted ones, and how many chunks were read."""
    buffer = np.empty(READ_BLOCK, dtype=np.uint8)
    findings: list[Finding] = []
    tallies: dict[str, list[int]] = {}
    with OpenFiles() as files:
        for entry, chunk, loc, counted, _ in task:
            dt = entry.dtype
            count = nan and counted and dt.is_floating
            try:
                for tile in contiguous_tiles(tuple(chunk.box.sizes), dt.itemsize, READ_BLOCK):
                    n = tile.volume * dt.itemsize
                    out = buffer[:n].view(dt.np).reshape(tile.sizes)
                    read_region(files, loc, tile, out, budget=READ_BLOCK)
                    if count:
                        tally = tallies.setdefault(entry.fqn, [0, 0, 0])
                        for k, c in enumerate(nonfinite_counts(out, dt.name)):
                            tally[k] += c
                    progress(n)
            except HpckptError as exc:
                findings.append(Finding(exc.kind, "error", f"{entry.fqn}: chunk {chunk.box}: {exc.message}",
                                        fqn=entry.fqn, file=chunk.file, boxes=(str(chunk.box),)))
            except OSError as exc:
                findings.append(Finding("corrupt-data", "error", f"{chunk.file}: {entry.fqn}: chunk {chunk.box} "
                                        f"cannot be read ({exc.strerror})", fqn=entry.fqn, file=chunk.file))
    return findings, tallies, len(task)
