#!/usr/bin/env python3
"""Ranged reads of one 256 MiB object on the moto server: obstore (8 MiB ranges, concurrent)
vs s3fs (cat_ranges) vs boto3 (sequential ranged GETs)."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import s3_server
srv, ep = s3_server.start(); os.environ.update(s3_server.environment(ep))
s3 = s3_server.client(ep); s3.create_bucket(Bucket="speed")
data = os.urandom(256 << 20); s3.put_object(Bucket="speed", Key="big", Body=data)
piece = 8 << 20; starts = list(range(0, len(data), piece))
import obstore
from obstore.store import from_url
st = from_url("s3://speed", client_options={"allow_http": True})
def ob():
    got = obstore.get_ranges(st, "big", starts=starts, lengths=[piece]*len(starts)); return sum(len(memoryview(g)) for g in got)
import s3fs
fs = s3fs.S3FileSystem(endpoint_url=ep, key="hpckpt-test", secret="hpckpt-test")
def sf():
    got = fs.cat_ranges(["speed/big"]*len(starts), starts, [s+piece for s in starts]); return sum(map(len, got))
def bt():
    return sum(len(s3.get_object(Bucket="speed", Key="big", Range=f"bytes={s}-{s+piece-1}")["Body"].read()) for s in starts)
for name, f in (("obstore", ob), ("s3fs", sf), ("boto3", bt)):
    best = 1e9
    for _ in range(3):
        t = time.perf_counter(); n = f(); best = min(best, time.perf_counter() - t); assert n == len(data)
    print(f"{name}: {len(data)/best/2**20:.0f} MiB/s (best of 3)")
srv.stop()
