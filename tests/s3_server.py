"""A real S3-compatible server for the tests: moto's server mode on 127.0.0.1, in this process,
and the environment that points hpckpt (and boto3) at it. Also runnable by hand:
`python tests/s3_server.py` serves until Ctrl-C and prints the variables to export."""

from __future__ import annotations

import logging
import os
from pathlib import Path


def start():
    """Start a server on a free loopback port; returns `(server, endpoint)`."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def environment(endpoint: str) -> dict[str, str]:
    """What a process needs to reach the server (credentials: any value)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "hpckpt-test", "AWS_SECRET_ACCESS_KEY": "hpckpt-test",
            "AWS_REGION": "us-east-1", "HPCKPT_STORE_RETRY_SECONDS": "20"}


def client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="hpckpt-test",
                        aws_secret_access_key="hpckpt-test", region_name="us-east-1")


def upload_tree(s3, local: Path, bucket: str, prefix: str) -> None:
    """Every file under `local` as `prefix/relative` (the checkpoint as a user would copy it up)."""
    for path in sorted(local.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}".lstrip("/"))


def download_tree(s3, bucket: str, prefix: str, local: Path) -> dict[str, bytes]:
    """Every object under `prefix/` (name -> bytes), also written under `local` when given."""
    out: dict[str, bytes] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) + 1:]
            out[name] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            if local is not None:
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                (local / name).write_bytes(out[name])
    return out


if __name__ == "__main__":
    import time

    srv, url = start()
    for key, value in environment(url).items():
        print(f"export {key}={value}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()
