"""Microbenchmark: kernel copy vs copy through user space, the two paths of hpckpt's engine.

    python bench/write_path_micro.py SRC_DIR SCRATCH_FILE [--repeat 3] [--chunk-mib 8 | --chunk-kib 800]

Concatenates every `*.safetensors` file of SRC_DIR into SCRATCH_FILE (pre-sized with ftruncate, as
the engine does), a chunk at a time, four ways, round-robin: `copy_file_range` (the engine's
direct path; with one chunk as large as the files, what `cp` does), `preadv` into a fresh
`np.empty` buffer + `pwrite` (the engine's gather path, which allocates a buffer per tile), the
same with one reused buffer, and the sources mapped, each chunk hashed with XXH3-128 and written
from the mapping (`mmap + xxh3 + pwrite`: the engine's path when it records the manifest's
digests); then fsyncs and deletes the file. Prints copy time (the writes, fsync excluded), the
process's CPU for the copy (user + system) per GiB, the `pwrite` share and the fsync time.
"""

from __future__ import annotations

import argparse
import glob
import mmap
import os
import resource
import time

import numpy as np
import xxhash

MODES = ("copy_file_range", "pread+pwrite, fresh buffer", "pread+pwrite, reused buffer", "mmap + xxh3 + pwrite")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(sources: list[str], dst: str, mode: str, chunk: int) -> tuple[float, float, float, float]:
    total = sum(os.stat(s).st_size for s in sources)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(out, total)
    reused = np.empty(chunk, np.uint8)
    pos, in_pwrite = 0, 0.0
    started, cpu = time.perf_counter(), _cpu()
    for source in sources:
        fd, size, offset = os.open(source, os.O_RDONLY), os.stat(source).st_size, 0
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if mode == "mmap + xxh3 + pwrite" and size else None
        view = memoryview(mapped) if mapped is not None else None
        while offset < size:
            n = min(chunk, size - offset)
            if mode == "copy_file_range":
                done = 0
                while done < n:
                    done += os.copy_file_range(fd, out, n - done, offset + done, pos + done)
            elif view is not None:
                piece = view[offset:offset + n]
                xxhash.xxh3_128(piece).digest()
                t = time.perf_counter()
                os.pwrite(out, piece, pos)
                in_pwrite += time.perf_counter() - t
                piece.release()
            else:
                buf = reused[:n] if mode == "pread+pwrite, reused buffer" else np.empty(n, np.uint8)
                os.preadv(fd, [memoryview(buf)], offset)
                t = time.perf_counter()
                os.pwrite(out, memoryview(buf), pos)
                in_pwrite += time.perf_counter() - t
            offset += n
            pos += n
        if view is not None:
            view.release()
            mapped.close()
        os.close(fd)
    copy, cpu = time.perf_counter() - started, _cpu() - cpu
    t = time.perf_counter()
    os.fsync(out)
    sync = time.perf_counter() - t
    os.close(out)
    os.unlink(dst)
    return copy, cpu, in_pwrite, sync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--chunk-kib", type=int, help="the chunk in KiB (overrides --chunk-mib)")
    args = parser.parse_args()
    chunk = args.chunk_kib << 10 if args.chunk_kib else args.chunk_mib << 20
    sources = sorted(glob.glob(os.path.join(args.src, "*.safetensors")))
    total = sum(os.stat(s).st_size for s in sources)
    print(f"{len(sources)} files, {total / 1e9:.2f} GB, chunks of {chunk >> 10} KiB")
    for rep in range(args.repeat):
        for mode in MODES:
            copy, cpu, in_pwrite, sync = run(sources, args.dst, mode, chunk)
            print(f"run {rep + 1} {mode:28}: copy {copy:6.3f} s ({total / copy / 1e9:4.2f} GB/s), "
                  f"CPU {cpu / (total / 2**30):5.3f} s a GiB, pwrite {in_pwrite:6.3f} s, fsync {sync:6.3f} s",
                  flush=True)


if __name__ == "__main__":
    main()
