"""What bounds a cold `inspect` of a large HyperParallel checkpoint: building the pickle's objects.

    python bench/bench_unpickle_floor.py CKPT [--repeat 3]

CKPT is a HyperParallel checkpoint without a manifest (as `bench/bench_inspect.py` makes one: 64
ranks x 10,000 tensors, a 70.9 MiB `.metadata`). Each measurement runs in a fresh process (its
peak RSS is its own), best of `--repeat`:

  pickle.loads   CPython's C unpickler with nothing checked: HyperParallel's classes resolved to
                 hpckpt's plain stand-ins, the cyclic collector off (as hpckpt runs it); the
                 floor of any reader that builds the pickle's objects, HyperParallel's own
                 loader included (it also runs the stock unpickler, with the collector on);
  pickle.loads, collector on   the same with the collector on, as the stock `pickle.load` runs;
  safe loads     hpckpt's `core.safety.unpickle.loads` (allow-list, budgets, the opcode scan);
  read_index     the whole metadata read: the safe load, the schema checks, the index;
  inspect        `hpckpt inspect CKPT --json`, a whole process, `HPCKPT_NO_CACHE=1`.

Each row gives seconds, peak RSS and the cost per chunk. Reaching a cold `inspect` under 1 s and
300 MiB needs a reader that does not build these objects (a columnar pass over the opcodes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

STEPS = {
    "pickle.loads": """
import gc, io, pickle
from hpckpt.core.codecs import hyperparallel_metadata as hm
class Plain(pickle.Unpickler):
    def find_class(self, module, name):
        return getattr(hm, name)
gc.disable()
t = time.perf_counter(); Plain(io.BytesIO(data)).load(); seconds = time.perf_counter() - t
""",
    "pickle.loads, collector on": """
import io, pickle
from hpckpt.core.codecs import hyperparallel_metadata as hm
class Plain(pickle.Unpickler):
    def find_class(self, module, name):
        return getattr(hm, name)
t = time.perf_counter(); Plain(io.BytesIO(data)).load(); seconds = time.perf_counter() - t
""",
    "safe loads": """
from hpckpt.core.safety.unpickle import METADATA, loads
t = time.perf_counter(); loads(data, what="bench", kind=METADATA); seconds = time.perf_counter() - t
""",
    "read_index": """
from hpckpt.converters import open_index
t = time.perf_counter(); open_index(ckpt); seconds = time.perf_counter() - t
""",
}


def run_step(name: str, ckpt: str) -> tuple[float, float]:
    code = ("import os, sys, time, resource\nckpt = sys.argv[1]\ndata = open(os.path.join(ckpt, '.metadata'), 'rb').read()\n"
            + STEPS[name] + "\nprint(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    done = subprocess.run([sys.executable, "-c", code, ckpt], capture_output=True, text=True, check=True,
                          env=dict(os.environ, HPCKPT_NO_CACHE="1"))
    seconds, rss = map(float, done.stdout.split())
    return seconds, rss


def run_inspect(ckpt: str) -> tuple[float, float]:
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "hpckpt", "inspect", ckpt, "--json"], stdout=subprocess.DEVNULL,
                             env=dict(os.environ, HPCKPT_NO_CACHE="1"))
    _, status, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - start, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    doc = json.loads(subprocess.run([sys.executable, "-m", "hpckpt", "inspect", args.ckpt, "--json", "--summary"],
                                    capture_output=True, text=True, check=True).stdout)
    chunks = doc["counts"]["chunks"]
    size = os.path.getsize(os.path.join(args.ckpt, ".metadata"))
    print(f"load average {os.getloadavg()[0]:.2f}; .metadata {size / 2**20:.1f} MiB, {chunks:,} chunks")
    print("| step | best s | peak RSS MiB | us per chunk |\n|---|---:|---:|---:|")
    for name in [*STEPS, "inspect"]:
        runs = [run_inspect(args.ckpt) if name == "inspect" else run_step(name, args.ckpt) for _ in range(args.repeat)]
        seconds, rss = min(r[0] for r in runs), max(r[1] for r in runs)
        print(f"| {name} | {seconds:.2f} | {rss:.0f} | {seconds / max(chunks, 1) * 1e6:.2f} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
