"""PyTorch's own consolidation tools, one call per process (timed from outside by bench_engine.py).

    python bench/torch_consolidate.py dcp-to-torch-save DCP_DIR OUT.pt
    python bench/torch_consolidate.py hf-safetensors HF_SHARDS_DIR OUT_DIR

`dcp-to-torch-save`: `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`, which loads
the whole state into memory (no process group) and `torch.save`s it.

`hf-safetensors`: `torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files`,
which merges the sharded safetensors written by `HuggingFaceStorageWriter(save_distributed=True)`
(DCP offsets in each file's `__metadata__`) into `OUT_DIR/model-00001-of-00001.safetensors` and
`model.safetensors.index.json`; every tensor goes to file 1 (the mapping is read from the shard
headers, as a user without the training code would have to). Prints the seconds of the call itself.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time


def _hf_keys(directory: str) -> list[str]:
    keys: list[str] = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            keys += [k for k in header if k != "__metadata__" and k not in keys]
    return keys


def main() -> None:
    mode, src, dst = sys.argv[1:4]
    if mode == "dcp-to-torch-save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        t0 = time.perf_counter()
        dcp_to_torch_save(src, dst)
    elif mode == "hf-safetensors":
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        t0 = time.perf_counter()
        os.makedirs(dst, exist_ok=True)
        consolidate_safetensors_files(src, dst, dict.fromkeys(_hf_keys(src), 1))
    else:
        sys.exit(f"unknown mode {mode!r}")
    print(json.dumps({"call_s": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
