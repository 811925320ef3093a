"""The manifest every hpckpt writer adds (`core.commit.manifest`), its digests taken while writing.

For every output format (HyperParallel, PyTorch DCP, HF sharded, safetensors, torch.save, MindSpore
`.ckpt` with and without its CRC trailer) and for a fan-out run: the output has exactly one
manifest; its header names the format, world size, layout, hpckpt's version, the command and the
source (the source's own manifest digest when it had one); and reading every file back with
`core.io.digest.scan_file` gives the file and box digests the writer recorded without reading
anything back (the proof that hashing while writing hashes what was written, patches and
headers included). Each box line matches the chunk the format's reader finds (file, offsets,
sizes, byte range). `inspect` takes the listing from a valid manifest without unpickling the
metadata, and ignores a manifest whose metadata digest no longer matches.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import xxhash
from _util import FIXTURES, MANIFEST, assert_manifest_matches, manifest_content
from typer.testing import CliRunner

from hpckpt import api
from hpckpt.cli.app import app
from hpckpt.converters import open_index
from hpckpt.core.io import digest
from hpckpt.core.commit import manifest
from hpckpt.core.index import Location

SOURCE = FIXTURES / "m0-torch-4rank"
OUTPUTS = {  # format: (destination name, extra options)
    "hp": ("hp", ["--world-size", "3"]),
    "torch-dcp": ("dcp", ["--world-size", "2"]),
    "hf": ("hf", ["--max-shard-size", "200"]),
    "safetensors": ("model.safetensors", []),
    "pt": ("model.pt", []),
    "ms": ("model.ckpt", []),
    "ms-crc": ("crc.ckpt", ["--crc"]),
}


def cli(*args) -> None:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    out = {}
    for fmt, (name, extra) in OUTPUTS.items():
        out[fmt] = root / name
        cli("convert", SOURCE, "-o", out[fmt], "--to", fmt.removesuffix("-crc"), "--no-fsync", *extra)
    return out


@pytest.mark.parametrize("fmt", list(OUTPUTS))
def test_every_writer_records_digests_that_match_its_files(outputs, fmt):
    path = outputs[fmt]
    sidecar = manifest.path_of(path)
    assert sidecar.name == (MANIFEST if path.is_dir() else path.name + MANIFEST)
    siblings = [p.name for p in (path.iterdir() if path.is_dir() else path.parent.iterdir())]
    assert sum(name.endswith(MANIFEST) for name in siblings) == (1 if path.is_dir() else len(OUTPUTS) - 3)
    found = manifest.read(sidecar)
    head = found.header
    index = open_index(path)
    assert head["format"] == index.format and head["written_by"].startswith("hpckpt ")
    assert head["source"]["path"] == str(SOURCE) and head["source"]["format"] == "hyperparallel"
    assert set(head["source"]["metadata"]) == {".metadata"}  # the source has no manifest: its metadata's digest
    assert isinstance(head["command"], str)
    data_files = set(index.data_files)
    assert set(found.files) == data_files  # every data file, nothing else
    for name, info in found.metadata.items():
        data = (index.root / name).read_bytes()
        assert info == {"bytes": len(data), "digest": xxhash.xxh3_128_hexdigest(data)}
    assert found.mismatch(index.root) is None  # each metadata file (a sidecar too) as recorded
    if path.is_dir():
        assert_manifest_matches(path)
    else:
        _scan_file_output(path, found)
    stored = {}
    for fqn, entry in index.tensors.items():
        for chunk in entry.chunks:
            loc = index.locate(chunk, entry)
            assert isinstance(loc, Location)
            stored[(chunk.file, fqn, chunk.box.offsets)] = (chunk.box.sizes, loc.offset, loc.nbytes)
    listed = {}
    for f in found.file_digests():
        for b in f.boxes:
            start = b.extents[0][0] if b.extents else 0
            listed[(f.name, b.fqn, b.offsets)] = (b.sizes, start, sum(n for _, n in b.extents))
    if fmt.startswith("ms"):  # a .ckpt cuts large tensors: the reader's range spans the pieces' headers
        values = set(open_index(SOURCE).values)  # a .ckpt holds them as 0-d tensors: in the file digest
        assert {k: v[0] for k, v in listed.items()} == {k: v[0] for k, v in stored.items() if k[1] not in values}
    else:
        assert listed == stored


def _scan_file_output(path: Path, found: manifest.Manifest) -> None:
    (entry,) = found.file_digests()
    assert entry.name == path.name and path.stat().st_size == entry.size
    fd = os.open(path, os.O_RDONLY)
    try:
        got = digest.scan_file(fd, entry.size, [b.extents for b in entry.boxes])
    finally:
        os.close(fd)
    assert (got.digest, list(got.boxes)) == (entry.digest, [b.digest for b in entry.boxes])


def test_the_layout_and_world_size_are_recorded(outputs):
    head = manifest.read(manifest.path_of(outputs["hp"])).header
    assert (head["world_size"], head["mesh"], head["placements"]) == (3, [3], "S0")
    assert manifest.read(manifest.path_of(outputs["pt"])).header["world_size"] == 1


def test_a_source_with_a_manifest_is_named_by_its_digest(outputs, tmp_path):
    cli("reshard", outputs["hp"], "-o", tmp_path / "again", "--world-size", "2", "--no-fsync")
    head = manifest.read(tmp_path / "again" / MANIFEST).header
    want = xxhash.xxh3_128_hexdigest((outputs["hp"] / MANIFEST).read_bytes())
    assert head["source"] == {"path": str(outputs["hp"]), "format": "hyperparallel", "manifest": want}


def test_a_changed_byte_changes_the_box_and_file_digest(outputs, tmp_path):
    copy = tmp_path / "hp"
    shutil.copytree(outputs["hp"], copy)
    found = manifest.read(copy / MANIFEST)
    entry = next(f for f in found.file_digests() if f.boxes)
    box = entry.boxes[-1]
    path = copy / entry.name
    data = bytearray(path.read_bytes())
    data[box.extents[0][0]] ^= 1
    path.write_bytes(bytes(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        got = digest.scan_file(fd, entry.size, [b.extents for b in entry.boxes])
    finally:
        os.close(fd)
    assert got.digest != entry.digest
    assert [g != b.digest for g, b in zip(got.boxes, entry.boxes)] == [False] * (len(entry.boxes) - 1) + [True]


def test_inspect_lists_from_the_manifest_without_unpickling(outputs, tmp_path, monkeypatch):
    from hpckpt.converters.hyperparallel.reader import HyperParallelReader

    monkeypatch.setenv("HPCKPT_NO_CACHE", "1")
    path = outputs["hp"]
    parsed = []
    real = HyperParallelReader._parse
    monkeypatch.setattr(HyperParallelReader, "_parse", lambda self, *a: parsed.append(a) or real(self, *a))
    fast = api.inspect(path, decode_values=False).to_json()
    assert parsed == []  # the listing came from the manifest
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    (bare / MANIFEST).unlink()
    slow = api.inspect(bare, decode_values=False).to_json()
    assert parsed  # without one, the metadata is unpickled
    for key in ("format", "world_size", "tensors", "counts", "values"):
        assert json.dumps(fast.get(key), sort_keys=True) == json.dumps(slow.get(key), sort_keys=True), key


def test_a_manifest_whose_metadata_changed_is_not_believed(outputs, tmp_path, monkeypatch):
    from hpckpt.converters.hyperparallel.reader import HyperParallelReader

    monkeypatch.setenv("HPCKPT_NO_CACHE", "1")
    copy = tmp_path / "hp"
    shutil.copytree(outputs["hp"], copy)
    first, *rest = (copy / MANIFEST).read_text().splitlines(keepends=True)
    doc = json.loads(first)
    doc["index"]["tensors"][0][3] = [999]  # a listing that lies about a shape
    doc["metadata"][".metadata"]["digest"] = "0" * 32  # ... and about the metadata it describes
    (copy / MANIFEST).write_text(json.dumps(doc) + "\n" + "".join(rest))
    parsed = []
    real = HyperParallelReader._parse
    monkeypatch.setattr(HyperParallelReader, "_parse", lambda self, *a: parsed.append(a) or real(self, *a))
    report = api.inspect(copy, decode_values=False).to_json()
    assert parsed and all(t["shape"] != [999] for t in report["tensors"])


def test_a_fan_out_manifest_has_every_file(tmp_path):
    for share in ("0-1", "2-3"):
        cli("reshard", SOURCE, "-o", tmp_path / "fan", "--world-size", "4", "--rank", share, "--no-fsync")
    assert not (tmp_path / "fan" / MANIFEST).exists()
    cli("reshard", "--finalize", tmp_path / "fan")
    cli("reshard", SOURCE, "-o", tmp_path / "one", "--world-size", "4", "--no-fsync")
    drop = ("command", "index")
    assert manifest_content(tmp_path / "fan" / MANIFEST, drop) == manifest_content(tmp_path / "one" / MANIFEST, drop)
    assert_manifest_matches(tmp_path / "fan")


@pytest.mark.parametrize("maps", [True, False], ids=["mapped", "file-system-without-mmap"])
def test_large_copied_ranges_are_hashed_through_a_mapping_or_the_buffer(maps, tmp_path, monkeypatch):
    """Ranges of `engine.MAP_MIN` and more are written from a mapping of their source, over more
    than one `MAP_SPAN` here; a file system that cannot map files gets the piece buffer instead.
    Either way the digests are those of the bytes written."""
    import errno

    import numpy as np
    from safetensors.numpy import save_file

    from hpckpt.core.io import box_filler as engine  # where the mapped copies are
    from hpckpt.core.geometry.layout import LayoutSpec

    src = tmp_path / "big.safetensors"
    save_file({"w": np.arange(3 * 1024 * 1024, dtype=np.float32).reshape(3072, 1024),
               "b": np.arange(1000, dtype=np.float32)}, str(src))
    assert src.stat().st_size > engine.MAP_SPAN + engine.MAP_MIN
    mapped = []
    real = engine.mmap.mmap

    def mmap_or_not(*args, **kwargs):
        mapped.append(args[1])
        if not maps:
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.mmap, "mmap", mmap_or_not)
    api.reshard(src, tmp_path / "out", LayoutSpec.for_world_size(1))
    assert len(mapped) == (2 if maps else 1)  # 12 MiB in 8 MiB spans; or the first refused
    assert_manifest_matches(tmp_path / "out")
    cli("diff", src, tmp_path / "out")  # exit 0: equal


def test_no_manifest_when_asked_and_a_sidecar_without_its_file_is_replaced(tmp_path):
    """`--no-manifest` writes none (single file, directory, fan-out); a sidecar hpckpt wrote whose
    file a user deleted does not block the next write (it is replaced), one hpckpt did not write
    still does."""
    invoker = CliRunner()

    def run(*args, code=0):
        result = invoker.invoke(app, [*map(str, args)])
        assert result.exit_code == code, result.output
        return result.output

    model = tmp_path / "model.safetensors"
    run("consolidate", SOURCE, "-o", model, "--no-manifest")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model.values.json"]
    run("reshard", SOURCE, "-o", tmp_path / "hp", "--world-size", "2", "--no-manifest")
    assert manifest.NAME not in os.listdir(tmp_path / "hp")
    assert json.loads(run("verify", "--deep", "--json", tmp_path / "hp"))["ok"] is True
    for rank in ("0", "1"):
        run("reshard", SOURCE, "-o", tmp_path / "fan", "--world-size", "2", "--rank", rank, "--no-manifest")
    run("reshard", "--finalize", tmp_path / "fan")
    assert manifest.NAME not in os.listdir(tmp_path / "fan")
    # a stale sidecar: hpckpt's, its file gone
    model.unlink()
    (tmp_path / "model.values.json").unlink()
    run("consolidate", SOURCE, "-o", model)
    sidecar = tmp_path / manifest.sidecar_name(model.name)
    assert sidecar.is_file()
    model.unlink()
    run("consolidate", SOURCE, "-o", model)  # replaced, no --force needed
    assert manifest.read(sidecar) is not None and model.is_file()
    model.unlink()
    sidecar.write_text("my notes\n")  # not hpckpt's: kept, and the write refused
    assert "exists" in run("consolidate", SOURCE, "-o", model, code=14)
    assert sidecar.read_text() == "my notes\n" and not model.exists()
