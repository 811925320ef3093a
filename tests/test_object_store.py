"""Checkpoints in object storage, against a real S3-compatible server (moto's server mode on
127.0.0.1, started here), a fault-injecting proxy in front of it (`s3_proxy.py`), and for `az://`
a real Azure Blob server (Azurite, `azure_server.py`).

What is proven: every offline command reads `s3://` sources and writes `s3://` destinations, and
what it writes is byte for byte what it writes locally (manifests compared without the fields that
name the run); `inspect` reads no data object; transient faults (503, a body cut off, slow answers)
are retried; a missing bucket, an unreachable endpoint and a URL without the extra installed give
one line and a documented exit code, and so does access denied (a second server enforcing IAM
policies); `--max-memory` bounds a write to a store; two writers to one prefix cannot both
succeed; what a killed write left is reported and removed by the next write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

import s3_proxy
import s3_server
from _util import file_tree, normalized_tree, run_torchrun
from incremental_chain import build_chain
from incremental_chain import expected as chain_expected

from hpckpt.cli.app import app
from hpckpt.core.storage.object_store import forget_stores

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tiny-hp"
FIXTURES = REPO / "tests" / "fixtures" / "hyperparallel"
BUCKET = "hpckpt-tests"
runner = CliRunner()


@pytest.fixture(scope="module")
def server():
    srv, endpoint = s3_server.start()
    saved = {k: os.environ.get(k) for k in s3_server.environment(endpoint)}
    os.environ.update(s3_server.environment(endpoint))
    s3 = s3_server.client(endpoint)
    s3.create_bucket(Bucket=BUCKET)
    s3_server.upload_tree(s3, EXAMPLE, BUCKET, "tiny-hp")
    s3_server.upload_tree(s3, FIXTURES / "m0-torch-4rank", BUCKET, "m0-torch-4rank")
    forget_stores()
    yield endpoint, s3
    forget_stores()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    srv.stop()


def hpckpt(*args: str, code: int = 0) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, (args, result.exit_code, result.output)
    return result.output


def objects(s3, prefix: str) -> dict[str, bytes]:
    return s3_server.download_tree(s3, BUCKET, prefix, None)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children first found, then theirs)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            queue += children
    return found


def url(key: str) -> str:
    return f"s3://{BUCKET}/{key}"


def test_reading_commands_read_a_store_as_a_directory(server, tmp_path):
    _endpoint, s3 = server
    for name, local in (("tiny-hp", EXAMPLE), ("m0-torch-4rank", FIXTURES / "m0-torch-4rank")):
        remote = json.loads(hpckpt("inspect", url(name), "--json"))
        here = json.loads(hpckpt("inspect", str(local), "--json"))
        assert remote.pop("path") == url(name) and here.pop("path") == str(local)
        assert remote == here
        assert json.loads(hpckpt("verify", "--deep", url(name), "--json"))["ok"] is True
        assert "0 differ" in hpckpt("diff", url(name), str(local))
    # checksum writes the manifest object; verify then checks the data against it
    s3_server.upload_tree(s3, FIXTURES / "m0-torch-4rank", BUCKET, "sums")
    forget_stores()
    hpckpt("checksum", url("sums"))
    assert ".hpckpt-manifest.jsonl" in objects(s3, "sums")
    assert json.loads(hpckpt("verify", "--deep", url("sums"), "--json"))["ok"] is True
    # a damaged data object is found
    name = next(n for n in objects(s3, "sums") if n.endswith(".safetensors"))
    data = bytearray(objects(s3, "sums")[name])
    data[-1] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=f"sums/{name}", Body=bytes(data))
    forget_stores()
    hpckpt("verify", "--deep", url("sums"), code=9)


def test_writes_to_a_store_are_the_local_bytes(server, tmp_path):
    """reshard, consolidate and convert, local -> s3, s3 -> s3 and s3 -> local: the objects are the
    files the same command writes locally."""
    _endpoint, s3 = server
    cases = [  # (command, the output's extension for a single file, options)
        ("reshard", "", "--world-size", "3"),
        ("consolidate", ".safetensors", "--format", "safetensors"),
        ("convert", "", "--to", "torch-dcp"),
        ("convert", "", "--to", "hf", "--max-shard-size", "1KB"),
        ("convert-ms-torch", ".ckpt", "--to", "mindspore"),
    ]
    for i, (command, extension, *options) in enumerate(cases):
        single = bool(extension)
        name = f"out{i}{extension}"
        local = tmp_path / name
        hpckpt(command, str(EXAMPLE), "-o", str(local), *options)
        expected = {local.name: local.read_bytes(), **{p.name: p.read_bytes() for p in tmp_path.glob(f"out{i}.*") if p != local}} \
            if single else file_tree(local)
        for source, dest in ((str(EXAMPLE), f"a/{name}"), (url("tiny-hp"), f"b/{name}")):
            hpckpt(command, source, "-o", url(dest), *options)
            if single:
                got = {k.rpartition("/")[2]: v for k, v in objects(s3, dest.rpartition("/")[0]).items()
                       if k.startswith(f"out{i}.")}
            else:
                got = objects(s3, dest)
            assert normalized_tree(got) == normalized_tree(expected), (command, source, dest)
            assert ".hpckpt-writing" not in "".join(got)
        back = tmp_path / f"back{i}"
        if not single:
            hpckpt("reshard" if command == "reshard" else "convert", url(f"b/{name}"), "-o", str(back),
                   *(options if command == "reshard" else ("--to", "hp")))
            assert json.loads(hpckpt("verify", "--deep", str(back), "--json"))["ok"] is True
    # an existing destination: refused, then replaced with --force (the old objects gone)
    hpckpt("reshard", url("tiny-hp"), "-o", url("b/out0"), "--world-size", "2", code=14)
    hpckpt("reshard", url("tiny-hp"), "-o", url("b/out0"), "--world-size", "2", "--force")
    assert sorted(n for n in objects(s3, "b/out0") if n.endswith(".safetensors")) == \
        ["_rank0_.safetensors", "_rank1_.safetensors"]
    # the destination may not be the source, lie inside it or contain it
    hpckpt("reshard", url("tiny-hp"), "-o", url("tiny-hp"), "--world-size", "2", "--force", code=16)
    hpckpt("reshard", url("tiny-hp"), "-o", url("tiny-hp/inner"), "--world-size", "2", code=16)


def test_inspect_reads_no_data_object_and_faults_are_retried(server, tmp_path, monkeypatch):
    endpoint, s3 = server
    with s3_proxy.Proxy(endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        forget_stores()
        # a HyperParallel checkpoint is inspected from its .metadata alone; a safetensors file from
        # its header (one 64 KiB range), never the tensors behind it
        hpckpt("inspect", url("m0-torch-4rank"), "--no-values")
        read = {k: n for k, n in proxy.body_bytes.items() if k != f"/{BUCKET}"}  # (not the listings)
        metadata = f"/{BUCKET}/m0-torch-4rank/.metadata"
        assert read == {metadata: len(objects(s3, "m0-torch-4rank")[".metadata"])}, read
        big = tmp_path / "big.safetensors"
        save_file({f"t{i}": np.full((1024, 1024), i, np.float32) for i in range(8)}, str(big))
        s3.upload_file(str(big), BUCKET, "single/big.safetensors")
        hpckpt("inspect", url("single/big.safetensors"))
        assert proxy.body_bytes[f"/{BUCKET}/single/big.safetensors"] <= 64 << 10, proxy.body_bytes
        # 503s, a body cut off half-way and slow answers: retried, and the result is right
        proxy.faults.add("503", contains="_rank0_.safetensors", count=2)
        proxy.faults.add("reset", contains="_rank1_.safetensors", count=1)
        proxy.faults.add("slow", contains=".metadata", count=1, delay=1.0)
        proxy.faults.add("503", method="PUT", contains="faulty", count=2)
        forget_stores()
        hpckpt("reshard", url("m0-torch-4rank"), "-o", url("faulty"), "--world-size", "2")
        assert proxy.faults.left() == 0
        hpckpt("reshard", str(FIXTURES / "m0-torch-4rank"), "-o", str(tmp_path / "here"), "--world-size", "2")
        assert normalized_tree(objects(s3, "faulty")) == normalized_tree(file_tree(tmp_path / "here"))
        # an output larger than one PUT goes up part by part as the engine fills it; when the fill
        # then fails (the second shard of the source cannot be read), that upload is aborted:
        # no object, no unfinished multipart upload left
        shards = tmp_path / "sharded"
        shards.mkdir()
        for i, name in enumerate(("a", "b")):
            save_file({name: np.full((5 * 1024, 1024), i, np.float32)}, str(shards / f"model-0000{i + 1}-of-00002.safetensors"))
        (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
        s3_server.upload_tree(s3, shards, BUCKET, "sharded")
        proxy.faults.add("503", contains="sharded/model-00002", count=1000, from_byte=1 << 20)
        monkeypatch.setenv("HPCKPT_STORE_RETRIES", "1")
        forget_stores()
        hpckpt("consolidate", url("sharded"), "-o", url("aborted/model.safetensors"), code=27)
        sent = [(m, p) for m, p, _ in list(proxy.requests) if "aborted/model.safetensors" in p]
        assert any(m == "POST" and "?uploads" in p for m, p in sent), sent  # it had started,
        assert any(m == "PUT" and "partNumber=" in p for m, p in sent), sent  # sent parts,
        assert any(m == "DELETE" and "uploadId=" in p for m, p in sent), sent  # and was aborted
        assert objects(s3, "aborted") == {}
        assert s3.list_multipart_uploads(Bucket=BUCKET, Prefix="aborted/").get("Uploads", []) == []
        # a single-file output is its own completion mark: streamed as it is written, but completed
        # only after its sidecar is up (a reader never finds the file without it), however slow the
        # steps between (here the reads of the writer's mark, slowed down: an upload completed as
        # soon as the file is filled would land before the sidecar)
        proxy.faults.add("slow", method="GET", contains="streamed/.model.safetensors.hpckpt-writing", count=1000,
                         delay=1.0)
        hpckpt("consolidate", str(shards), "-o", url("streamed/model.safetensors"))
        sent = [(m, p) for m, p, _ in list(proxy.requests) if "/streamed/" in p]
        completed = [i for i, (m, p) in enumerate(sent) if m == "POST" and "model.safetensors?uploadId=" in p]
        sidecar = [i for i, (m, p) in enumerate(sent) if m == "PUT" and "model.safetensors.hpckpt-manifest" in p]
        assert len(completed) == 1 and sidecar and max(sidecar) < completed[0], sent
        hpckpt("consolidate", str(shards), "-o", str(tmp_path / "streamed" / "model.safetensors"), "--parents")
        assert normalized_tree(objects(s3, "streamed")) == normalized_tree(file_tree(tmp_path / "streamed"))
    forget_stores()


def test_refusals_are_one_line_with_their_exit_code(server, tmp_path, monkeypatch):
    _endpoint, s3 = server
    out = hpckpt("inspect", "s3://no-such-bucket-here/ckpt", code=27)
    assert "NoSuchBucket" in out and "Traceback" not in out
    hpckpt("inspect", url("nothing/here"), code=3)
    hpckpt("inspect", "ftp://host/x", code=2)
    monkeypatch.setenv("HPCKPT_STORE_RETRIES", "many")  # a setting that is no number: a usage error
    forget_stores()
    assert "HPCKPT_STORE_RETRIES" in hpckpt("inspect", url("tiny-hp"), code=2)
    monkeypatch.delenv("HPCKPT_STORE_RETRIES")
    forget_stores()
    # a reshard fanned out over several jobs: each uploads its ranks and records them, `inspect` says
    # what is missing, finalize checks every object against its record (size, entity tag)
    hpckpt("reshard", url("tiny-hp"), "-o", url("fan"), "--world-size", "3", "--rank", "0")
    assert "not written yet" in hpckpt("inspect", url("fan"), code=4)
    assert "file(s) not written yet" in hpckpt("reshard", "--finalize", url("fan"), code=8)
    hpckpt("reshard", url("tiny-hp"), "-o", url("fan"), "--world-size", "3", "--rank", "1-2")
    s3.put_object(Bucket=BUCKET, Key="fan/_rank1_.safetensors",  # replaced behind the jobs' back
                  Body=objects(s3, "fan")["_rank1_.safetensors"][:-1])
    forget_stores()
    assert "changed since its fan-out job wrote it" in hpckpt("reshard", "--finalize", url("fan"), code=9)
    hpckpt("reshard", url("tiny-hp"), "-o", url("fan"), "--world-size", "3", "--rank", "1")  # rerun: fixed
    hpckpt("reshard", "--finalize", url("fan"))
    hpckpt("reshard", str(EXAMPLE), "-o", str(tmp_path / "fan"), "--world-size", "3")
    assert normalized_tree(objects(s3, "fan")) == normalized_tree(file_tree(tmp_path / "fan"))
    assert "already a finished checkpoint" in hpckpt("reshard", url("tiny-hp"), "-o", url("fan"), "--world-size",
                                                     "3", "--rank", "0", code=14)
    # a write to a missing bucket leaves nothing behind
    hpckpt("reshard", str(EXAMPLE), "-o", "s3://no-such-bucket-here/x", "--world-size", "1", code=27)
    # an endpoint that does not answer: one line once the retries are spent
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("HPCKPT_STORE_RETRY_SECONDS", "1")
    forget_stores()
    out = hpckpt("inspect", url("tiny-hp"), code=27)
    assert "does not answer" in out, out
    forget_stores()
    # without the extra: a URL names what to install; --help and local commands import none of it
    probe = ("import sys; sys.modules['obstore'] = None; sys.argv = ['hpckpt'] + sys.argv[1:];"
             "from hpckpt.cli.app import main; main()")
    done = subprocess.run([sys.executable, "-c", probe, "inspect", url("tiny-hp")], capture_output=True, text=True)
    assert done.returncode == 26 and "pip install 'hpckpt[s3]'" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 2  # the error and its hint
    check = ("import sys; from typer.testing import CliRunner; from hpckpt.cli.app import app;"
             f"r = CliRunner().invoke(app, ['inspect', {str(EXAMPLE)!r}]); assert r.exit_code == 0, r.output;"
             "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0;"
             "print(sorted(m for m in sys.modules if m.startswith(('obstore', 'hpckpt.core.storage.object_store'))))")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)


def test_an_incremental_chain_in_a_store(server, tmp_path):
    """An incremental save copied up as its producer wrote it: the `../global_step_N/` paths are
    followed into the sibling prefixes (which must hold a checkpoint), the chain is shown, checked
    and read; a path that leaves for a prefix that is no checkpoint stays exit 12."""
    _endpoint, s3 = server
    (tmp_path / "chain").mkdir()
    build_chain(tmp_path / "chain")
    s3_server.upload_tree(s3, tmp_path / "chain", BUCKET, "chain")
    forget_stores()
    step = url("chain/global_step_300")
    doc = json.loads(hpckpt("inspect", step, "--json"))
    assert doc["based_on"] == ["../global_step_100", "../global_step_200"]
    assert all(f["bytes"] for f in doc["files"]), doc["files"]  # baseline objects found and sized
    assert json.loads(hpckpt("verify", "--deep", step, "--json"))["ok"] is True
    hpckpt("consolidate", step, "-o", str(tmp_path / "one.safetensors"))
    got = load_file(str(tmp_path / "one.safetensors"))
    for name, array in chain_expected().items():
        np.testing.assert_array_equal(got[name], array)
    hpckpt("reshard", step, "-o", url("chain-out"), "--world-size", "3")
    assert json.loads(hpckpt("inspect", url("chain-out"), "--json"))["based_on"] == []
    assert not any(k.startswith("..") for k in objects(s3, "chain-out"))
    # into MindFormers' layout in the store: the iteration's objects, then its root's tracker
    hpckpt("reshard", step, "-o", url("mf/iteration_00000003"), "--to", "mindformers", "--world-size", "2")
    assert objects(s3, "mf")["latest_checkpointed_iteration.txt"] == b"3"
    assert hpckpt("diff", url("mf"), str(tmp_path / "one.safetensors"), "--exclude", "step").startswith("equal:")
    before = objects(s3, "chain/global_step_100")  # a write into a baseline: refused, --force or not
    hpckpt("reshard", step, "-o", url("chain/global_step_100"), "--world-size", "1", "--force", code=16)
    assert objects(s3, "chain/global_step_100") == before
    # a baseline object damaged: verify names it
    key = "chain/global_step_100/_rank1_.safetensors"
    good = objects(s3, "chain/global_step_100")["_rank1_.safetensors"]
    s3.put_object(Bucket=BUCKET, Key=key, Body=good[:-8])
    forget_stores()
    assert "global_step_100/_rank1_.safetensors" in hpckpt("verify", step, code=9)
    s3.put_object(Bucket=BUCKET, Key=key, Body=good)
    # a sibling prefix without a checkpoint in it is not a baseline
    s3.copy_object(Bucket=BUCKET, Key="chain/plain/_rank0_.safetensors",
                   CopySource={"Bucket": BUCKET, "Key": "chain/global_step_100/_rank0_.safetensors"})
    s3.delete_object(Bucket=BUCKET, Key="chain/global_step_100/.metadata")
    forget_stores()
    out = hpckpt("consolidate", step, "-o", str(tmp_path / "x.safetensors"), code=12)
    assert "leaves the checkpoint" in out, out
    assert not (tmp_path / "x.safetensors").exists()


def test_access_denied_leaves_nothing(tmp_path):
    """A second moto server that enforces IAM (after the set-up's requests): keys the server does
    not know, a user that may only list, and a user that may do everything but write `.metadata`
    (denied at the very last step of a commit): exit 27 with one line naming the denial, and no
    object left behind that looks like a checkpoint."""
    import boto3

    setup = 1 + len(list(EXAMPLE.iterdir())) + 6  # the requests below, before IAM is enforced
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "s3_server.py")], stdout=subprocess.PIPE,
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(setup)}, text=True)
    try:
        env = dict(line.strip().removeprefix("export ").split("=", 1)
                   for line in (proc.stdout.readline() for _ in s3_server.environment("x")))
        admin = dict(endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="setup", aws_secret_access_key="setup",
                     region_name="us-east-1")
        s3, iam = boto3.client("s3", **admin), boto3.client("iam", **admin)
        s3.create_bucket(Bucket=BUCKET)
        s3_server.upload_tree(s3, EXAMPLE, BUCKET, "tiny-hp")
        keys = {}
        for user, statements in (("lister", [{"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": "*"}]),
                                 ("writer", [{"Effect": "Allow", "Action": ["s3:*"], "Resource": "*"},
                                             {"Effect": "Deny", "Action": ["s3:PutObject"],
                                              "Resource": [f"arn:aws:s3:::{BUCKET}/out/.metadata"]}])):
            iam.create_user(UserName=user)
            keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
            iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": statements}))

        def run(user: str, *args: str) -> subprocess.CompletedProcess:
            key = keys.get(user, {"AccessKeyId": user, "SecretAccessKey": user})
            return subprocess.run([sys.executable, "-m", "hpckpt", *args], capture_output=True, text=True,
                                  env={**os.environ, **env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                                       "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]})

        for user in ("nobody-known", "lister"):
            done = run(user, "inspect", f"s3://{BUCKET}/tiny-hp")
            assert done.returncode == 27 and "access denied" in done.stderr, done.stderr
            assert len(done.stderr.strip().splitlines()) == 2 and "Traceback" not in done.stderr  # the error, a hint
        assert run("writer", "inspect", f"s3://{BUCKET}/tiny-hp").returncode == 0
        done = run("writer", "reshard", f"s3://{BUCKET}/tiny-hp", "-o", f"s3://{BUCKET}/out", "--world-size", "1")
        assert done.returncode == 27 and "AccessDenied" in done.stderr and ".metadata" in done.stderr, done.stderr
        left = [o["Key"] for o in boto3.client("s3", **{**admin, "aws_access_key_id": keys["writer"]["AccessKeyId"],
                                                         "aws_secret_access_key": keys["writer"]["SecretAccessKey"]})
                .list_objects_v2(Bucket=BUCKET, Prefix="out/").get("Contents", [])]
        assert left == [], left  # the data objects uploaded before the denial were removed, the mark too
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_write_to_a_store_holds_no_more_than_its_budget(server, tmp_path):
    """`--max-memory` bounds a write to a store as it bounds a local one: the engine's tiles and
    the upload's parts in flight share it (peak RSS of the child against `inspect`'s, the same
    process without the write)."""
    source = tmp_path / "src"
    source.mkdir()
    rng = np.random.default_rng(0)
    for r in range(2):  # 2 x 48 MiB, one tensor each
        save_file({"w": rng.standard_normal((48 * 1024, 256), np.float32)}, str(source / f"part{r}.safetensors"))
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True);"
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)")

    def peak(*args: str) -> int:
        done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "hpckpt", *args],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    written = peak("reshard", str(source / "part0.safetensors"), "-o", url("budget/one"), "--world-size", "2",
                   "--max-memory", "32MiB")
    base = peak("inspect", url("budget/one"))
    assert written - base <= 32 + 12, (written, base)  # 12 MiB: the client's own buffers and threads
    written = peak("consolidate", str(source / "part1.safetensors"), "-o", url("budget/two.safetensors"),
                   "--max-memory", "32MiB")
    assert written - base <= 32 + 12, (written, base)


def test_azure_blob_storage_through_the_same_layer(tmp_path, monkeypatch):
    """`az://` against Azurite (a real Azure Blob server): the same storage layer writes what it
    writes locally, byte for byte (a file large enough to go up in blocks, a store -> store
    reshard, a consolidation to one object), reads it back (`verify --deep`), refuses a prefix
    another live run is writing (the conditional create), and names a missing container."""
    import socket

    import azure_server
    import obstore
    from obstore.store import AzureStore

    source = tmp_path / "src.safetensors"
    rng = np.random.default_rng(1)
    save_file({"big": rng.standard_normal((5 * 1024, 1024), np.float32),  # 20 MiB: uploaded in blocks
               "small": np.arange(12, dtype=np.int64).reshape(3, 4)}, str(source))
    with azure_server.Azurite() as az:
        az.create_container("ckpts")
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            monkeypatch.delenv(key)
        for key, value in az.environment.items():
            monkeypatch.setenv(key, value)
        forget_stores()
        blobs = AzureStore("ckpts", use_emulator=True)

        def tree(prefix: str) -> dict[str, bytes]:
            return {m["path"][len(prefix) + 1:]: bytes(obstore.get(blobs, m["path"]).bytes())
                    for batch in obstore.list(blobs, f"{prefix}/") for m in batch}

        try:
            hpckpt("reshard", str(source), "-o", "az://ckpts/two", "--world-size", "2")
            hpckpt("reshard", "az://ckpts/two", "-o", "az://ckpts/three", "--world-size", "3")
            hpckpt("consolidate", "az://ckpts/three", "-o", "az://ckpts/one/model.safetensors")
            hpckpt("reshard", str(source), "-o", str(tmp_path / "two"), "--world-size", "2")
            hpckpt("reshard", str(tmp_path / "two"), "-o", str(tmp_path / "three"), "--world-size", "3")
            hpckpt("consolidate", str(tmp_path / "three"), "-o", str(tmp_path / "one" / "model.safetensors"),
                   "--parents")
            for name in ("two", "three", "one"):
                assert normalized_tree(tree(name)) == normalized_tree(file_tree(tmp_path / name)), name
            assert json.loads(hpckpt("verify", "--deep", "az://ckpts/three", "--json"))["ok"] is True
            obstore.put(blobs, "busy/.hpckpt-writing", json.dumps(  # a live run's mark: this process's
                {"host": socket.gethostname(), "pid": os.getpid(), "token": "other", "names": []}).encode())
            assert "another hpckpt run is writing it" in hpckpt("reshard", str(source), "-o", "az://ckpts/busy",
                                                                "--world-size", "1", code=17)
            assert sorted(tree("busy")) == [".hpckpt-writing"]
            assert "ContainerNotFound" in hpckpt("inspect", "az://no-such-container/x", code=27)
        finally:
            forget_stores()


def test_a_full_spool_and_coordinations_a_store_cannot_take(server, tmp_path, monkeypatch):
    """The local spool of a write to a store is checked for room before anything is written (exit
    18, naming HPCKPT_SPOOL_DIR, nothing in the store); a live save to a store refuses the
    coordinations that need a shared file system."""
    import torch

    import hpckpt.dist as hdist

    _endpoint, s3 = server
    big = tmp_path / "big.safetensors"
    save_file({"w": np.ones((1024, 1024), np.float32)}, str(big))  # 4 MiB
    disk = tmp_path / "spool"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.fail("cannot mount a tmpfs (the suite runs as root in CI)")
    try:
        monkeypatch.setenv("HPCKPT_SPOOL_DIR", str(disk))
        out = hpckpt("reshard", str(big), "-o", url("no-room"), "--world-size", "2", code=18)
        assert "local spool" in out and "HPCKPT_SPOOL_DIR" in out, out
        assert objects(s3, "no-room") == {} and os.listdir(disk) == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    for coordination in ("storage", "none"):
        with pytest.raises(ValueError, match="coordination='collectives'"):
            hdist.save({"w": torch.ones(4)}, checkpoint_id=url("refused"), coordination=coordination, no_dist=True)
    assert objects(s3, "refused") == {}


def test_credentials_from_a_profile(server, tmp_path):
    """AWS_PROFILE with no keys in the environment: the profile's keys, read through boto3."""
    endpoint, _s3 = server
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text("[ckpt]\naws_access_key_id = from-profile\n"
                                                "aws_secret_access_key = from-profile\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(home), AWS_PROFILE="ckpt", AWS_ENDPOINT_URL=endpoint, AWS_REGION="us-east-1")
    done = subprocess.run([sys.executable, "-m", "hpckpt", "inspect", url("tiny-hp"), "--json"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and json.loads(done.stdout)["format"] == "hyperparallel", done.stderr
    env["AWS_PROFILE"] = "no-such-profile"
    done = subprocess.run([sys.executable, "-m", "hpckpt", "inspect", url("tiny-hp")], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 27 and "no-such-profile" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_an_object_replaced_while_it_is_read_is_an_error(server):
    """Every ranged GET is conditional on the tag the object was listed with: a replaced object
    is never read as a mix of two versions."""
    from hpckpt.core.errors import CorruptDataError
    from hpckpt.core.safety import input_files
    from hpckpt.core.storage.readers import read_at
    from hpckpt.core.storage.urls import as_path

    _endpoint, s3 = server
    s3.put_object(Bucket=BUCKET, Key="changing/data.bin", Body=bytes(3 << 20))
    forget_stores()
    handle = input_files.open_handle(as_path(url("changing/data.bin")))
    buffer = memoryview(bytearray(2 << 20))
    assert read_at(handle, buffer, 1 << 20) == 2 << 20 and not any(buffer)
    s3.put_object(Bucket=BUCKET, Key="changing/data.bin", Body=b"\1" * (3 << 20))
    with pytest.raises(CorruptDataError, match="changed while it was being read"):
        read_at(handle, buffer, 1 << 20)
    forget_stores()


def test_two_writers_and_a_killed_write(server, tmp_path):
    endpoint, s3 = server
    # another run's mark (another host): refused; --force takes it over
    s3.put_object(Bucket=BUCKET, Key="busy/.hpckpt-writing",
                  Body=json.dumps({"host": "elsewhere", "pid": 1, "token": "x", "started": time.time(),
                                   "names": ["_rank0_.safetensors"]}).encode())
    s3.put_object(Bucket=BUCKET, Key="busy/_rank0_.safetensors", Body=b"half")
    forget_stores()
    out = hpckpt("inspect", url("busy"), code=4)
    assert "unfinished hpckpt write" in out and "elsewhere" in out, out
    out = hpckpt("reshard", str(EXAMPLE), "-o", url("busy"), "--world-size", "1", code=17)
    assert "another hpckpt run is writing it" in out
    hpckpt("reshard", str(EXAMPLE), "-o", url("busy"), "--world-size", "1", "--force")
    assert json.loads(hpckpt("verify", "--deep", url("busy"), "--json"))["ok"] is True
    # kill -9 while the data objects go up (slowed by the proxy): the mark stays, inspect says so,
    # and the next write removes what it left and completes
    big = tmp_path / "big.safetensors"
    save_file({"w": np.arange(3 << 20, dtype=np.float32), "b": np.ones((64, 1024), np.float32)}, str(big))
    with s3_proxy.Proxy(endpoint) as proxy:
        proxy.faults.add("slow", method="PUT", contains="killed/", count=1000, delay=0.5)
        proxy.faults.add("slow", method="POST", contains="killed/", count=1000, delay=0.5)
        env = {**os.environ, **s3_server.environment(proxy.endpoint)}
        job = subprocess.Popen([sys.executable, "-m", "hpckpt", "reshard", str(big), "-o", url("killed"),
                                "--world-size", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline and not any("killed/_rank" in p and m in ("PUT", "POST")
                                                 for m, p, _ in list(proxy.requests)):
            time.sleep(0.05)
        job.send_signal(signal.SIGKILL)
        job.wait()
        proxy.settle()  # requests the killed run had sent still land (as they can on a real store)
    forget_stores()
    left = objects(s3, "killed")
    assert ".hpckpt-writing" in left and ".metadata" not in left, sorted(left)
    out = hpckpt("verify", url("killed"), code=4)
    assert "no longer running" in out, out
    hpckpt("reshard", str(big), "-o", url("killed"), "--world-size", "2")
    hpckpt("reshard", str(big), "-o", str(tmp_path / "here"), "--world-size", "2")
    assert normalized_tree(objects(s3, "killed")) == normalized_tree(file_tree(tmp_path / "here"))


@pytest.mark.dist
def test_live_save_and_load_through_a_store(server, tmp_path):
    """`hpckpt.dist.save` and `async_save` from 4 torchrun ranks to `s3://`, the same bytes as to a directory;
    `hpckpt.dist.load` into 2 ranks from `s3://`, every value as saved; the command line reads it."""
    endpoint, s3 = server
    env = {**os.environ, **s3_server.environment(endpoint)}
    job = REPO / "tests" / "dist_scripts" / "object_store_job.py"
    rc, out = run_torchrun(4, [str(job), "save", url("live"), str(tmp_path / "local")], tmp_path / "save.log",
                           env, timeout=240)
    assert rc == 0 and out.count(": OK") == 4, out
    got, here = objects(s3, "live"), file_tree(tmp_path / "local")
    assert normalized_tree(got) == normalized_tree(here), sorted(got)
    assert normalized_tree(objects(s3, "live-async")) == normalized_tree(here)
    exchange = objects(s3, ".live-async.hpckpt-exchange")  # what the async save exchanged: JSON only
    assert exchange and all(name.startswith(".hpckpt-") and name.endswith(".json") for name in exchange), sorted(exchange)
    rc, out = run_torchrun(2, [str(job), "load", url("live")], tmp_path / "load.log", env, timeout=240)
    assert rc == 0 and out.count(": OK") == 2, out
    forget_stores()
    assert json.loads(hpckpt("verify", "--deep", url("live"), "--json"))["ok"] is True
    # `hpckpt run`: a load checked box by box against an independent read, from the store
    done = subprocess.run([sys.executable, "-m", "hpckpt", "run", "--nproc-per-node", "2", "--log-dir",
                           str(tmp_path / "run"), "load", url("live"), "--check"], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0 and "load done on 2 ranks" in done.stdout + done.stderr, done.stdout + done.stderr
    # its reshard: 2 workers each upload their share of 3 target ranks, the coordinator finalizes;
    # the output is a single-process reshard's; with --force it replaces a checkpoint there
    done = subprocess.run([sys.executable, "-m", "hpckpt", "run", "--nproc-per-node", "2", "--log-dir",
                           str(tmp_path / "run-reshard"), "reshard", url("live"), "-o", url("run-reshard"),
                           "--world-size", "3"], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    hpckpt("reshard", url("live"), "-o", str(tmp_path / "one"), "--world-size", "3")
    assert normalized_tree(objects(s3, "run-reshard")) == normalized_tree(file_tree(tmp_path / "one"))
    from hpckpt.core.commit.set_aside import SetAside
    from hpckpt.core.errors import DestinationExistsError
    from hpckpt.core.storage.urls import as_path

    with pytest.raises(DestinationExistsError, match="run-reshard exists") as refused:  # (its coordinator's check)
        SetAside(as_path(url("run-reshard")), force=False).prepare()
    assert refused.value.hint == "--force replaces it"
    with pytest.raises(DestinationExistsError, match="is an object, not a prefix"):
        SetAside(as_path(url("run-reshard/.metadata")), force=True).prepare()
    hpckpt("run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "again"), "reshard", url("live"),
           "-o", url("run-reshard"), "--world-size", "1", "--force")
    hpckpt("reshard", url("live"), "-o", str(tmp_path / "one-rank"), "--world-size", "1")
    assert normalized_tree(objects(s3, "run-reshard")) == normalized_tree(file_tree(tmp_path / "one-rank"))


@pytest.mark.dist
def test_a_live_save_killed_mid_upload(server, tmp_path):
    """kill -9 of a whole torchrun job while its ranks upload (slowed by the proxy): the writer's
    mark stays, `inspect` says so, and the next save to the same URL (another world size) cleans
    up and commits the same bytes as to a directory."""
    endpoint, s3 = server
    job = REPO / "tests" / "dist_scripts" / "object_store_job.py"
    torchrun = Path(sys.executable).with_name("torchrun")
    with s3_proxy.Proxy(endpoint) as proxy:
        proxy.faults.add("slow", method="PUT", contains="/killed-live/", count=1000, delay=1.0)
        env = {**os.environ, **s3_server.environment(proxy.endpoint)}
        with open(tmp_path / "killed.log", "w") as log:
            launched = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "4", str(job), "save",
                                         url("killed-live"), str(tmp_path / "unused")], env=env, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.time() + 120
            while time.time() < deadline and not any(m == "PUT" and "killed-live/_rank" in p
                                                     for m, p, _ in list(proxy.requests)):
                time.sleep(0.05)
            for pid in [launched.pid, *descendants(launched.pid)]:  # (torchrun's workers leave its group)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launched.wait()
        proxy.settle()
    forget_stores()
    left = objects(s3, "killed-live")
    assert ".hpckpt-writing" in left and ".metadata" not in left, sorted(left)
    assert "unfinished hpckpt write" in hpckpt("inspect", url("killed-live"), code=4)
    env = {**os.environ, **s3_server.environment(endpoint)}
    rc, out = run_torchrun(2, [str(job), "save", url("killed-live"), str(tmp_path / "local")],
                           tmp_path / "again.log", env, timeout=240)
    assert rc == 0 and out.count(": OK") == 2, out
    assert normalized_tree(objects(s3, "killed-live")) == normalized_tree(file_tree(tmp_path / "local"))
