"""Jobs that `hpckpt run` launches on every rank (torchrun or msrun workers).

A job is a module with `run(spec: dict, ctx) -> dict`: `spec` is the JSON document the CLI built
from the command line (`{"job": name, ...options}`), `ctx` this rank's place in the job
(`hpckpt.dist.jobs.worker.JobContext`), and the returned dict this rank's figures. Modules are
named here, not imported: a worker imports only the job it runs.
"""

from __future__ import annotations

import importlib
from types import ModuleType

JOBS = {
    "selftest": "hpckpt.dist.jobs.selftest",
    "save": "hpckpt.dist.jobs.save_job",
    "load": "hpckpt.dist.jobs.load_job",
    "reshard": "hpckpt.dist.jobs.reshard_job",
    "bench": "hpckpt.dist.jobs.bench_job",
}


def job_module(name: str) -> ModuleType:
    """The module of job `name` (KeyError: no such job)."""
    return importlib.import_module(JOBS[name])
