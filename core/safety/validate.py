"""Structural checks of a checkpoint (`hpckpt verify`): every finding, not just the first.

Checks, in order: data files inside the checkpoint, present and readable; safetensors headers
well formed; every chunk inside its tensor, and the chunks of each tensor covering it exactly
(identical replicas allowed; gaps and overlaps reported as boxes); every tensor key present in its
file with the dtype and shape the metadata says; every value's byte range inside its file and
decodable by the safe unpickler; tensors of a dtype hpckpt refuses (quantized, shell dtypes);
files left by an interrupted save.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hpckpt.core import dtypes
from hpckpt.core.errors import EXIT_CODE_BY_KIND, CorruptMetadataError, HpckptError, InterruptedSaveError
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.overlap import ChunkIndex, boxes_to_arrays
from hpckpt.core.index import CheckpointIndex, TensorEntry
from hpckpt.core.io.checksums import check_source

MAX_GRID_CELLS = 4_000_000  # coverage is checked on a grid of distinct chunk boundaries
MAX_BOXES_PER_FINDING = 8


@dataclass(frozen=True)
class Finding:
    kind: str  # an error kind from core.errors ("missing-file", "geometry", ...)
    severity: str  # "error" or "warning"
    message: str
    fqn: str | None = None
    file: str | None = None
    boxes: tuple[str, ...] = ()
    details: tuple[str, ...] = ()  # every problem of a file whose finding names the first

    @property
    def exit_code(self) -> int:
        return EXIT_CODE_BY_KIND[self.kind]

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


def exit_code(findings: list[Finding], strict: bool = False) -> int:
    """0 when clean; else the lowest (most fundamental) exit code among the errors."""
    codes = [f.exit_code for f in findings if f.severity == "error" or strict]
    return min(codes) if codes else 0


def _error(exc: HpckptError, **where: str | None) -> Finding:
    return Finding(exc.kind, "error", exc.message, **where)


def validate(index: CheckpointIndex) -> list[Finding]:
    """Return every structural finding about `index` (an empty list means the checkpoint is sound)."""
    findings: list[Finding] = []
    bad_files = _check_files(index, findings)
    checksums: dict[tuple, str] = {}
    for entry in index.tensors.values():
        _check_tensor(index, entry, bad_files, findings, checksums)
    findings.extend(_check_checksums(checksums))
    noted = len(index.warnings)
    bad_files |= _check_value_files(index, bad_files, findings)
    for fqn, value in index.values.items():
        if value.file in bad_files:
            continue
        try:
            index.decode_value(fqn)
        except HpckptError as exc:
            findings.append(_error(exc, fqn=fqn, file=value.file))
    # what reading the values made the reader warn of (a value that is no pickle, read as bytes)
    findings.extend(Finding("corrupt-data", "warning", note) for note in index.warnings[noted:])
    findings.extend(_leftovers(index.root))
    return _one_per_file(findings)


#: Kinds of finding about a file's bytes: several about one file are said as one line.
_FILE_KINDS = ("corrupt-data", "missing-file", "entry-mismatch")


def _one_per_file(findings: list[Finding]) -> list[Finding]:
    """Several errors of one kind about one file (a damaged file breaks every entry in it) become
    one finding: a truncation if one was found (it says what the others are), else the first,
    with the count, and all of them as `details`."""
    groups: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
        if f.file is not None and f.severity == "error" and f.kind in _FILE_KINDS:
            groups.setdefault((f.file, f.kind), []).append(f)
    out, said = [], set()
    for f in findings:
        group = groups.get((f.file, f.kind)) if f.severity == "error" else None
        if group is None or len(group) == 1:
            out.append(f)
        elif id(group) not in said:
            said.add(id(group))
            details = tuple(g.message for g in group)
            head = next((g for g in group if ": truncated: " in g.message), f)
            out.append(Finding(f.kind, "error", f"{head.message} (and {len(details) - 1} more problem(s) in this file)",
                               file=f.file, details=details))
    return out


def _check_value_files(index: CheckpointIndex, bad_files: set[str], findings: list[Finding]) -> set[str]:
    """A file of values shorter than the values it holds is one finding (its size against the
    end of its last value), not one per value; returns those files."""
    ends: dict[str, tuple[int, int]] = {}  # file -> (end of its last value, values)
    for value in index.values.values():
        if value.file not in bad_files and value.length is not None:
            end, count = ends.get(value.file, (0, 0))
            ends[value.file] = (max(end, value.offset + value.length), count + 1)
    short = set()
    for name, (end, count) in ends.items():
        try:
            size = index.data_path(name).stat().st_size
        except (OSError, HpckptError):
            continue  # missing: the values say so, each
        if size < end:
            findings.append(Finding("corrupt-data", "error", f"{name}: truncated: {size} of {end} bytes (the metadata "
                                    f"places {count} value(s) in it, up to byte {end})", file=name))
            short.add(name)
    return short


def _check_files(index: CheckpointIndex, findings: list[Finding]) -> set[str]:
    """Check each referenced data file once; return those unusable, so entries are not re-reported."""
    bad: set[str] = set()
    for name in index.data_files:
        try:
            path = index.data_path(name)
        except HpckptError as exc:
            findings.append(_error(exc, file=name))
            bad.add(name)
            continue
        if not path.is_file() or (isinstance(path, Path) and not os.access(path, os.R_OK)):
            what = "is missing" if not path.exists() else "cannot be read"
            findings.append(Finding("missing-file", "error", f"{name}: data file {what}", file=name))
            bad.add(name)
            continue
        try:
            problems = index.locator.file_problems(name)
        except HpckptError as exc:
            findings.append(_error(exc, file=name))
            bad.add(name)
            continue
        for problem in problems:  # (said as one line per file: `_one_per_file`)
            findings.append(Finding("corrupt-data", "error", f"{name}: {problem}", file=name))
        if problems:
            bad.add(name)
    return bad


def _check_checksums(checksums: dict[tuple, str]) -> list[Finding]:
    """The CRC-32 of every byte range its format records one for (torch.save storages), each once."""
    findings = []
    for (path, offset, nbytes, crc), fqn in checksums.items():
        try:
            check_source(path, offset, nbytes, crc)
        except HpckptError as exc:
            findings.append(_error(exc, fqn=fqn, file=path.name))
    return findings


def _check_tensor(index: CheckpointIndex, entry: TensorEntry, bad_files: set[str], findings: list[Finding],
                  checksums: dict[tuple, str]) -> None:
    refused = entry.dtype.refusal is not None  # quantized, shell dtypes: sound files hpckpt cannot copy
    if refused:
        exc = dtypes.refuse(entry.dtype, entry.fqn)
        findings.append(Finding(exc.kind, "error", exc.message, fqn=entry.fqn))
    inside = []
    for i, chunk in enumerate(entry.chunks):
        if not chunk.box.inside(entry.shape):
            findings.append(Finding(
                "geometry", "error",
                f"{entry.fqn}: chunk {i} {chunk.box} lies outside the tensor's shape {list(entry.shape)}",
                fqn=entry.fqn, file=chunk.file, boxes=(str(chunk.box),),
            ))
            continue
        inside.append(chunk.box)
        if chunk.file in bad_files or refused:
            continue
        try:
            loc = index.locate(chunk, entry)
        except HpckptError as exc:
            findings.append(_error(exc, fqn=entry.fqn, file=chunk.file))
            continue
        if getattr(loc, "checksum", None) is not None:
            checksums.setdefault((loc.path, *loc.checksum), entry.fqn)
    findings.extend(_coverage(entry, inside))


def coverage(entry: TensorEntry) -> dict[str, list[str]]:
    """The gaps and overlaps of one tensor's stored boxes, what a shard map marks: `gaps` and
    `overlaps` as regions (`[0:2, 4:8]`, at most a few of each), `notes` what is wrong but could
    not be located; empty when the boxes tile the tensor."""
    if _tiles_along_one_dim(entry):
        return {}
    out: dict[str, list[str]] = {}
    for finding in _coverage(entry, [b for b in entry.boxes if b.inside(entry.shape)]):
        kind = "notes" if not finding.boxes else "gaps" if finding.message.startswith(f"{entry.fqn}: no chunk covers") \
            else "overlaps"
        out.setdefault(kind, []).extend(finding.boxes or [finding.message])
    return out


def _coverage(entry: TensorEntry, boxes: list[Box]) -> list[Finding]:
    shape = entry.shape
    if not shape:
        if boxes:
            return []
        return [Finding("geometry", "error", f"{entry.fqn}: 0-d tensor has no stored chunk", fqn=entry.fqn)]
    if math.prod(shape) == 0:
        return []
    distinct = sorted({b for b in boxes if not b.is_empty}, key=lambda b: (b.offsets, b.sizes))
    if distinct and _tiles_arrays(*boxes_to_arrays(distinct, len(shape)), shape):
        return []
    cuts = [sorted({0, n} | {b.offsets[d] for b in distinct} | {b.ends[d] for b in distinct})
            for d, n in enumerate(shape)]
    grid = tuple(len(c) - 1 for c in cuts)
    if math.prod(grid) > MAX_GRID_CELLS:  # too many cells: count elements, which is exact without overlaps
        findings = []
        finder = ChunkIndex(len(shape), *boxes_to_arrays(distinct, len(shape)))
        if len(finder.overlapping):
            findings.append(Finding("geometry", "error", f"{entry.fqn}: {len(finder.overlapping)} different "
                                    "chunks overlap another (holes they may hide are not located)", fqn=entry.fqn))
        covered = sum(b.volume for b in distinct)
        if covered != math.prod(shape):
            findings.append(Finding("geometry", "error",
                            f"{entry.fqn}: chunks hold {covered} elements, the tensor has {math.prod(shape)}",
                            fqn=entry.fqn))
        return findings
    counts = np.zeros(grid, dtype=np.int32)
    for b in distinct:
        counts[tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, e))
                     for c, o, e in zip(cuts, b.offsets, b.ends))] += 1
    findings = []
    gaps, more = _cells_to_boxes(counts == 0, cuts)
    if gaps:
        findings.append(Finding(
            "geometry", "error",
            f"{entry.fqn}: no chunk covers {', '.join(map(str, gaps))}" + (f" (and {more} more)" if more else ""),
            fqn=entry.fqn, boxes=tuple(map(str, gaps)),
        ))
    overlaps, more = _cells_to_boxes(counts > 1, cuts)
    if overlaps:
        findings.append(Finding(
            "geometry", "error",
            f"{entry.fqn}: different chunks overlap at {', '.join(map(str, overlaps))}" + (f" (and {more} more)" if more else ""),
            fqn=entry.fqn, boxes=tuple(map(str, overlaps)),
        ))
    return findings


def _tiles_along_one_dim(entry: TensorEntry) -> bool:
    """`_tiles_arrays` on the tensor's chunk arrays, without an object per chunk: a shard map of
    a thousand ranks' checkpoint asks it of every tensor."""
    shape = entry.shape
    if not shape or math.prod(shape) == 0 or not entry.n_chunks:
        return False
    try:
        offsets, sizes = entry.chunk_arrays()
    except CorruptMetadataError:
        return False
    return _tiles_arrays(offsets, sizes, shape)


def _tiles_arrays(offsets: np.ndarray, sizes: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Fast path for the common layouts (row or column shards): True only where the boxes, every
    one inside the tensor, have full extent in every dimension but one and meet end to end along
    it from 0 to its size (replicas and empty boxes aside); anything else (a box outside, boxes of
    different lengths at one start, a 2-D split, a gap) says False and the caller looks closer."""
    if max(shape) >= 1 << 62:
        return False
    limit = np.array(shape, np.int64)
    if offsets.shape != sizes.shape or offsets.shape[1:] != limit.shape:
        return False
    if (offsets < 0).any() or (sizes < 0).any() or (sizes > limit).any() or (offsets + sizes > limit).any():
        return False  # (each term at most 2**62: the sum cannot wrap)
    kept = sizes.all(axis=1)
    offsets, sizes = offsets[kept], sizes[kept]
    split = np.flatnonzero((sizes != limit).any(axis=0))
    if len(split) > 1:
        return False
    d = int(split[0]) if len(split) else 0
    order = np.argsort(offsets[:, d], kind="stable")
    starts, lengths = offsets[order, d], sizes[order, d]
    repeated = np.zeros(len(starts), bool)  # a replica, sorted next to its copy (full extent elsewhere)
    repeated[1:] = (starts[1:] == starts[:-1]) & (lengths[1:] == lengths[:-1])
    starts, lengths = starts[~repeated], lengths[~repeated]
    ends = np.cumsum(lengths)
    return bool(len(starts)) and int(starts[0]) == 0 and bool((starts[1:] == ends[:-1]).all()) and int(ends[-1]) == shape[d]


def _cells_to_boxes(mask: np.ndarray, cuts: list[list[int]]) -> tuple[list[Box], int]:
    """Merge marked grid cells into a few maximal boxes (greedy), in global coordinates."""
    mask = mask.copy()
    boxes: list[Box] = []
    while mask.any() and len(boxes) < MAX_BOXES_PER_FINDING:
        start = [int(i) for i in np.argwhere(mask)[0]]
        end = [s + 1 for s in start]
        for d in reversed(range(mask.ndim)):
            while end[d] < mask.shape[d]:
                grown = tuple(slice(s, e + 1 if k == d else e) for k, (s, e) in enumerate(zip(start, end)))
                if not mask[grown].all():
                    break
                end[d] += 1
        mask[tuple(slice(s, e) for s, e in zip(start, end))] = False
        boxes.append(Box(tuple(cuts[d][s] for d, s in enumerate(start)),
                         tuple(cuts[d][e] - cuts[d][s] for d, (s, e) in enumerate(zip(start, end)))))
    remaining = 0
    if mask.any():
        remaining = int(mask.sum())  # cells, an upper bound on the boxes left unreported
    return boxes, remaining


def refuse_interrupted(index: CheckpointIndex) -> None:
    """A writing command reads a checkpoint only if no save into it is unfinished: its data
    files may already hold the next step's bytes under the old `.metadata`.

    Raises:
        InterruptedSaveError: the files `verify` reports as an error of kind interrupted-save.
    """
    if not isinstance(index.root, Path) or not index.root.is_dir():
        return
    errors = [f for f in _leftovers(index.root) if f.severity == "error"]
    if errors:
        raise InterruptedSaveError(f"{index.root}: {errors[0].message}" + (f" (and {len(errors) - 1} more)"
                                   if len(errors) > 1 else ""),
                                   hint="its data files may hold a newer step than its .metadata says: "
                                        "finish or remove that save first")


def _leftovers(root: Path) -> list[Finding]:
    findings = []
    for path in sorted(root.glob("LOCAL_PLAN_*.pkl")):
        findings.append(Finding(
            "interrupted-save", "warning",
            f"{path.name}: plan file left by a storage-coordinated async save (harmless once .metadata exists)",
            file=path.name,
        ))
    for path in sorted(root.glob("STORAGE_DATA_*.pkl")):
        findings.append(Finding(
            "interrupted-save", "error",
            f"{path.name}: write results of a save that did not finish (rank 0 deletes these when it completes)",
            file=path.name,
        ))
    return findings
