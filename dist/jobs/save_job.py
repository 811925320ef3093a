"""`hpckpt run save`: save a model-shaped state, or an existing checkpoint loaded into a layout,
from every rank of the launched job with `hpckpt.dist.save` (or `async_save`)."""

from __future__ import annotations

import resource
import time

from hpckpt.api import parse_size
from hpckpt.converters import open_index
from hpckpt.core.commit.destination import refuse_existing
from hpckpt.core.dtypes import dtype as parse_dtype
from hpckpt.core.errors import InjectedFailure
from hpckpt.core.storage.urls import as_path
from hpckpt.dist import frameworks
from hpckpt.dist.jobs import states


def peak_rss() -> int:
    """This process's peak resident memory, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _FailingProgress:
    """Raises in the middle of this rank's write (from the engine's own progress callback, so
    the save fails where a real write error would), after passing on the first advance."""

    def __init__(self, inner):
        self.inner = inner

    def start(self, total: int) -> None:
        self.inner.start(total)

    def advance(self, n: int) -> None:
        self.inner.advance(n)
        raise InjectedFailure("injected failure while writing (--fail-rank)")


def build_state(spec: dict, ctx, layout) -> tuple[dict, list, dict]:
    """The state to save and what made it: the synthetic model, or `spec["from"]` loaded."""
    import hpckpt.dist as hdist

    if spec.get("from"):
        ctx.phase(f"loading {spec['from']}")
        index = open_index(spec["from"])
        cast = parse_dtype(spec["dtype"]) if spec.get("dtype") else None
        state, pieces = states.empty_state(index, layout, ctx.rank, ctx.framework, cast)
        loaded = hdist.load(state, spec["from"])
        return state, pieces, {"source": str(spec["from"]), "source_format": index.format,
                               "load_seconds": round(loaded.seconds, 4), "load_bytes_read": loaded.bytes_read}
    size = spec.get("size") or "64MiB"
    nbytes = size if isinstance(size, int) else parse_size(size)
    dtype = parse_dtype(spec.get("dtype") or "bfloat16")
    ctx.phase("making the synthetic state")
    state, pieces = states.synthetic_state(nbytes, dtype, layout, ctx.rank, ctx.framework)
    return state, pieces, {"size": nbytes, "dtype": dtype.name}


def run(spec: dict, ctx) -> dict:
    import hpckpt.dist as hdist

    out = spec["out"]
    refuse_existing(as_path(out), bool(spec.get("force")))  # as every writing command (the CLI checked on node 0)
    layout = states.layout_spec(spec, ctx.world_size)
    state, pieces, made = build_state(spec, ctx, layout)
    fw = frameworks.named(ctx.framework)
    ctx.phase(f"saving {out}")
    progress = _FailingProgress(ctx.progress) if spec.get("fail_rank") == ctx.rank else ctx.progress
    options = dict(coordination=spec.get("coordination") or "collectives", progress=progress)
    started = time.perf_counter()
    if spec.get("async"):
        handle = hdist.async_save(state, out, **options)
        blocked = time.perf_counter() - started
        result = handle.result()
    else:
        result = hdist.save(state, out, **options)
        blocked = time.perf_counter() - started
    seconds = time.perf_counter() - started
    job_seconds = max(ctx.comm.all_gather_json(seconds))  # the job's save ends with its slowest rank
    return {"rank": ctx.rank, "path": str(result.path), "tensors": len(pieces),
            "bytes_held": states.nbytes_of(pieces, fw, ctx.rank), "bytes_written": result.bytes_written,
            "job_bytes_written": result.job_bytes_written, "files": list(result.files), "seconds": round(seconds, 4),
            "blocked_seconds": round(blocked, 4), "planning_seconds": round(result.planning, 4),
            "writing_seconds": round(result.writing, 4), "plan_cache": result.plan_cache,
            "plan_from": result.plan_from, "coordination": result.coordination, "job_seconds": round(job_seconds, 4),
            "job_gib_per_s": round(result.job_bytes_written / job_seconds / 2**30, 3) if job_seconds else None,
            "peak_rss": peak_rss(), **made}
