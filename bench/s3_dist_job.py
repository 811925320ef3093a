"""One rank of the object-storage bench (`bench/bench_s3.py`), under torchrun on CPU (gloo).

    torchrun --nproc-per-node N bench/s3_dist_job.py BUCKET SIZE_MIB ROUNDS OUT_JSON

Every rank holds its row shard of 8 float32 tensors (SIZE_MIB in all, `DTensor`s sharded on dim 0
over the job). Each round, each contender saves the state to `s3://BUCKET/<contender>-r<round>`
and loads it back into zeroed tensors of the same sharding, checked equal; a save or a load is
timed from a barrier to a barrier (the job's time). The server's address and credentials come
from the environment (`AWS_ENDPOINT_URL`, ...). Rank 0 writes the seconds to OUT_JSON.

Contenders: hpckpt.dist (`checkpoint_id="s3://..."`); torch DCP with its fsspec writer and reader
(s3fs); torch DCP with AWS's s3torchconnector writer and reader (its CRT client, path-style
addressing for a custom endpoint).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import hpckpt.dist as hdist

TENSORS = 8


def state(mesh, total_bytes: int, fill: bool) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    cols = 1024
    rows = max(1, total_bytes // (TENSORS * 4 * cols * world))
    out = {}
    for i in range(TENSORS):
        local = torch.zeros(rows, cols)
        if fill:
            local = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + (rank * 1000 + i)
        out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return out


def s3tc_fs():
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem

    client = S3Client("us-east-1", endpoint=os.environ["AWS_ENDPOINT_URL"],
                      s3client_config=S3ClientConfig(force_path_style=True))
    return S3FileSystem("us-east-1", s3_client=client)


def s3tc_writer(url: str):
    from s3torchconnector.dcp import S3StorageWriter

    writer = S3StorageWriter(region="us-east-1", path=url)
    writer.fs = s3tc_fs()  # the endpoint: its own constructor takes none
    return writer


def s3tc_reader(url: str):
    from s3torchconnector.dcp import S3StorageReader

    reader = S3StorageReader(region="us-east-1", path=url)
    reader.fs = s3tc_fs()
    return reader


CONTENDERS = {
    "hpckpt": (lambda sd, url: hdist.save(sd, checkpoint_id=url), lambda sd, url: hdist.load(sd, checkpoint_id=url)),
    "torch_dcp_fsspec": (lambda sd, url: dcp.save(sd, storage_writer=FsspecWriter(url)),
                         lambda sd, url: dcp.load(sd, storage_reader=FsspecReader(url))),
    "s3torchconnector": (lambda sd, url: dcp.save(sd, storage_writer=s3tc_writer(url)),
                         lambda sd, url: dcp.load(sd, storage_reader=s3tc_reader(url))),
}


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> int:
    warnings.simplefilter("ignore")
    bucket, size_mib, rounds, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    saved = state(mesh, size_mib << 20, fill=True)
    seconds = {name: {"save": [], "load": []} for name in CONTENDERS}
    for r in range(rounds):
        for name, (save, load) in CONTENDERS.items():
            url = f"s3://{bucket}/{name}-r{r}"
            seconds[name]["save"].append(timed(lambda: save(saved, url)))
            target = state(mesh, size_mib << 20, fill=False)
            seconds[name]["load"].append(timed(lambda: load(target, url)))
            for key, tensor in saved.items():
                if not torch.equal(target[key].to_local(), tensor.to_local()):
                    raise SystemExit(f"{name}: {key} differs after the load")
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "bytes": sum(
                t.to_local().numel() * 4 for t in saved.values()) * dist.get_world_size(), "seconds": seconds}, f)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.05)  # torch's exit abort after the job's own last collective: README, "Clean exits"
    return 0


if __name__ == "__main__":
    sys.exit(main())
