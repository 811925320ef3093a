"""CRC-32 as zip members and MindSpore's `.ckpt` trailer carry it (zlib's polynomial).

From zlib-ng (`zlib_ng.zlib_ng.crc32`, the same values as `zlib.crc32`): 23 GB/s on one core
here, where the standard library's zlib 1.2.13 does 4.2 (`bench/bench_manifest_cost.py --digests-only`). Every
`.pt` hpckpt writes and every zip or `.ckpt` CRC it checks goes through it: `convert --to pt` was
1.22-1.41x the time of `--to safetensors` with zlib's (docs/benchmarks.md, issue 29).
"""

from zlib_ng.zlib_ng import crc32

__all__ = ["crc32"]
