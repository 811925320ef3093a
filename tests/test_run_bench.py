"""`hpckpt run bench` (`hpckpt.dist.jobs.bench_job`): hpckpt against the framework's own checkpointing.

One real torchrun job of 2 ranks through the installed `hpckpt` (about 10 s) checks every
measurement is there with sane values, that the loads were checked bit for bit, that hpckpt
read nothing twice, that the figures are the job's (the same on every rank) and that the scratch
directory is left as it was found. One real msrun job (about 30 s) does the same for MindSpore.
The import of the job module is checked framework-free (the CLI imports its `table`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HPCKPT = Path(sys.executable).with_name("hpckpt")
SAVES = ("save", "async_save")
KINDS = ("save", "async_save", "load")


def run_bench(tmp_path: Path, launcher: str, timeout: float) -> tuple[dict, Path, Path]:
    """`hpckpt run --launcher L --nproc-per-node 2 bench --size 8MiB --rounds 1 --json` into a
    scratch directory that holds someone else's file."""
    scratch, logs = tmp_path / "scratch", tmp_path / "logs"
    scratch.mkdir()
    (scratch / "keep.txt").write_text("not the bench's")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run([str(HPCKPT), "run", "--launcher", launcher, "--nproc-per-node", "2", "--log-dir", str(logs),
                           "bench", "--size", "8MiB", "--rounds", "1", "--output", str(scratch), "--json"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout), scratch, logs


def check_report(document: dict, native: str, *, fsynced: bool) -> None:
    assert list(document)[:7] == ["schema", "hpckpt_version", "command", "ok", "written", "skipped", "warnings"]
    assert document["command"] == "run" and document["ok"] is True
    assert document["job"] == "bench" and document["world_size"] == 2
    ranks = document["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    job_bytes = ranks[0]["job_state_bytes"]
    assert job_bytes > 4 * 2**20  # the synthetic model of about 8 MiB
    assert sum(r["state_bytes"] for r in ranks) == job_bytes  # dim 0 over 2 ranks: no replica
    for r in ranks:
        assert r["rounds"] == 1
        for who in ("hpckpt", native):
            for kind in KINDS:
                m = r[f"{who}_{kind}"]
                assert 0 < m["seconds_best"] <= m["seconds_median"], (who, kind, m)
                assert m["rank_seconds_best"] <= m["seconds_best"] + 1e-3  # the job's time is the slowest rank's
                assert m["gib_per_s"] > 0 and len(m["rounds"]) == 1
                assert 0 < m["peak_rss"] <= m["job_peak_rss"] and m["peak_rss_extra"] >= 0
                # the same job figure on every rank
                assert m["seconds_best"] == ranks[0][f"{who}_{kind}"]["seconds_best"]
            for kind in SAVES:
                assert r[f"{who}_{kind}"]["fsync"] is (True if who == "hpckpt" else fsynced)
            assert r[f"{who}_save"]["bytes_on_disk"] > job_bytes * 0.9
            a = r[f"{who}_async_save"]
            assert 0 < a["blocked_best"] <= a["seconds_best"]
            load = r[f"{who}_load"]
            assert load["checked"] is True
            assert load["read_amplification"] >= 1.0 and load["rchar_amplification"] >= 1.0
            assert load["job_bytes_wanted"] == job_bytes and load["rchar"] > 0
        hp = r["hpckpt_load"]
        assert hp["read_amplification"] == 1.0 and hp["job_bytes_read"] == job_bytes
        assert hp["bytes_read"] == r["state_bytes"]
        # dim 0 over 2 ranks: nothing shared, learnt from the ranks' layouts
        assert (hp["broadcast"], hp["broadcast_reason"], hp["wants_from"]) == ("read", "nothing shared", "layouts")
        assert r[f"{native}_load"]["job_bytes_read"] >= job_bytes


def check_table(document: dict, native_label: str) -> None:
    from hpckpt.cli.run.bench_table import table

    columns, rows = table(document["ranks"])
    assert columns[0] == "measurement" and all(len(row) == len(columns) for row in rows)
    names = [row[0] for row in rows]
    durable = [f"{native_label} save + fsync"] if native_label == "MindSpore" else []  # (its save does not fsync)
    assert names == ["hpckpt.dist save", f"{native_label} save", *durable, "hpckpt.dist async save",
                     f"{native_label} async save", "hpckpt.dist load", f"{native_label} load"]
    ratio = rows[1][columns.index("vs hpckpt")]
    assert ratio.endswith("x") and float(ratio[:-1]) > 0
    assert rows[names.index("hpckpt.dist load")][columns.index("read x")] == "1.00"
    if durable:
        row, save = rows[2], document["ranks"][0]["mindspore_save"]
        best = float(row[columns.index("best s")])
        assert row[columns.index("fsync")] == "yes" and best == pytest.approx(save["durable_seconds_best"], abs=1e-3)
        assert best >= float(rows[1][columns.index("best s")])
        assert float(row[columns.index("vs hpckpt")][:-1]) >= float(ratio[:-1])


def check_left_alone(scratch: Path, logs: Path) -> None:
    assert sorted(p.name for p in scratch.iterdir()) == ["keep.txt"]
    big = [p for p in logs.rglob("*") if p.is_file() and p.stat().st_size > 2**20]
    assert not big, big


def test_bench_module_imports_no_framework():
    code = ("import sys, hpckpt.dist.jobs.bench_job, hpckpt.cli.run.bench_table as b; "
            "assert not {'torch', 'mindspore'} & set(sys.modules), sorted({'torch', 'mindspore'} & set(sys.modules)); "
            "print(callable(b.table))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


@pytest.mark.dist
def test_run_bench_torchrun(tmp_path):
    document, scratch, logs = run_bench(tmp_path, "torchrun", timeout=240)
    assert document["launcher"] == "torchrun"
    check_report(document, "torch_dcp", fsynced=True)
    check_table(document, "torch DCP")
    check_left_alone(scratch, logs)


@pytest.mark.dist
def test_run_bench_msrun(tmp_path):
    document, scratch, logs = run_bench(tmp_path, "msrun", timeout=300)
    assert document["launcher"] == "msrun" and document["ranks"][0]["framework"] == "mindspore"
    check_report(document, "mindspore", fsynced=False)
    for r in document["ranks"]:
        assert r["mindspore_save"]["durable_seconds_best"] >= r["mindspore_save"]["seconds_best"]
    check_table(document, "MindSpore")
    check_left_alone(scratch, logs)
