"""Fuzz every parser for minutes: the targets of `tests/fuzz_targets.py`, many more examples than CI.

    python bench/fuzz_parsers.py [--minutes M] [--target NAME ...] [--samples DIR] [--seed N]

The time is shared evenly among the targets chosen (default: all). Each target runs hypothesis in
rounds of `ROUND` examples with a fresh random seed per round (CI's run is derandomized; this one
looks elsewhere each time, `--seed` makes it repeatable), until its share of the time is spent.
A failing input is shrunk by hypothesis, then saved under `bench/out/fuzz/` as
`TARGET-N.bin` (the bytes) and `TARGET-N.txt` (the file they replace, the failure, and the two
commands that replay it); a failure already saved in this run (same exception at the same place)
is counted, not saved again. Prints, per target: examples, seconds, examples per second, the
outcomes (documented error kinds or ok) and failures; `bench/out/fuzz/summary.json` holds the
same. Exits 1 when anything failed.

The samples are built once (torch, safetensors and MindSpore in subprocesses, about 5 s) in
/dev/shm when there is one (every example writes a file twice), or taken from `--samples`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import fuzz_targets as ft
from hypothesis import HealthCheck, Phase, given, seed, settings

OUT = REPO / "bench" / "out" / "fuzz"
ROUND = 300  # examples per hypothesis run (one random seed each); the time is checked between runs


def _signature(failure: ft.FuzzFailure) -> str:
    """Same bug, same signature: the failure's kind and the last source line of its traceback."""
    text = str(failure)
    head = text.split(":", 2)[1].strip() if ":" in text else text
    kind = head.split(":")[0][:80]
    frames = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    return hashlib.sha1(f"{kind}|{frames[-1] if frames else ''}".encode()).hexdigest()[:12]


def _save(name: str, rel: str, data: bytes, failure: ft.FuzzFailure, number: int) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"{name}-{number}"
    stem.with_suffix(".bin").write_bytes(data)
    stem.with_suffix(".txt").write_text(
        f"target: {name}\nfile replaced: {rel}\nbytes: {len(data)}\n\n{failure}\n\nreplay:\n"
        f"  python tests/fuzz_targets.py build /tmp/fuzz-samples\n"
        f"  python tests/fuzz_targets.py replay /tmp/fuzz-samples {name} {rel} {stem.with_suffix('.bin')}\n")
    return stem.with_suffix(".bin")


def fuzz_target(root: Path, name: str, seconds: float, rng: random.Random, saved: dict) -> dict:
    """Run one target for `seconds`; its examples, outcomes and failures."""
    target = ft.TARGETS[name]
    strategy = target.strategy(root)
    outcomes: Counter = Counter()
    failures: list[dict] = []
    state = {"examples": 0, "last": None}
    deadline = time.monotonic() + seconds

    def body(case) -> None:
        rel, data = case
        state["examples"] += 1
        try:
            outcomes[ft.run_input(root, target, rel, data)] += 1
        except ft.FuzzFailure as exc:
            state["last"] = (rel, data, exc)  # hypothesis replays the shrunk example last
            raise

    started = time.monotonic()
    while time.monotonic() < deadline:
        run = seed(rng.getrandbits(64))(settings(
            max_examples=ROUND, deadline=None, database=None, derandomize=False, print_blob=False,
            suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink))(given(strategy)(body)))
        state["last"] = None
        try:
            run()
        except Exception:  # a FuzzFailure, or hypothesis's Flaky when its replay passed (a timing)
            if state["last"] is None:
                raise
            rel, data, exc = state["last"]
            signature = _signature(exc)
            if signature in saved:
                saved[signature]["seen"] += 1
            else:
                path = _save(name, rel, data, exc, len(saved) + 1)
                saved[signature] = {"target": name, "file": str(path), "seen": 1,
                                    "failure": str(exc).splitlines()[0][:300]}
                print(f"  FAILURE {name}: {saved[signature]['failure']}\n    saved: {path}", flush=True)
            failures.append({"signature": signature, "file": saved[signature]["file"]})
    elapsed = time.monotonic() - started
    return {"examples": state["examples"], "seconds": round(elapsed, 1),
            "per_second": round(state["examples"] / elapsed, 1) if elapsed else 0.0,
            "outcomes": dict(outcomes.most_common()), "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="total time, shared by the targets")
    parser.add_argument("--target", action="append", choices=sorted(ft.TARGETS), help="repeat for several")
    parser.add_argument("--samples", type=Path, help="samples built by `fuzz_targets.py build` (default: build)")
    parser.add_argument("--seed", type=int, help="seed of the rounds' random seeds (default: random)")
    args = parser.parse_args()
    names = args.target or sorted(ft.TARGETS)
    temporary = None
    if args.samples:
        root = args.samples
    else:
        shm = Path("/dev/shm")
        temporary = Path(tempfile.mkdtemp(prefix="hpckpt-fuzz-", dir=shm if shm.is_dir() else None))
        print(f"building the samples in {temporary} ...", flush=True)
        root = ft.build_samples(temporary / "samples")
    rng = random.Random(args.seed)
    saved: dict = {}
    results = {}
    share = args.minutes * 60 / len(names)
    try:
        print(f"{len(names)} target(s), {share:.0f} s each", flush=True)
        print(f"| {'target':<15} | {'examples':>9} | {'seconds':>7} | {'per s':>6} | failures | outcomes")
        print(f"|{'-' * 17}|{'-' * 11}|{'-' * 9}|{'-' * 8}|----------|---------")
        for name in names:
            result = results[name] = fuzz_target(root, name, share, rng, saved)
            outcomes = ", ".join(f"{k} {v}" for k, v in result["outcomes"].items())
            print(f"| {name:<15} | {result['examples']:>9} | {result['seconds']:>7} | {result['per_second']:>6} | "
                  f"{len(result['failures']):>8} | {outcomes}", flush=True)
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps({"minutes": args.minutes, "targets": results,
                                                  "distinct_failures": saved}, indent=1) + "\n")
    print(f"distinct failures: {len(saved)} (summary: {OUT / 'summary.json'})")
    return 1 if saved else 0


if __name__ == "__main__":
    sys.exit(main())
