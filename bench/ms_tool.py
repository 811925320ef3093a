"""Run one of MindSpore's own checkpoint tools, as `bench/bench_mindspore.py` measures it.

    python bench/ms_tool.py ckpt-to-st   SRC.ckpt OUTDIR          mindspore.ckpt_to_safetensors
    python bench/ms_tool.py st-to-ckpt   SRC.safetensors OUTDIR   mindspore.safetensors_to_ckpt
    python bench/ms_tool.py unified      SRC_DIR STRATEGY OUTDIR  mindspore.parallel.unified_safetensors
    python bench/ms_tool.py transform    SRC_DIR SRC_STRATEGY DST_STRATEGY OUTDIR [--format ckpt|safetensors]
                                                                  mindspore.transform_checkpoints
    python bench/ms_tool.py load         SRC.ckpt                 mindspore.load_checkpoint (whole file)

Each call is the documented public API with its defaults (process_num / processes_num 1,
unified_safetensors' max_process_num 64, which it caps by its ~3 GiB output parts: 1 process here).
Prints one JSON line: seconds spent inside the call (after `import mindspore`) and whether the
MemFree guard of `load_checkpoint` had to be patched.

The MemFree guard: `load_checkpoint` of a .ckpt refuses a file larger than
`mindspore.train.serialization._get_available_memory()`, which is `SC_AVPHYS_PAGES` (MemFree,
not MemAvailable: the page cache counts as used). When MemFree is below the largest .ckpt the call
reads plus 256 MiB, this script replaces that function by one returning MemAvailable (what the
guard means to check), and reports `memfree_patched: true`. It changes no data path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def guard_memfree(ckpt_files: list[Path]) -> bool:
    largest = max((p.stat().st_size for p in ckpt_files), default=0)
    if _meminfo("MemFree") >= largest + 256 * 2**20:
        return False
    import mindspore.train.serialization as ser

    ser._get_available_memory = lambda: _meminfo("MemAvailable")
    return True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", choices=["ckpt-to-st", "st-to-ckpt", "unified", "transform", "load"])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--format", default="ckpt", choices=["ckpt", "safetensors"])
    args = parser.parse_args()

    t_import = time.perf_counter()
    import mindspore as ms

    import_s = time.perf_counter() - t_import
    p = args.paths
    patched = False
    t0 = time.perf_counter()
    if args.op == "ckpt-to-st":
        patched = guard_memfree([p[0]])
        ms.ckpt_to_safetensors(str(p[0]), save_path=str(p[1]))
    elif args.op == "st-to-ckpt":
        ms.safetensors_to_ckpt(str(p[0]), save_path=str(p[1]))
    elif args.op == "unified":
        from mindspore.parallel import unified_safetensors

        unified_safetensors(str(p[0]), str(p[1]), str(p[2]))
    elif args.op == "transform":
        patched = guard_memfree(sorted(p[0].rglob("*.ckpt")))
        ms.transform_checkpoints(str(p[0]), str(p[3]), "checkpoint_", str(p[1]), str(p[2]),
                                 output_format=args.format)
    elif args.op == "load":
        patched = guard_memfree([p[0]])
        params = ms.load_checkpoint(str(p[0]))
        n = sum(int(v.size) for v in params.values())
        print(json.dumps({"elements": n}), file=sys.stderr)
    inside = time.perf_counter() - t0
    print(json.dumps({"import_s": import_s, "tool_s": inside, "memfree_patched": patched,
                      "memfree_mib": _meminfo("MemFree") // 2**20}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
