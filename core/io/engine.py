"""The copy engine: fills the files of an `OutputLayout` from a source, in bounded memory.

This is the only place tensor bytes move and the only place threads work. Each file is created at
its final size and its fixed bytes written; then every box is filled tile by tile (a tile is a
block of whole rows, contiguous in the output, within the memory budget). A tile that one source
chunk holds as one contiguous byte run is copied without a tile buffer: by the kernel
(`copy_file_range`), or, when summing (digest, CRC-32), from a mapping of the source a MiB at a time with
`pwrite`, or straight from an array in memory. Any other is gathered from its pieces with ranged
reads (or from memory, for in-memory sources) into one buffer, cast if asked, and written with
one `pwrite`. Every box's digest for the manifest, and the CRC-32 a format records of a box (a
zip member's), are taken from the bytes as they are written, from the buffer or mapping they are
written from; only a CRC-32 of a range that is not one box (a `.ckpt` trailer) is read back, on a
worker. Files are filled in parallel, one per worker (I/O, xxhash, numpy and zlib-ng's CRC-32 release the GIL);
what one worker does to its file is `box_filler.py`.

When the main thread leaves `execute` early (an error of one file, Ctrl-C, SIGTERM), the files
not started are cancelled and the workers stop at their next copied range (a stop flag), so the
caller removes the staging directory only once nothing writes into it any more.
"""

from __future__ import annotations

import bisect
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Callable


from hpckpt.core.commit.durable import fsync_files, start_writeback
from hpckpt.core.commit.manifest import BoxDigest, FileDigest
from hpckpt.core.geometry.overlap import ChunkIndex, boxes_to_arrays, check_covered, check_inside
from hpckpt.core.geometry.plan_stats import RankStats
from hpckpt.core.index import CheckpointIndex, Location, TensorEntry
from hpckpt.core.io import digest
from hpckpt.core.io.box_filler import BoxFiller, Filled, Pieces, Progress, check_stop, pwrite_all
from hpckpt.core.io.checksums import check_source, crc_of
from hpckpt.core.io.output import Extent, FileLayout, Finished, OutputLayout, Placement
from hpckpt.core.io.read import OpenFiles

DEFAULT_MAX_MEMORY = 64 * 1024 * 1024  # tiles this size already move at disk speed


def default_jobs() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def source_pieces(index: CheckpointIndex, placements: list[Placement]) -> dict[int, Pieces]:
    """For each placement (by `id`), the source chunks and regions that fill it, computed tensor
    by tensor in one vectorised pass (`core.geometry.overlap`).

    Raises:
        GeometryError: the source does not cover a box.
    """
    by_tensor: dict[str, list[Placement]] = {}
    for p in placements:
        by_tensor.setdefault(p.tensor.fqn, []).append(p)
    out: dict[int, Pieces] = {}
    for fqn, group in by_tensor.items():
        entry = index.tensors[fqn]
        if entry.n_chunks == 1 and _held_by_its_one_chunk(entry, group, out):
            continue
        ndim = len(entry.shape)
        chunks = entry.chunks
        chunk_offsets, chunk_sizes = entry.chunk_arrays()
        check_inside(fqn, tuple(entry.shape), chunk_offsets, chunk_sizes)
        finder = ChunkIndex(ndim, chunk_offsets, chunk_sizes)
        offsets, sizes = boxes_to_arrays([p.box.box for p in group], ndim)
        found = finder.pieces(offsets, sizes)
        check_covered(fqn, found, offsets, sizes, finder)
        per_box = found.of_box()
        for i, p in enumerate(group):
            out[id(p)] = [(chunks[c], region) for c, region in (per_box[i] if i < len(per_box) else [])]
    return out


def _held_by_its_one_chunk(entry: TensorEntry, group: list[Placement], out: dict[int, Pieces]) -> bool:
    """A live save's usual tensor: one stored chunk (the rank's own shard) inside the tensor,
    holding each wanted box whole. Then each box's one piece is the box itself, as the
    vectorised pass finds it, without its ~0.4 ms of numpy a tensor (about half of a live save's
    CPU before writing). Anything else (a box reaching outside the chunk, a chunk outside the
    tensor) goes through that pass, which checks and reports it."""
    chunk = entry.chunks[0]
    if not chunk.box.inside(entry.shape) or not all(p.box.box.relative_to(chunk.box).inside(chunk.box.sizes)
                                                    for p in group):
        return False
    for p in group:
        out[id(p)] = [(chunk, p.box.box)] if p.box.box.volume else []
    return True


def _fill_file(path: Path, layout: FileLayout, index: CheckpointIndex, pieces: dict[int, Pieces], budget: int,
               progress: Progress, sync: bool, pool: ThreadPoolExecutor, read_back: list[tuple[str, Future]],
               stop: threading.Event, hashing: bool,
               filled: Callable[[str, int], None] | None = None) -> list[tuple[Placement, Filled]]:
    """Fill one file; returns each box with its digest (None when not hashing) and CRC-32 (None
    unless asked for); `read_back` gets the read-backs of the file's other checksummed ranges.
    `filled(name, upto)` is told how far from the start the file is final: as each box lands when
    the file is written front to back (`_front_to_back`), and with its size once it is filled;
    only for a file no CRC can change afterwards (`final_when_filled`)."""
    check_stop(stop)
    final = filled is not None and final_when_filled(layout)
    growing = final and _front_to_back(layout)
    boxes: list[tuple[Placement, Filled]] = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, layout.size)
        fixed, done = sorted(layout.fixed, key=lambda f: f[0]), 0
        with OpenFiles() as files:
            filler = BoxFiller(index, files, fd, budget, progress, writeback=sync, stop=stop, hashing=hashing)
            for placement in layout.boxes:
                # the fixed bytes before this box first, so that a file is written front to back
                while done < len(fixed) and fixed[done][0] < placement.extents[0].offset:
                    pwrite_all(fd, memoryview(fixed[done][1]), fixed[done][0])
                    done += 1
                boxes.append((placement, filler.fill(placement, pieces[id(placement)])))
                if growing:
                    filled(layout.name, placement.extents[-1].offset + placement.extents[-1].nbytes)
        for offset, data in fixed[done:]:
            pwrite_all(fd, memoryview(data), offset)
        for name, offset, nbytes in layout.checksums:
            read_back.append((name, pool.submit(_crc_at, path, (Extent(offset, nbytes),))))
        if sync:
            start_writeback(fd)  # the fixed bytes and anything left
    finally:
        os.close(fd)
    if final:
        filled(layout.name, layout.size)
    return boxes


def _front_to_back(layout: FileLayout) -> bool:
    """The fill writes this file in order: every fixed byte lies before the first box, and the
    boxes' extents follow one another; so once a box is filled, every byte before its end is
    final."""
    extents = [e for p in layout.boxes for e in p.extents]
    if not extents:
        return False
    first = extents[0].offset
    if any(at + len(data) > first for at, data in layout.fixed):
        return False
    return all(a.offset + a.nbytes <= b.offset for a, b in zip(extents, extents[1:]))


def final_when_filled(layout: FileLayout) -> bool:
    """A file whose format records no CRC of its bytes gets no patch after the fill (the writers'
    patches are what CRCs turn into: `core.io.output.Finished`)."""
    return not layout.checksums and not any(p.checksum is not None for p in layout.boxes)


def source_checksums(index: CheckpointIndex, placements: list[Placement],
                     pieces: dict[int, Pieces]) -> dict[tuple[Path, int, int], int]:
    """The byte ranges of the source a copy reads from whose CRC-32 the format stores (torch.save
    storages), as `{(path, offset, nbytes): crc}`: each is checked once, whatever reads it."""
    seen: set[int] = set()
    out: dict[tuple[Path, int, int], int] = {}
    for placement in placements:
        entry = index.tensors[placement.tensor.fqn]
        for chunk, _region in pieces[id(placement)]:
            if id(chunk) not in seen:
                seen.add(id(chunk))
                loc = index.locate(chunk, entry)
                if isinstance(loc, Location) and loc.checksum is not None:
                    offset, nbytes, crc = loc.checksum
                    out[(loc.path, offset, nbytes)] = crc
    return out


def _crc_at(path: Path, extents: tuple[Extent, ...]) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return crc_of(fd, extents, path)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Executed:
    """The CRC-32s a layout asked for, by id, what each storing rank wrote and read, each
    file's boxes with their digests (`boxes`, by file name), and, once `finish` has patched the
    files, every data file's digests for the manifest (`files`)."""

    crcs: dict[str, int]
    ranks: tuple[RankStats, ...]
    boxes: dict[str, list[tuple[Placement, str | None]]] = field(default_factory=dict)
    files: tuple[FileDigest, ...] = ()

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)


def _rank_stats(placements: list[Placement], pieces: dict[int, Pieces]) -> tuple[RankStats, ...]:
    """The `--plan` figures of what was actually copied, from the pieces the copy used."""
    written: dict[int, int] = {}
    read: dict[int, int] = {}
    files: dict[int, set[str]] = {}
    for p in placements:
        rank = p.box.rank
        written[rank] = written.get(rank, 0) + p.nbytes
        read[rank] = read.get(rank, 0) + sum(r.volume for _, r in pieces[id(p)]) * p.tensor.source_dtype.itemsize
        files.setdefault(rank, set()).update(chunk.file for chunk, _ in pieces[id(p)])
    return tuple(RankStats(r, written[r], read[r], len(files[r])) for r in sorted(written))


def execute(layout: OutputLayout, index: CheckpointIndex, out_dir: Path, *, jobs: int | None = None,
            max_memory: int = DEFAULT_MAX_MEMORY, progress: Progress | None = None,
            sync: bool = True, hashing: bool = True, filled: Callable[[str, int], None] | None = None) -> Executed:
    """Create and fill every data file of `layout` in `out_dir`.

    The files are not yet durable: `finish` writes the writer's patches and fsyncs them. The
    source ranges whose CRC-32 their format records are checked meanwhile, on the same workers;
    a mismatch fails the run (its output is never committed). With `hashing`, every box's digest
    is taken from the bytes as they are written (`BoxFiller.fill`). `filled` is told how much of
    each file is final as soon as it is (`_fill_file`: an upload to an object store goes up as the
    file grows).
    """
    jobs = max(1, jobs or default_jobs())
    lock = threading.Lock()

    def report(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    placements = [p for f in layout.files for p in f.boxes]
    pieces = source_pieces(index, placements)
    budget = max(1, max_memory // max(1, min(jobs, len(layout.files))))  # per file being filled at once
    checks = source_checksums(index, placements, pieces)
    read_back: list[tuple[str, Future]] = []  # CRC-32s of ranges that are not one box
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="hpckpt-engine")
    # the sources' checks interleaved with the fills, so that they run while the disk writes
    work = [(check_source, (path, offset, nbytes, crc)) for (path, offset, nbytes), crc in checks.items()]
    files = [(_fill_file, (out_dir / f.name, f, index, pieces, budget, report, sync, pool, read_back, stop, hashing,
                            filled))
             for f in layout.files]
    order = [job for pair in zip_longest(files, work) for job in pair if job is not None]
    submitted: list[Future] = []
    writers: list[Future] = []
    try:
        for fn, args in order:
            submitted.append(pool.submit(fn, *args))
            if fn is _fill_file:
                writers.append(submitted[-1])
        for future in submitted:
            future.result()
        boxes = {f.name: future.result() for f, future in zip(layout.files, writers)}
        crcs = {**_box_crcs(boxes), **{name: future.result() for name, future in read_back}}
        digests = {name: [(p, sums.digest) for p, sums in filled] for name, filled in boxes.items()}
        result = Executed(crcs, _rank_stats(placements, pieces), digests)
    except BaseException:
        _stop_workers(pool, stop, writers)
        raise
    pool.shutdown(wait=True)
    return result


def _box_crcs(boxes: dict[str, list[tuple[Placement, Filled]]]) -> dict[str, int]:
    """The CRC-32 of every box whose placement asked for one, by its id (taken as it was written)."""
    return {p.checksum: sums.crc for filled in boxes.values() for p, sums in filled if p.checksum is not None}


def _stop_workers(pool: ThreadPoolExecutor, stop: threading.Event, writers: list[Future]) -> None:
    """Cancel the files not started, tell the running workers to stop, and wait only for those
    that write (a source check or CRC read left running writes nothing)."""
    stop.set()
    pool.shutdown(wait=False, cancel_futures=True)
    wait_for([f for f in writers if not f.cancelled()])  # (`wait` never returns for a cancelled one)


def finish(layout: OutputLayout, finished: Finished, out_dir: Path, *, sync: bool = True,
           done: Executed | None = None) -> tuple[FileDigest, ...]:
    """Write the writer's patches over the data files, then make the data files durable;
    returns every data file's digests when `done` hashed its boxes (else nothing)."""
    _write_patches(finished.patches, out_dir)
    if sync:
        fsync_files(out_dir / f.name for f in layout.files)
    if done is None or any(d is None for boxes in done.boxes.values() for _, d in boxes):
        return ()
    return tuple(file_digests(f, done.boxes.get(f.name, []), finished) for f in layout.files)


def _write_patches(patches: tuple[tuple[str, int, bytes], ...], out_dir: Path) -> None:
    """Each file opened once for all its patches (a torch.save file has one per tensor), which are
    written in the writer's order."""
    by_file: dict[str, list[tuple[int, bytes]]] = {}
    for name, offset, data in patches:
        by_file.setdefault(name, []).append((offset, data))
    for name, writes in by_file.items():
        fd = os.open(out_dir / name, os.O_WRONLY)
        try:
            for offset, data in writes:
                pwrite_all(fd, memoryview(data), offset)
        finally:
            os.close(fd)


def file_digests(f: FileLayout, boxes: list[tuple[Placement, str]], finished: Finished) -> FileDigest:
    """A written file's digests from what was written into it, without reading it: its boxes'
    digests and the bytes around them (fixed bytes, then the writer's patches over them)."""
    extents = [(e.offset, e.nbytes) for p, _ in boxes for e in p.extents]
    writes = [*f.fixed, *((at, data) for name, at, data in finished.patches if name == f.name)]
    starts = sorted((o, n) for o, n in extents if n)  # disjoint: a patch's neighbours tell (no scan per patch)
    for at, data in writes[len(f.fixed):]:
        i = bisect.bisect_left(starts, (at + len(data),))
        if i and starts[i - 1][0] + starts[i - 1][1] > at:
            raise AssertionError(f"{f.name}: a patch at {at} overwrites box bytes the digest was taken of")
    segments = digest.gap_digests(f.size, extents, writes)
    segments += digest.box_segments([(tuple((e.offset, e.nbytes) for e in p.extents), d) for p, d in boxes])
    return FileDigest(f.name, f.size, digest.file_digest(segments),
                      tuple(BoxDigest(p.tensor.fqn, p.box.box.offsets, p.box.box.sizes,
                                      tuple((e.offset, e.nbytes) for e in p.extents), d) for p, d in boxes))
