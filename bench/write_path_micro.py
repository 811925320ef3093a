"""Microbenchmark: kernel copy vs copy through user space, the two paths of hpckpt's engine.

    python bench/write_path_micro.py SRC_DIR SCRATCH_FILE [--repeat 3] [--chunk-mib 8]

Concatenates every `*.safetensors` file of SRC_DIR into SCRATCH_FILE (pre-sized with ftruncate, as
the engine does), `--chunk-mib` at a time, three ways, round-robin: `copy_file_range` (the engine's
direct path), `preadv` into a fresh `np.empty` buffer + `pwrite` (the engine's gather path, which
allocates a buffer per tile), and the same with one reused buffer; then fsyncs and deletes the
file. Prints copy time (the writes, fsync excluded), the `pwrite` share and the fsync time.
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import numpy as np


def run(sources: list[str], dst: str, mode: str, chunk: int) -> tuple[float, float, float]:
    total = sum(os.stat(s).st_size for s in sources)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(out, total)
    reused = np.empty(chunk, np.uint8)
    pos, in_pwrite = 0, 0.0
    started = time.perf_counter()
    for source in sources:
        fd, size, offset = os.open(source, os.O_RDONLY), os.stat(source).st_size, 0
        while offset < size:
            n = min(chunk, size - offset)
            if mode == "copy_file_range":
                os.copy_file_range(fd, out, n, offset, pos)
            else:
                buf = reused[:n] if mode == "pread+pwrite, reused buffer" else np.empty(n, np.uint8)
                os.preadv(fd, [memoryview(buf)], offset)
                t = time.perf_counter()
                os.pwrite(out, memoryview(buf), pos)
                in_pwrite += time.perf_counter() - t
            offset += n
            pos += n
        os.close(fd)
    copy = time.perf_counter() - started
    t = time.perf_counter()
    os.fsync(out)
    sync = time.perf_counter() - t
    os.close(out)
    os.unlink(dst)
    return copy, in_pwrite, sync


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=8)
    args = parser.parse_args()
    sources = sorted(glob.glob(os.path.join(args.src, "*.safetensors")))
    total = sum(os.stat(s).st_size for s in sources)
    print(f"{len(sources)} files, {total / 1e9:.2f} GB, chunks of {args.chunk_mib} MiB")
    for rep in range(args.repeat):
        for mode in ("copy_file_range", "pread+pwrite, fresh buffer", "pread+pwrite, reused buffer"):
            copy, in_pwrite, sync = run(sources, args.dst, mode, args.chunk_mib << 20)
            print(f"run {rep + 1} {mode:28}: copy {copy:6.3f} s ({total / copy / 1e9:4.2f} GB/s), "
                  f"pwrite {in_pwrite:6.3f} s, fsync {sync:6.3f} s", flush=True)


if __name__ == "__main__":
    main()
