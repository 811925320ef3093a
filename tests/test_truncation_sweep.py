"""Truncation at any byte, for every reader (issue 10): every file of one small sample of every
format hpckpt reads, cut at every byte position, gives one `error:` line, a documented exit code
(never 1, "internal error"), a run bounded in time and memory, and never a clean `verify`.

The samples are written by the formats' own producers where there is one: the HyperParallel
fixtures (HyperParallel's code) and `examples/tiny-hp` (with hpckpt's manifest);
`torch.distributed.checkpoint.save`, `torch.save`, the `safetensors` library and
transformers' index layout (in a `truncation_driver.py build-torch` subprocess);
`mindspore.save_checkpoint` (in a `build-mindspore` subprocess; hand-assembled protobuf when
MindSpore cannot be imported); MindFormers' own 2-rank save (`fixtures/mindformers/sim2`); a safetensors file with its `.values.json`, which only hpckpt
writes (`hpckpt consolidate`).

A file of at most `EVERY_BYTE` bytes is cut at every position 0 .. size-1; a larger one at no
more than `MAX_POSITIONS`: every one in its first and last 512 bytes, around every structural
boundary found in it (zip records and member data, safetensors header and tensor data, pickle
frames, protobuf messages), and evenly spread ones. `verify` runs on every cut; `inspect` too
where it reads the file that was cut (metadata, indexes, sidecars, safetensors headers,
single-file checkpoints). Both run in `truncation_driver.py sweep`: two processes (one per
core), each with its own copy of its samples, under a 4 GiB address-space cap, never importing
torch; the file is cut in place and restored after each run.
"""

from __future__ import annotations

import json
import pickletools
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

import pytest
from _util import FIXTURES, REPO, children_cpu_seconds
from inprocess import MEMORY_MIB
from hpckpt.core.errors import ERROR_CLASSES

HERE = Path(__file__).parent
DRIVER = HERE / "truncation_driver.py"
DOCUMENTED = {0} | {cls.exit_code for cls in ERROR_CLASSES}
EVERY_BYTE = 8 * 1024
MAX_POSITIONS = 2048
RUN_SECONDS = 2.0  # each run; the driver stops one at 5 s
#: CPU (user + system) of both drivers per run: what "fast" means here, whatever else shares the
#: cores (the suite runs two test files at once)
RUN_CPU_MS = 4.0  # measured 2.0 ms on an idle machine (36,000 runs, 72 s of CPU)
SWEEP_SECONDS = 300  # wall clock, both drivers: a hang guard only
PROCESSES = 2

#: What a cut file is, by its role in its checkpoint; `inspect` runs on the cuts of all but "data".
METADATA, HEADER, SINGLE, DATA = "metadata", "header", "single", "data"


# --- building the samples ------------------------------------------------------------------------


def _copy_fixture(src: Path, dest: Path) -> Path:
    """A HyperParallel fixture without the test's own `expected.*` files."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if not f.name.startswith("expected."):
            shutil.copy2(f, dest / f.name)
    return dest


def _protobuf_ckpt(root: Path) -> None:
    """MindSpore cannot be imported here: a `.ckpt` from raw protobuf fields instead."""
    from hostile_catalogue import ckpt_sample

    (root / "ms").mkdir(exist_ok=True)
    ckpt_sample(root / "ms" / "net.ckpt")


def build_samples(root: Path) -> dict[str, dict]:
    """Every sample: {name: {"path": given to the commands, "files": {relative name: role}}}."""
    root.mkdir(parents=True)
    torch_build = subprocess.Popen([sys.executable, str(DRIVER), "build-torch", str(root)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ms_build = subprocess.Popen([sys.executable, str(DRIVER), "build-mindspore", str(root)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    _copy_fixture(FIXTURES / "m0-mindspore-1rank", root / "hp-m0-mindspore-1rank")
    _copy_fixture(FIXTURES / "m0-torch-4rank-rankLocal", root / "hp-rank-local")
    shutil.copytree(REPO / "examples" / "tiny-hp", root / "hp-tiny")
    shutil.copytree(REPO / "tests" / "fixtures" / "mindformers" / "sim2", root / "mf")  # MindFormers' own files
    from hpckpt import api

    (root / "st").mkdir()
    api.consolidate(root / "hp-m0-mindspore-1rank", root / "st" / "model.safetensors")

    for proc in (torch_build, ms_build):
        _out, err = proc.communicate(timeout=300)
        if proc is ms_build and proc.returncode != 0 and "No module named 'mindspore'" in err:
            _protobuf_ckpt(root)
        else:
            assert proc.returncode == 0, err[-3000:]

    def roles(directory: Path, role_of) -> dict[str, str]:
        return {f.name: role_of(f.name) for f in sorted(directory.iterdir())}

    def hp_role(name: str) -> str:
        # `inspect` of a HyperParallel checkpoint reads its metadata alone, never a rank file
        return METADATA if name in (".metadata", ".hpckpt.json", ".hpckpt-manifest.jsonl") else DATA

    return {
        "hp-m0-mindspore-1rank": {"path": "hp-m0-mindspore-1rank", "files": roles(root / "hp-m0-mindspore-1rank",
                                                                                 hp_role)},
        # rank-local metadata: every rank stores the values again in its `.bytes`, and the index
        # reads rank 0's copy; rank 1's must be checked all the same (its loader reads it). Its
        # other files are the layouts above again (one rank-local metadata file: 2 x 5,404 runs)
        "hp-rank-local": {"path": "hp-rank-local", "files": {"_rank1_.bytes": DATA}},
        # hpckpt's own manifest (the rest of tiny-hp is the fixture's layout again)
        "hp-tiny": {"path": "hp-tiny", "files": {".hpckpt-manifest.jsonl": METADATA}},
        "torch-dcp": {"path": "dcp", "files": {".metadata": METADATA, "__0_0.distcp": DATA}},
        "safetensors+sidecar": {"path": "st/model.safetensors",
                                "files": {"model.safetensors": SINGLE, "model.values.json": METADATA}},
        "hf-sharded": {"path": "hf", "files": roles(root / "hf", lambda n: HEADER if n.endswith(".safetensors")
                                                   else METADATA)},
        # the .bin shards are their own index (the JSON names files only): `inspect` fails on a
        # cut one exactly where `verify` does (reading the index), so `verify` alone is run on them
        "hf-torch-bin": {"path": "hf-bin", "files": roles(root / "hf-bin", lambda n: DATA if n.endswith(".bin")
                                                         else METADATA)},
        "torch-save": {"path": "pt/state.pt", "files": {"state.pt": SINGLE}},
        # MindFormers: inspect reads metadata.json and common.json, never a rank file
        "mindformers": {"path": "mf/iteration_00000005", "files": roles(
            root / "mf" / "iteration_00000005", lambda n: DATA if n.endswith(".safetensors") else METADATA)},
        "mindspore-ckpt": {"path": "ms/net.ckpt", "files": {"net.ckpt": SINGLE}},
        **({"mindspore-ckpt-crc": {"path": "ms-crc/net.ckpt", "files": {"net.ckpt": SINGLE}}}
           if (root / "ms-crc").is_dir() else {}),
    }


# --- where to cut -------------------------------------------------------------------------------


def safetensors_boundaries(raw: bytes) -> list[int]:
    if len(raw) < 8:
        return []
    n = struct.unpack("<Q", raw[:8])[0]
    out = [8, 8 + n]
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError:
        return out
    for key, entry in header.items():
        if key != "__metadata__":
            out += [8 + n + offset for offset in entry["data_offsets"]]
    return out


def zip_boundaries(path: Path, raw: bytes) -> list[int]:
    """Every zip record signature, and the start and end of every member's data."""
    out = []
    for signature in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"):
        at = raw.find(signature)
        while at >= 0:
            out.append(at)
            at = raw.find(signature, at + 1)
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                local = raw[info.header_offset:info.header_offset + 30]
                name_length, extra_length = struct.unpack("<HH", local[26:30])
                start = info.header_offset + 30 + name_length + extra_length
                out += [start, start + info.compress_size]
    except zipfile.BadZipFile:
        pass
    return out


def pickle_boundaries(raw: bytes) -> list[int]:
    """Frame starts and the last opcodes (STOP) of a pickle."""
    out = []
    try:
        for opcode, _arg, pos in pickletools.genops(raw):
            if opcode.name in ("FRAME", "STOP", "PROTO"):
                out.append(pos)
    except ValueError:
        pass
    return out


def protobuf_messages(raw: bytes) -> list[int]:
    """The end of every top-level length-delimited field (a MindSpore Value), walked here from the
    wire format: field key varint, length varint, payload."""
    ends, at = [], 0

    def varint(i: int) -> tuple[int, int]:
        shift = value = 0
        while True:
            byte = raw[i]
            value |= (byte & 0x7F) << shift
            i += 1
            if not byte & 0x80:
                return value, i
            shift += 7

    while at < len(raw):
        if raw.startswith(b"crc_num", at):
            break
        key, at = varint(at)
        assert key & 7 == 2, f"top-level field of wire type {key & 7} at {at}"
        length, at = varint(at)
        at += length
        ends.append(at)
    return ends


def boundaries(path: Path, raw: bytes) -> list[int]:
    if path.suffix == ".safetensors":
        return safetensors_boundaries(raw)
    if raw.startswith(b"PK\x03\x04"):
        return zip_boundaries(path, raw)
    if raw[:1] == b"\x80":
        return pickle_boundaries(raw)
    if path.suffix == ".ckpt":
        return protobuf_messages(raw)
    return []


def positions(path: Path) -> list[int]:
    """Every byte position of a small file; `MAX_POSITIONS` chosen ones of a larger one."""
    raw = path.read_bytes()
    size = len(raw)
    if size <= EVERY_BYTE:
        return list(range(size))
    chosen = set(range(512)) | set(range(size - 512, size))
    for b in boundaries(path, raw):
        chosen |= {p for p in range(b - 2, b + 3) if 0 <= p < size}
    assert len(chosen) <= MAX_POSITIONS, f"{path}: {len(chosen)} positions before spreading"
    rest = [p for p in range(size) if p not in chosen]
    room = MAX_POSITIONS - len(chosen)
    chosen |= {rest[i * len(rest) // room] for i in range(room)} if room < len(rest) else set(rest)
    return sorted(chosen)


# --- the sweep ----------------------------------------------------------------------------------


def plan_for(samples: dict[str, dict], src: Path, work: Path) -> list[dict]:
    """The drivers' plans: the samples dealt to `PROCESSES` groups by their number of runs, each
    group with its own copy of its samples (a cut in one must never be seen by the other)."""
    items = []
    for name, sample in samples.items():
        base = src / sample["path"]
        directory = base if base.is_dir() else base.parent
        files = []
        for relative, role in sample["files"].items():
            where = positions(directory / relative)
            if role == HEADER and relative.endswith(".safetensors"):
                end = safetensors_boundaries((directory / relative).read_bytes())[1]
                inspect_at = [p for p in where if p <= end]
            else:
                inspect_at = [] if role == DATA else where
            files.append({"file": relative, "role": role, "positions": where, "inspect": inspect_at})
        items.append((sum(len(f["positions"]) + len(f["inspect"]) for f in files), name, files))
    groups: list[list] = [[] for _ in range(PROCESSES)]
    loads = [0] * PROCESSES
    for weight, name, files in sorted(items, reverse=True):
        g = loads.index(min(loads))
        loads[g] += weight
        groups[g].append((name, files))
    plans = []
    for g, group in enumerate(groups):
        plan = []
        for name, files in group:
            sample = samples[name]
            top = Path(sample["path"]).parts[0]
            copy = work / f"group{g}" / top
            if not copy.exists():
                shutil.copytree(src / top, copy)
            path = work / f"group{g}" / sample["path"]
            directory = path if path.is_dir() else path.parent
            plan.append({"name": name, "path": str(path),
                         "files": [{**f, "file": str(directory / f["file"])} for f in files]})
        plans.append(plan)
    return plans


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("truncation")
    started = time.perf_counter()
    samples = build_samples(root / "samples")
    built = time.perf_counter() - started
    plans = plan_for(samples, root / "samples", root / "work")
    started, cpu_before = time.perf_counter(), children_cpu_seconds()
    procs = []
    for g, plan in enumerate(plans):
        (root / f"plan{g}.json").write_text(json.dumps({"samples": plan}))
        procs.append(subprocess.Popen([sys.executable, str(DRIVER), "sweep", str(root / f"plan{g}.json"),
                                       str(root / f"results{g}.json")],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    elapsed, cpu = time.perf_counter() - started, children_cpu_seconds() - cpu_before
    reports = [json.loads((root / f"results{g}.json").read_text()) for g in range(len(plans))]
    files = {f["file"]: f for plan in plans for sample in plan for f in sample["files"]}
    return {"root": root, "samples": samples, "plans": plans, "reports": reports, "files": files, "elapsed": elapsed, "cpu": cpu,
            "built": built, "results": {name: r for report in reports for name, r in report["samples"].items()}}


def test_the_sweep_covers_every_format_every_byte(sweep):
    """One sample of every format with a reader (a new reader fails here until it has one), and
    every byte of every small file."""
    from hpckpt.converters import FORMATS, detect

    src = sweep["root"] / "samples"
    detected = {detect(src / sample["path"]).name for sample in sweep["samples"].values()}
    assert detected == {f.name for f in FORMATS if f.reader is not None}
    for spec in sweep["files"].values():
        size = Path(spec["file"]).stat().st_size
        if size <= EVERY_BYTE:
            assert spec["positions"] == list(range(size)), spec["file"]
        else:
            assert len(spec["positions"]) <= MAX_POSITIONS
            assert set(range(512)) | set(range(size - 512, size)) <= set(spec["positions"])


def test_the_drivers_are_fast_lean_and_never_import_torch(sweep):
    for report in sweep["reports"]:
        assert not report["torch_imported"] and not report["mindspore_imported"]
        assert report["peak_mib"] < MEMORY_MIB, report["peak_mib"]  # the whole sweep: every run within it
    runs = sum(len(r) for result in sweep["results"].values() for r in result["files"].values())
    print(f"\n{runs} runs in {sweep['elapsed']:.1f} s, {sweep['cpu']:.1f} s of CPU (samples built in "
          f"{sweep['built']:.1f} s)")
    assert sweep["cpu"] * 1000 / runs < RUN_CPU_MS, f"{sweep['cpu'] * 1000 / runs:.2f} ms of CPU a run"
    assert sweep["elapsed"] < SWEEP_SECONDS


def test_every_untouched_sample_verifies(sweep):
    for name, result in sweep["results"].items():
        for command, run in result["intact"].items():
            assert run["code"] == 0, (name, command, run)


def allowed_zero(spec: dict, raw: bytes, at: int, run: dict) -> str | None:
    """Why `verify` (or `inspect`) may exit 0 on this cut, or None: it may not."""
    path = Path(spec["file"])
    if path.suffix in (".json", ".jsonl") and raw[:at].strip() == raw.strip():
        # only the JSON document's trailing newline was cut: the same document, read the same
        return "trailing whitespace of a JSON document"
    if path.name == ".hpckpt-manifest.jsonl" and (run["command"] == "inspect" or any(path.name in w
                                                                                     for w in run["warnings"])):
        # hpckpt's own manifest is advisory (no loader reads it): `verify` warns about a damaged one,
        # `inspect` lists from the metadata and takes the world size from the file names instead
        return "advisory record"
    if path.suffix == ".ckpt" and at in protobuf_messages(raw):
        # a .ckpt is a bare sequence of Value messages with no count, length or end marker: cut
        # between two Values it is a complete, shorter checkpoint, which no reader (MindSpore's
        # included) can tell from one saved with fewer parameters. The CRC trailer does not
        # help: MindSpore finds it only as the file's last 17 bytes, so a file cut before it
        # (or between two Values before it) is a checkpoint saved without CRC.
        return "a .ckpt cut between two Values"
    if spec["role"] in (DATA, HEADER) and run["command"] == "inspect":
        return "inspect does not read tensor data"
    return None


def expected_codes(spec: dict, at: int) -> set[int]:
    """A cut metadata file (pickle, index, sidecar) is corrupt metadata (6), a cut data file is
    corrupt data (9). An empty one-file checkpoint may also be "not a checkpoint" (4): nothing
    in it says what it was (as the hostile catalogue's `arg-zero-byte-ckpt`)."""
    if spec["role"] == METADATA:
        return {6}
    return {4, 9} if spec["role"] == SINGLE and at == 0 else {9}


def problems(spec: dict, raw: bytes, run: dict) -> list[str]:
    code, at, command = run["code"], run["at"], run["command"]
    where = f"{Path(spec['file']).name} cut at {at}: {command}"
    if run["timeout"]:
        return [f"{where}: did not finish"]
    found = []
    if code not in DOCUMENTED:
        found.append(f"{where}: exit {code} {run['error']!r} {run['stderr']!r}")
    elif code == 0:
        if not allowed_zero(spec, raw, at, run):
            found.append(f"{where}: exit 0 on a truncated copy")
        if run["errors"]:
            found.append(f"{where}: exit 0 with {run['errors']} 'error:' lines")
    elif code not in expected_codes(spec, at):
        found.append(f"{where}: exit {code}, expected {sorted(expected_codes(spec, at))}: {run['error']!r} "
                     f"{run['findings']!r}")
    elif Path(spec["file"]).name not in run["error"] + " ".join(run["findings"]):
        found.append(f"{where}: the error does not name the file: {run['error']!r} {run['findings']!r}")
    if code != 0 and run["errors"] != 1:
        found.append(f"{where}: {run['errors']} 'error:' lines (exit {code}) {run['stderr']!r}")
    if run["traceback"]:
        found.append(f"{where}: a traceback")
    if run["seconds"] >= RUN_SECONDS:
        found.append(f"{where}: took {run['seconds']} s")
    return found


def test_every_cut_fails_cleanly(sweep):
    found = []
    for result in sweep["results"].values():
        for file, runs in result["files"].items():
            spec = sweep["files"][file]
            raw = Path(file).read_bytes()
            for run in runs:
                found += problems(spec, raw, run)
    assert not found, f"{len(found)} problems:\n" + "\n".join(found[:60])


def test_summary(sweep):
    """Not a check: the exit codes per file, printed with -s."""
    for name, result in sweep["results"].items():
        for file, runs in result["files"].items():
            c = Counter((r["command"], r["code"]) for r in runs)
            print(name, Path(file).name, dict(sorted(c.items(), key=str)))
