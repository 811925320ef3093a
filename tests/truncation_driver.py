"""Build the truncation sweep's samples, or run the sweep on them (`tests/test_truncation_sweep.py`).

    python tests/truncation_driver.py build-torch DIR        # torch.save, torch DCP, safetensors, HF
    python tests/truncation_driver.py build-mindspore DIR    # mindspore.save_checkpoint
    python tests/truncation_driver.py sweep PLAN.json RESULTS.json

The build modes import the producing libraries (torch, safetensors, mindspore), each in a
process of its own; the sweep never imports torch or mindspore. The sweep runs, in this one
process and under a 4 GiB address-space cap (as `hostile_driver.py` does), `hpckpt verify`
and/or `hpckpt inspect` on each sample once untouched and then once per truncation position of
each of its files: the file is truncated in place (`os.truncate`), the command runs through
`hpckpt.cli.app.run()` with fds 1 and 2 redirected to files and a wall-clock budget, and the
file's bytes are written back (so no copy per position is made). Each run is recorded as its
exit code, seconds, number of `error:` lines, whether a traceback appeared, and its first
`error:` line; the test judges them.

PLAN.json: `{"samples": [{"name", "path", "files": [{"file", "positions": [...],
"inspect": [...]}]}]}`: `positions` are where `verify` runs, `inspect` where `inspect` runs too.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from inprocess import install_alarm, limit_memory, memoise_typer, peak_mib, run_redirected

HERE = Path(__file__).resolve().parent
BUDGET_SECONDS = 5.0  # a run that takes this long is stopped and recorded as a timeout


# --- building the samples (imports the producers; never in the sweep's process) -----------------


def _index_json(weight_map: dict[str, str], total: int) -> str:
    """The index as transformers' `save_pretrained` writes it."""
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"


def build_torch(root: Path) -> None:
    """torch.save, torch DCP, safetensors (the library) and the two Hugging Face layouts, small."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    w = torch.arange(12, dtype=torch.float32).reshape(4, 3) * 0.5
    bf = torch.tensor([1.0, -2.0, 0.0, 3.5], dtype=torch.bfloat16).reshape(2, 2)
    ids = torch.arange(-3, 3, dtype=torch.int64)
    scale = torch.tensor(0.75)  # 0-d

    # torch DCP, no process group: `.metadata` and `__0_0.distcp`; `emb` makes the .distcp larger
    # than the sweep's every-byte limit, so that its chosen positions are tried too
    emb = torch.arange(1024, dtype=torch.float32).reshape(64, 16) * 0.25
    dcp.save({"model": {"w": w, "bf": bf, "scale": scale, "emb": emb}, "step": 3}, checkpoint_id=str(root / "dcp"),
             no_dist=True)

    # torch.save: a nested state dict with a value
    (root / "pt").mkdir()
    torch.save({"model": {"w": w, "ids": ids, "scale": scale}, "cfg": {"lr": 0.5}}, root / "pt" / "state.pt")

    # Hugging Face sharded: two safetensors shards (format "pt") and the index
    hf = root / "hf"
    hf.mkdir()
    shards = {"model-00001-of-00002.safetensors": {"model.w": w, "model.bf": bf},
              "model-00002-of-00002.safetensors": {"model.ids": ids, "model.scale": scale}}
    for name, tensors in shards.items():
        save_file(tensors, str(hf / name), metadata={"format": "pt"})
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    total = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
    (hf / "model.safetensors.index.json").write_text(_index_json(weight_map, total))

    # hf-torch-bin: torch.save shards and `pytorch_model.bin.index.json`
    hb = root / "hf-bin"
    hb.mkdir()
    bins = {"pytorch_model-00001-of-00002.bin": {"model.w": w},
            "pytorch_model-00002-of-00002.bin": {"model.ids": ids}}
    for name, tensors in bins.items():
        torch.save(tensors, hb / name)
    weight_map = {k: name for name, tensors in bins.items() for k in tensors}
    total = sum(t.numel() * t.element_size() for tensors in bins.values() for t in tensors.values())
    (hb / "pytorch_model.bin.index.json").write_text(_index_json(weight_map, total))


def build_mindspore(root: Path) -> None:
    """`mindspore.save_checkpoint`, every tensor a Parameter (it drops plain Tensor values), and
    a string value through `append_dict`."""
    import mindspore as ms
    import numpy as np

    params = {"w": ms.Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(4, 3)), name="w"),
              "bf": ms.Parameter(ms.Tensor(np.array([1.0, -2.0, 0.5, 3.5], dtype=np.float32), dtype=ms.bfloat16),
                                 name="bf"),
              "ids": ms.Parameter(ms.Tensor(np.arange(-3, 3, dtype=np.int64)), name="ids")}
    (root / "ms").mkdir()
    (root / "ms-crc").mkdir()
    path = root / "ms" / "net.ckpt"
    ms.save_checkpoint(params, str(path), append_dict={"run_name": "run-a"})
    # the same with MindSpore's CRC trailer (b"crc_num" and the CRC-32 of everything before it)
    ms.save_checkpoint(params, str(root / "ms-crc" / "net.ckpt"), append_dict={"run_name": "run-a"}, crc_check=True)
    for saved in (path, root / "ms-crc" / "net.ckpt"):
        saved.chmod(0o600)  # MindSpore saves read-only; the sweep truncates it in place


# --- the sweep ---------------------------------------------------------------------------------


class Runner:
    """Runs `hpckpt ARGS` in this process with fds 1 and 2 on two scratch files (opened once)."""

    def __init__(self, scratch: Path):
        from hpckpt.cli.app import run

        self.run_app = run
        self.out = open(scratch / "stdout", "w+b")  # noqa: SIM115 - kept for the whole sweep
        self.err = open(scratch / "stderr", "w+b")  # noqa: SIM115

    def __call__(self, args: list[str]) -> dict:
        for f in (self.out, self.err):
            f.seek(0)
            f.truncate()
        code, timed_out, seconds = run_redirected(self.run_app, args, self.out.fileno(), self.err.fileno(),
                                                  BUDGET_SECONDS)
        self.out.seek(0)
        self.err.seek(0)
        out = self.out.read().decode("utf-8", "backslashreplace")
        err = self.err.read().decode("utf-8", "backslashreplace")
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        warnings = [line for line in out.splitlines() if line.startswith("warning")]
        findings = [line for line in out.splitlines() if line.startswith("error [")]  # verify's report
        return {"code": code, "timeout": timed_out, "seconds": round(seconds, 4), "errors": len(errors),
                "traceback": "Traceback" in out + err, "error": errors[0][:300] if errors else "",
                "warnings": [line[:300] for line in warnings[:3]], "findings": [line[:300] for line in findings[:3]],
                "stderr": err[-600:] if (code not in (0, None) and not errors) or "Traceback" in err else ""}


def sweep_sample(sample: dict, run: Runner) -> dict:
    path = sample["path"]
    result = {"intact": {"verify": run(["verify", path]), "inspect": run(["inspect", path])}, "files": {}}
    for spec in sample["files"]:
        file = spec["file"]
        original = Path(file).read_bytes()
        stat = os.stat(file)
        runs = []
        inspect_at = set(spec["inspect"])
        fd = os.open(file, os.O_RDWR)
        try:
            for at in sorted(set(spec["positions"]) | inspect_at):
                os.ftruncate(fd, at)
                if at in spec["positions"]:
                    runs.append({"at": at, "command": "verify", **run(["verify", path])})
                if at in inspect_at:
                    runs.append({"at": at, "command": "inspect", **run(["inspect", path])})
                os.pwrite(fd, original[at:], at)
        finally:
            os.close(fd)
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert Path(file).read_bytes() == original, f"{file} was not restored"
        result["files"][file] = runs
    return result


def sweep(plan_path: str, results_path: str) -> int:
    limit_memory()
    memoise_typer()
    install_alarm()
    os.environ["HPCKPT_NO_CACHE"] = "1"
    os.environ["COLUMNS"] = "200"
    plan = json.loads(Path(plan_path).read_text())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpckpt-truncation-") as scratch:
        run = Runner(Path(scratch))
        samples = {sample["name"]: sweep_sample(sample, run) for sample in plan["samples"]}
    report = {"seconds": round(time.perf_counter() - started, 2), "cpu_seconds": round(time.process_time(), 2),
              "peak_mib": peak_mib(),  # VmHWM: ru_maxrss would carry pytest's peak over the exec
              "torch_imported": "torch" in sys.modules, "mindspore_imported": "mindspore" in sys.modules,
              "samples": samples}
    Path(results_path).write_text(json.dumps(report))
    return 0


def main() -> int:
    mode = sys.argv[1]
    if mode == "build-torch":
        build_torch(Path(sys.argv[2]))
        return 0
    if mode == "build-mindspore":
        build_mindspore(Path(sys.argv[2]))
        return 0
    if mode == "sweep":
        return sweep(sys.argv[2], sys.argv[3])
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
