"""The shard map page of a large checkpoint: its size, the time to write it, and the time a real
headless Chromium takes to open and draw it.

The checkpoint is HyperParallel metadata alone (`--ranks` x `--tensors`, every tensor split by
rows over every rank, as FSDP saves; no data files: `inspect` reads only metadata). Goal (issue
28): a 1,024-rank, 1,000-tensor page under ~10 MB that draws in under 2 s.

    python bench/bench_html.py --ranks 1024 --tensors 1000
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from hp_reference import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageInfo,  # noqa: E402
                          TensorProperties, TensorStorageMetadata, dump_hp)


def make(root: Path, ranks: int, tensors: int) -> None:
    root.mkdir(parents=True)
    state, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t // 8}.mlp.w{t % 8}.weight"
        state[fqn] = TensorStorageMetadata(TensorProperties("torch.bfloat16"), (ranks * 8, 4096),
                                           [ChunkStorageMetadata((8 * r, 0), (8, 4096)) for r in range(ranks)])
        for r in range(ranks):
            storage[MetadataIndex(fqn, (8 * r, 0), r)] = StorageInfo(f"_rank{r}_.safetensors", 0, 8 * 4096 * 2, fqn)
    (root / ".metadata").write_bytes(dump_hp(Metadata(state, {k: (k,) for k in state}, storage)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=1000)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hpckpt-bench-html-"))
    try:
        root, page = scratch / "ckpt", scratch / "map.html"
        started = time.perf_counter()
        make(root, args.ranks, args.tensors)
        made = time.perf_counter() - started
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "hpckpt", "inspect", str(root), "--summary", "--html", str(page)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr)
        written = time.perf_counter() - started
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        started = time.perf_counter()
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={scratch / 'p'}",
                              "--virtual-time-budget=20000", "--dump-dom", f"{page.as_uri()}#t=model.layers.7.mlp.w3.weight"],
                             capture_output=True, text=True, timeout=300).stdout
        browser = time.perf_counter() - started
        render_ms = int(re.search(r'data-render-ms="(\d+)"', dom).group(1))
        boxes = len(re.findall(r'class="box', dom))
        print(f"| {args.ranks} ranks x {args.tensors} tensors ({args.ranks * args.tensors:,} chunks) | "
              f"page {page.stat().st_size / 2**20:.2f} MiB | `inspect --summary --html` {written:.2f} s | "
              f"page's script (decompress, list, draw one tensor of {boxes} boxes, bars) {render_ms} ms | "
              f"Chromium start to DOM dump {browser:.2f} s | (metadata made in {made:.1f} s) |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
