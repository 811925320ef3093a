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
  read_columns   `core.codecs.hyperparallel_metadata_columns_read.read_columns`: the
                 recogniser of the form hpckpt writes at scale, arrays instead of objects
                 ("n/a": the `.metadata` is in another form);
  read_stock_columns   `core.codecs.hyperparallel_metadata_stock_read.read_stock_columns`: the
                 same arrays from the stock pickler's form (HyperParallel's own writer): its
                 records read by numpy, the rest by the safe unpickler;
  read_index     the whole metadata read: the recogniser or the safe load, the schema checks,
                 the index;
  inspect        `hpckpt inspect CKPT --json`, a whole process, `HPCKPT_NO_CACHE=1`.

Each row gives seconds, peak RSS and the cost per chunk. A cold `inspect` under 1 s and 300 MiB
needs a reader that does not build these objects: `read_columns` for the form hpckpt writes,
`read_stock_columns` for HyperParallel's. What such a pass would cost
in Python is printed last: the opcodes in the first `--sample-mib` MiB
(`pickletools.genops`), scaled to the file, and the time of the leanest loop that only steps over
them (a table of argument lengths; nothing kept) over that sample.
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
    "read_columns": """
from hpckpt.core.codecs.hyperparallel_metadata_columns_read import read_columns
t = time.perf_counter(); got = read_columns(data); seconds = time.perf_counter() - t
seconds = seconds if got is not None else float("nan")  # (not the columns writer's form)
""",
    "read_stock_columns": """
from hpckpt.core.codecs.hyperparallel_metadata_stock_read import read_stock_columns
t = time.perf_counter(); got = read_stock_columns(data); seconds = time.perf_counter() - t
seconds = seconds if got is not None else float("nan")  # (not the stock pickler's form)
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


# opcode -> bytes of its argument, for the opcodes a HyperParallel metadata pickle uses
_FIXED = {**dict.fromkeys(b")\x81}(ub\x86\x85\x87e]tN\x88\x89\x93.sa\x941", 0), ord("K"): 1, ord("h"): 1, ord("q"): 1,
          ord("M"): 2, ord("J"): 4, ord("j"): 4, ord("r"): 4, ord("G"): 8, 0x80: 1, 0x95: 8}


def opcode_walk(path: str, sample_mib: float) -> tuple[int, float, float]:
    """(opcodes in the whole file, estimated; the sample's opcodes; ns per opcode of a bare walk)."""
    import pickletools

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(int(sample_mib * 2**20))
    counted = 0
    try:
        for _ in pickletools.genops(data):
            counted += 1
    except ValueError:  # (the sample ends inside an opcode)
        pass
    fixed, i, steps = _FIXED, 0, 0
    started = time.perf_counter()
    while steps < counted:
        op = data[i]
        i += 1
        steps += 1
        n = fixed.get(op)
        if n is not None:
            i += n
        elif op in (0x8C, 0x8A):  # SHORT_BINUNICODE, LONG1: a one-byte length
            i += 1 + data[i]
        elif op == ord("X"):  # BINUNICODE: a four-byte length
            i += 4 + int.from_bytes(data[i:i + 4], "little")
        elif op == ord("c"):  # GLOBAL: two lines
            i = data.index(b"\n", data.index(b"\n", i) + 1) + 1
        else:
            raise SystemExit(f"opcode {op:#x} at {i - 1}: not in the walk's table")
    seconds = time.perf_counter() - started
    return int(counted * size / len(data)), counted, seconds / max(steps, 1) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sample-mib", type=float, default=4.0)
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
        if seconds != seconds:  # NaN: the step does not apply to this form
            print(f"| {name} | n/a (not its form) | | |", flush=True)
            continue
        print(f"| {name} | {seconds:.2f} | {rss:.0f} | {seconds / max(chunks, 1) * 1e6:.2f} |", flush=True)
    total, sampled, ns = opcode_walk(os.path.join(args.ckpt, ".metadata"), args.sample_mib)
    print(f"\nopcodes: {total / 1e6:.1f} M in the file ({sampled:,} in its first {args.sample_mib:g} MiB); a bare "
          f"Python walk over them: {ns:.0f} ns an opcode, {total * ns / 1e9:.1f} s for the file")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
