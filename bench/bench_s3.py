#!/usr/bin/env python3
"""Object storage, side by side on one S3-compatible server (moto's server mode, in its own
process on 127.0.0.1), as ratios in one run:

1. live save to S3 and load from S3, 4 torchrun ranks (`bench/s3_dist_job.py`): hpckpt.dist vs
   torch DCP's fsspec writer/reader (s3fs) vs AWS's s3torchconnector DCP writer/reader;
2. `hpckpt reshard s3://A -o s3://B` vs what one does without it: download the checkpoint,
   reshard it locally (`hpckpt reshard`, the fastest local tool), upload the result (the
   transfers with obstore, 8 files at once: the fastest client measured, bench/bench_s3_clients.py).

    python bench/bench_s3.py [--size-mib 256] [--rounds 3] [--ranks 4] [--server moto|s3rver]

Needs, beyond `.[test]`: s3fs and s3torchconnector (`pip install s3fs s3torchconnector tenacity`;
s3torchconnector takes the installed torch). Prints a table and writes bench/out/s3-SERVER.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import s3_server  # noqa: E402

BUCKET = "bench"


S3RVER = REPO / "bench" / "out" / "s3rver" / "node_modules" / ".bin" / "s3rver"


def start_s3rver() -> tuple[subprocess.Popen, dict]:
    """s3rver (Node.js, objects on disk): ranged reads cost what they read, where moto's cost the
    whole object (it reads a large object from its spool file for every range); it has no
    conditional writes (hpckpt then relies on reading its mark back: README, "Object storage")."""
    import socket

    if not S3RVER.exists():
        raise SystemExit(f"{S3RVER} is missing: npm install --prefix {S3RVER.parents[2]} s3rver@3")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = Path(tempfile.mkdtemp(prefix="hpckpt-s3rver-"))
    proc = subprocess.Popen([str(S3RVER), "-d", str(data), "-p", str(port), "-a", "127.0.0.1",
                             "--configure-bucket", BUCKET], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    proc.data_dir = data  # removed with the server (`main`)
    while "listening" not in (proc.stdout.readline() or "listening"):
        pass
    return proc, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "S3RVER",
                  "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_REGION": "us-east-1"}


def start_server() -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "s3_server.py")], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    env = {}
    while len(env) < len(s3_server.environment("x")):
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("the S3 server did not start")
        key, _, value = line.strip().removeprefix("export ").partition("=")
        env[key] = value
    return proc, env


def best(times: list[float]) -> float:
    return min(times[1:] or times)  # the first round warms imports and connections


def live(env: dict, size_mib: int, rounds: int, ranks: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "live.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(ranks),
                           str(REPO / "bench" / "s3_dist_job.py"), BUCKET, str(size_mib), str(rounds), str(out)],
                          env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the live job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def hpckpt(env: dict, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "hpckpt", *args], env={**os.environ, **env}, check=True,
                   stdout=subprocess.DEVNULL)


def transfer(store, pairs, up: bool) -> None:
    import obstore

    def one(pair):
        key, local = pair
        if up:
            obstore.put(store, key, local, chunk_size=8 << 20, max_concurrency=8)
        else:
            local.parent.mkdir(parents=True, exist_ok=True)
            with open(local, "wb") as f:
                for chunk in obstore.get(store, key).stream(min_chunk_size=8 << 20):
                    f.write(chunk)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, pairs))


def reshard_rows(env: dict, source: str, rounds: int, ranks: int) -> dict:
    os.environ.update(env)
    import obstore
    from obstore.store import from_url

    store = from_url(f"s3://{BUCKET}", client_options={"allow_http": True})
    target = str(max(1, ranks // 2))
    direct, around = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        hpckpt(env, "reshard", f"s3://{BUCKET}/{source}", "-o", f"s3://{BUCKET}/direct-{r}", "--world-size", target)
        direct.append(time.perf_counter() - t0)
        work = Path(tempfile.mkdtemp(prefix="hpckpt-bench-s3-"))
        try:
            t0 = time.perf_counter()
            keys = [m["path"] for batch in obstore.list(store, f"{source}/") for m in batch]
            transfer(store, [(k, work / "in" / k[len(source) + 1:]) for k in keys], up=False)
            hpckpt(env, "reshard", str(work / "in"), "-o", str(work / "out"), "--world-size", target)
            files = [p for p in (work / "out").rglob("*") if p.is_file()]
            transfer(store, [(f"around-{r}/{p.relative_to(work / 'out').as_posix()}", p) for p in files], up=True)
            around.append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return {"direct": direct, "download_reshard_upload": around}


def ceiling_rows(env: dict, nbytes: int, rounds: int, ranks: int) -> dict:
    """What the server itself allows, no checkpoint code at all: the same bytes as `ranks`
    objects put at once from memory by obstore, as multipart uploads (8 MiB parts, 4 in flight:
    how every contender's save goes up) and as single PUTs, then read back whole."""
    os.environ.update(env)
    import obstore
    from obstore.store import from_url

    store = from_url(f"s3://{BUCKET}", client_options={"allow_http": True})
    data = os.urandom(nbytes // ranks)
    out: dict[str, list[float]] = {"multipart": [], "single_put": [], "get": []}
    for r in range(rounds):
        for how in ("multipart", "single_put"):
            keys = [f"ceiling-{how}-{r}/{i}" for i in range(ranks)]
            kw = dict(chunk_size=8 << 20, max_concurrency=4) if how == "multipart" else dict(use_multipart=False)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(ranks) as pool:
                list(pool.map(lambda k: obstore.put(store, k, data, **kw), keys))
            out[how].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(ranks) as pool:
            list(pool.map(lambda k: obstore.get(store, k).bytes(), keys))
        out["get"].append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--server", choices=("moto", "s3rver"), default="moto")
    args = ap.parse_args()
    server, env = start_s3rver() if args.server == "s3rver" else start_server()
    try:
        if args.server == "moto":
            s3_server.client(env["AWS_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
        figures = live(env, args.size_mib, args.rounds, args.ranks)
        figures["reshard"] = reshard_rows(env, "hpckpt-r0", args.rounds, args.ranks)
        figures["ceiling"] = ceiling_rows(env, figures["bytes"], args.rounds, args.ranks)
    finally:
        server.terminate()
        server.wait()
        if getattr(server, "data_dir", None) is not None:
            shutil.rmtree(server.data_dir, ignore_errors=True)
    nbytes = figures["bytes"]
    rows = []
    for op in ("save", "load"):
        times = {name: best(v[op]) for name, v in figures["seconds"].items()}
        peers = min(t for name, t in times.items() if name != "hpckpt")
        for name, t in times.items():
            rows.append((f"live {op}, {figures['world_size']} ranks", name, t, nbytes / t / 2**20, peers / times["hpckpt"]))
    times = {name: best(v) for name, v in figures["reshard"].items()}
    for name, t in times.items():
        rows.append((f"reshard s3 -> s3, {args.ranks} -> {max(1, args.ranks // 2)}", name, t, nbytes / t / 2**20,
                     times["download_reshard_upload"] / times["direct"]))
    for name, t in ((k, best(v)) for k, v in figures["ceiling"].items()):
        rows.append(("server alone (obstore)", name, t, nbytes / t / 2**20, float("nan")))
    print(f"{nbytes / 2**20:.0f} MiB, best of rounds 2..{args.rounds} ({args.server} server, 127.0.0.1)")
    print(f"{'row':<28} {'contender':<26} {'seconds':>8} {'MiB/s':>8} {'hpckpt vs best peer':>20}")
    for row, name, t, rate, ratio in rows:
        print(f"{row:<28} {name:<26} {t:8.2f} {rate:8.0f} {ratio:19.2f}x")
    figures["server"] = args.server
    out = REPO / "bench" / "out" / f"s3-{args.server}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
