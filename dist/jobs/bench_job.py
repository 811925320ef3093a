"""`hpckpt run bench`: hpckpt and the framework's own checkpointing on the same state, in one job.

Every rank builds the state once (the synthetic model, or `--from` a checkpoint loaded into the
job's layout) and, for `rounds` rounds, times six phases: `hpckpt.dist.save`, `async_save` and
`load`, and the framework's own way of doing the same — PyTorch DCP (`save`, `async_save`,
`load` of DTensors made from the same local shards) under torchrun, MindSpore's
`save_checkpoint` / `save_checkpoint(async_save=True)` / `load_checkpoint` of one file per rank
under msrun (how MindSpore itself saves a distributed job): `bench_contenders`. The order of the
two contenders alternates from round to round, so neither always meets a warmer machine.

Each phase starts after a barrier; the job's time of a phase is its slowest rank's (gathered).
Before a save the destination is removed and dirty pages flushed, before a load the
checkpoint's files are evicted from the page cache, so loads are cold; peak RSS and bytes read
are taken around each phase (`bench_measure`). Bytes read: `LoadResult` for hpckpt, the
`rchar` delta for both. The first round's loads are compared with the saved state bit for bit
(untimed): a bench that loads wrong values fails. The result (`bench_figures`) is rendered by
the CLI (`hpckpt.cli.run.bench_table`).

No framework is imported at module level: each contender imports its own when it is built.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from hpckpt.dist.jobs.bench_contenders import Hpckpt, MindSpore, TorchDCP
from hpckpt.dist.jobs.bench_figures import distinct_state_bytes, summary
from hpckpt.dist.jobs.bench_measure import clear, evict, remove_scratch, scratch_dir, timed, tree_bytes
from hpckpt.dist.jobs.bench_state import check_equal, empty_like

KINDS = ("save", "async_save", "load")
LABELS = {"hpckpt": "hpckpt.dist", "torch_dcp": "torch DCP", "mindspore": "MindSpore"}


def _save_phase(ctx, who, dest: Path) -> dict:
    clear(ctx, dest)
    extra, mine = timed(ctx, lambda: who.save(dest))
    if hasattr(who, "make_durable"):  # a save that does not fsync: what durability would add
        started = time.perf_counter()
        who.make_durable(dest)
        extra["fsync_seconds"] = time.perf_counter() - started
    return {**mine, **extra}


def _async_phase(ctx, who, dest: Path) -> dict:
    """`seconds` until the save is complete; `blocked` until the call returned."""
    clear(ctx, dest)
    marks: dict = {}

    def call() -> dict:
        started = time.perf_counter()
        wait, extra = who.async_save(dest)
        marks["blocked"] = time.perf_counter() - started
        wait()
        return extra

    extra, mine = timed(ctx, call)
    return {**mine, **marks, **extra}


def _load_phase(ctx, who, dest: Path, state: dict, fw, check: bool) -> dict:
    evict(ctx, dest)
    target = empty_like(state, fw, ctx.framework)
    prepared = who.prepare_load(target)
    extra, mine = timed(ctx, lambda: who.load(dest, prepared))
    if check:
        check_equal(fw, state, target, LABELS[who.name], ctx.rank)
    return {**mine, **extra, "checked": check}


def _round(ctx, contenders: list, scratch: Path, state: dict, fw, r: int, rounds: int) -> dict:
    """One round: each contender saves, loads back what it saved (cold), async-saves."""
    out: dict[str, dict] = {}
    for who in contenders:
        label = LABELS[who.name]
        sync_dir, async_dir = scratch / who.name, scratch / f"{who.name}_async"
        ctx.phase(f"round {r + 1}/{rounds}: {label} save")
        out[f"{who.name}_save"] = _save_phase(ctx, who, sync_dir)
        ctx.comm.barrier()  # every rank's files are complete (MindSpore's saves do not meet)
        out[f"{who.name}_save"]["bytes_on_disk"] = tree_bytes(sync_dir)
        ctx.phase(f"round {r + 1}/{rounds}: {label} load")
        out[f"{who.name}_load"] = _load_phase(ctx, who, sync_dir, state, fw, check=r == 0)
        ctx.phase(f"round {r + 1}/{rounds}: {label} async save")
        out[f"{who.name}_async_save"] = _async_phase(ctx, who, async_dir)
        clear(ctx, sync_dir)
        clear(ctx, async_dir)
    return out


def run(spec: dict, ctx) -> dict:
    from hpckpt.dist import frameworks
    from hpckpt.dist.jobs import save_job, states

    rounds = int(spec.get("rounds") or 3)
    fw = frameworks.named(ctx.framework)
    layout = states.layout_spec(spec, ctx.world_size)
    state, pieces, made = save_job.build_state(spec, ctx, layout)
    state_bytes = states.nbytes_of(pieces, fw, ctx.rank)
    job_state_bytes = distinct_state_bytes(pieces, fw)
    native = (TorchDCP if ctx.framework == "torch" else MindSpore)(ctx, state, state_bytes)
    hpckpt = Hpckpt(ctx, state, state_bytes)
    scratch, made_root = scratch_dir(spec, ctx)
    per_round: list[dict] = []
    try:
        for r in range(rounds):
            order = [hpckpt, native] if r % 2 == 0 else [native, hpckpt]
            per_round.append(_round(ctx, order, scratch, state, fw, r, rounds))
        ctx.phase("gathering the figures")
        everyone = ctx.comm.all_gather_json(per_round)
    finally:
        if ctx.rank == 0:
            remove_scratch(scratch, made_root)
    figures: dict[str, Any] = {"rank": ctx.rank, "framework": ctx.framework, "rounds": rounds,
                               "tensors": len(pieces), "state_bytes": state_bytes,
                               "job_state_bytes": job_state_bytes, **made}
    for who in (hpckpt, native):
        for kind in KINDS:
            key = f"{who.name}_{kind}"
            figures[key] = summary(kind, [rnd[key] for rnd in per_round],
                                   [[ranks[r][key] for ranks in everyone] for r in range(rounds)],
                                   job_state_bytes, who.fsync.get(kind))
    return figures
