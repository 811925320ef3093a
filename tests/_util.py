"""Helpers shared by the tests: fixture locations and bit-exact comparison."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# Real checkpoints written by HyperParallel's own code (provenance in their README), kept in the
# repository so that a fresh clone tests itself; HPCKPT_FIXTURES points elsewhere for a newer set.
FIXTURES = Path(os.environ.get("HPCKPT_FIXTURES", REPO / "tests" / "fixtures" / "hyperparallel"))
FIXTURE_NAMES = (
    "legacy-torch-4rank",
    "legacy-torch-4rank-rankLocal",
    "m0-torch-4rank",
    "m0-torch-4rank-rankLocal",
    "m0-mindspore-1rank",
    "m0-mindspore-1rank-noDist",
    "m0-torch-4rank-async",
)


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's children that have ended (their rusage): a
    test's own subprocesses' CPU, taken as a difference around them, which another test file
    running beside this one does not change (it is another process tree)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def missing_fixtures() -> list[str]:
    """The fixture directories the tests expect but cannot find (empty when all are there)."""
    return [name for name in FIXTURE_NAMES if not (FIXTURES / name).is_dir()]


def expected_tensors(fixture: Path) -> dict[str, np.ndarray]:
    """The fixture's ground truth as raw-bit numpy arrays (bf16 as uint16), via real torch."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(str(fixture / "expected.safetensors")).items():
        if t.dtype == torch.bfloat16:
            out[name] = t.view(torch.int16).numpy().view(np.uint16)
        else:
            out[name] = t.numpy()
    return out


def expected_values(fixture: Path) -> dict[str, dict]:
    return json.loads((fixture / "expected.json").read_text())


def assert_bit_equal(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype.itemsize == expected.dtype.itemsize, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = np.ascontiguousarray(actual).view(np.uint8)
    e = np.ascontiguousarray(expected).view(np.uint8)
    assert np.array_equal(a, e), f"{what}: values differ"


def read_location(loc) -> np.ndarray:
    """Read a Location the way a generic reader would: one pread of the span, then a strided view."""
    dt = loc.stored_dtype.np
    with open(loc.path, "rb") as f:
        raw = os.pread(f.fileno(), loc.nbytes, loc.offset)
    assert len(raw) == loc.nbytes
    if loc.nbytes == 0:
        return np.zeros(loc.stored_shape, dtype=dt)
    flat = np.frombuffer(raw, dtype=dt)
    if loc.strides is None:
        return flat[: int(np.prod(loc.stored_shape))].reshape(loc.stored_shape)
    strides = tuple(s * dt.itemsize for s in loc.strides)
    return np.lib.stride_tricks.as_strided(flat, shape=loc.stored_shape, strides=strides, writeable=False)


def torch_bytes(t) -> bytes:
    """The raw little-endian bytes of a tensor in row-major order (works for bf16/float8/bool)."""
    import torch

    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # standard strides, even for size-1 dims
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def as_json_value(value):
    """A Python value as it compares with expected.json (tuples are stored as lists there)."""
    if isinstance(value, (list, tuple)):
        return [as_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json_value(v) for k, v in value.items()}
    return value


def write_row_sharded(root: Path) -> Path:
    """A 4 MB HyperParallel checkpoint at `root`: `w` [1000, 1000] float32 in row shards over 2
    ranks and a value `step`; big enough that a write takes many copy ranges (and overflows a
    2 MiB disk), written by hpckpt's in-memory writer."""
    from hpckpt.converters.hyperparallel.from_memory import ChunkData, write_checkpoint
    from hpckpt.core import dtypes
    from hpckpt.core.geometry.layout import Mesh, TensorLayout, parse_placements

    root.mkdir(parents=True)
    array = np.arange(1_000_000, dtype=np.float32).reshape(1000, 1000)
    layout = TensorLayout(Mesh((2,)), parse_placements("S0"))
    chunks = [ChunkData(rank, box, np.ascontiguousarray(array[box.slices()]).tobytes())
              for rank, boxes in layout.all_boxes(array.shape).items() for box in boxes]
    write_checkpoint(root, {"w": (dtypes.dtype("float32"), array.shape, chunks)}, {"step": (0, 7)})
    return root


def run_torchrun(nproc: int, args: list[str], log: Path, env: dict, timeout: float) -> tuple[int | None, str]:
    """A real `torchrun --standalone` job of `nproc` ranks; its exit code (None: killed after
    `timeout`, its whole process group only) and its output, also left in `log`."""
    import signal
    import subprocess
    import sys

    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    with open(log, "w+") as f:
        proc = subprocess.Popen([*launcher, "--standalone", "--nproc-per-node", str(nproc), *args],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            rc = None
        f.seek(0)
        return rc, f.read()


MANIFEST = ".hpckpt-manifest.jsonl"
RUN_FIELDS = ("command",)  # what differs between two runs writing the same bytes from one source


def manifest_content(path: Path, drop: tuple[str, ...] = RUN_FIELDS) -> tuple[dict, list[str]]:
    """A manifest's header without the fields of one run (`drop`), and its box lines: two
    outputs with the same bytes have the same content."""
    header, *lines = path.read_text().splitlines()
    doc = json.loads(header)
    for key in drop:
        doc.pop(key, None)
    return doc, lines


def tree_without_manifest(tree: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in tree.items() if not name.endswith(MANIFEST)}


def assert_manifest_matches(root: Path) -> None:
    """Every file the manifest of the directory `root` lists, read back: its size, file digest and
    box digests are the ones the writer recorded while writing."""
    from hpckpt.core.io import digest
    from hpckpt.core.commit import manifest

    found = manifest.read(Path(root) / MANIFEST)
    assert found is not None, f"{root} has no manifest"
    for entry in found.file_digests():
        path = Path(root) / entry.name
        assert path.stat().st_size == entry.size, entry.name
        fd = os.open(path, os.O_RDONLY)
        try:
            got = digest.scan_file(fd, entry.size, [b.extents for b in entry.boxes])
        finally:
            os.close(fd)
        assert got.digest == entry.digest, entry.name
        assert list(got.boxes) == [b.digest for b in entry.boxes], entry.name


def normalized_manifest(data: bytes) -> bytes:
    """A manifest's bytes without what names the run (its command line, the source's path and
    identity) and without the listing (derived from the metadata, compared on its own; a
    fan-out's finalize writes none): what two runs writing the same output agree on."""
    header, _, rest = data.partition(b"\n")
    try:
        doc = json.loads(header)
    except ValueError:
        return data  # one a killed run left half-written in its staging directory
    for key in ("command", "source", "index"):
        doc.pop(key, None)
    return json.dumps(doc, sort_keys=True).encode() + b"\n" + rest


def normalized_tree(tree: dict[str, bytes]) -> dict[str, bytes]:
    """`tree` (name: bytes) with every manifest normalized (`normalized_manifest`)."""
    return {n: normalized_manifest(d) if n.endswith(MANIFEST) and d is not None else d for n, d in tree.items()}


def file_tree(root: Path) -> dict[str, bytes | None]:
    """Every name under `root` (hidden ones too): a file's bytes, None for a directory."""
    out: dict[str, bytes | None] = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root)] = None
        for f in files:
            out[os.path.relpath(os.path.join(folder, f), root)] = Path(folder, f).read_bytes()
    return out
