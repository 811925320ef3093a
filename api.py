"""The library entry points, one per command; the CLI is a thin layer over these.

Each returns plain data (the documented JSON documents), so scripts get exactly what
`hpckpt ... --json` prints.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Any, Iterable

from hpckpt import __version__
from hpckpt.converters import open_index
from hpckpt.core.errors import HpckptError
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.layout import inferred_layouts
from hpckpt.core.validate import Finding, exit_code, validate

SCHEMA_VERSION = 1
_RANK = re.compile(r"_rank(\d+)[_.]|^__(\d+)_\d+\.distcp$")


def select(names: Iterable[str], include: Iterable[str] = (), exclude: Iterable[str] = ()) -> list[str]:
    """Keep names matching any `include` glob (all when none) and no `exclude` glob."""
    include, exclude = list(include), list(exclude)
    return [
        n for n in names
        if (not include or any(fnmatch.fnmatchcase(n, g) for g in include))
        and not any(fnmatch.fnmatchcase(n, g) for g in exclude)
    ]


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    return repr(value)


def rank_of(file: str) -> int | None:
    match = _RANK.search(os.path.basename(file))
    if not match:
        return None
    return int(match.group(1) or match.group(2))


def _file_sizes(index: CheckpointIndex) -> list[dict]:
    out = []
    for name in index.metadata_files + index.data_files:
        try:
            size = os.stat(index.root / name).st_size
        except OSError:
            size = None
        out.append({"path": name, "bytes": size})
    return out


def inspect(path: str | Path, include: Iterable[str] = (), exclude: Iterable[str] = (),
            shards: Iterable[str] = (), decode_values: bool = True, use_cache: bool = True) -> dict:
    """Describe a checkpoint from its metadata (data files are only stat'ed, values decoded).

    `shards` globs select tensors whose chunk boxes are listed per rank and file. Large
    HyperParallel indexes are cached after the first run (see converters.index_cache).
    """
    index = open_index(path, use_cache=use_cache)
    files = _file_sizes(index)
    layouts = inferred_layouts(index)
    names = select(index.tensors, include, exclude)
    tensors = []
    for fqn in names:
        entry = index.tensors[fqn]
        tensors.append({
            "fqn": fqn,
            "dtype": entry.dtype.name,
            "dtype_as_written": entry.dtype_spelling,
            "shape": list(entry.shape),
            "layout": layouts[fqn],
            "chunks": entry.n_chunks,
            "bytes": entry.nbytes,
        })
    values = []
    for fqn in select(index.values, include, exclude):
        value = index.values[fqn]
        item: dict[str, Any] = {"fqn": fqn, "file": value.file, "offset": value.offset, "length": value.length}
        if decode_values:
            try:
                decoded = index.decode_value(fqn)
                item.update(type=type(decoded).__name__, value=_jsonable(decoded))
            except HpckptError as exc:
                item.update(type=None, error=exc.message)
        values.append(item)
    document: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "hpckpt_version": __version__,
        "path": str(path),
        "format": index.format,
        "format_version": index.format_version,
        "framework": index.framework,
        "world_size": index.world_size,
        "files": files,
        "total_bytes": sum(f["bytes"] or 0 for f in files),
        "counts": {
            "tensors": len(index.tensors),
            "values": len(index.values),
            "chunks": sum(t.n_chunks for t in index.tensors.values()),
            "tensor_bytes": sum(t.nbytes for t in index.tensors.values()),
        },
        "tensors": tensors,
        "values": values,
    }
    shard_globs = list(shards)
    if shard_globs:
        document["shards"] = [
            {
                "fqn": fqn,
                "chunks": [
                    {
                        "offsets": list(c.box.offsets),
                        "sizes": list(c.box.sizes),
                        "file": c.file,
                        "key": c.key,
                        "rank": rank_of(c.file),
                    }
                    for c in index.tensors[fqn].chunks
                ],
            }
            for fqn in select(names, shard_globs)
        ]
    return document


def verify(path: str | Path, strict: bool = False) -> dict:
    """Check a checkpoint's structure; the document's `exit_code` is what `hpckpt verify` exits with."""
    index = open_index(path)
    findings: list[Finding] = validate(index)
    return {
        "schema": SCHEMA_VERSION,
        "hpckpt_version": __version__,
        "path": str(path),
        "format": index.format,
        "ok": exit_code(findings, strict) == 0,
        "exit_code": exit_code(findings, strict),
        "checked": {
            "tensors": len(index.tensors),
            "chunks": sum(t.n_chunks for t in index.tensors.values()),
            "values": len(index.values),
            "files": len(index.data_files),
        },
        "findings": [f.to_json() for f in findings],
    }


# --- writing: reshard and consolidate -------------------------------------------------------

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """`5GB` (decimal, as Hugging Face counts), `512MiB` (binary) or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def _run_report(kind: str, src: str | Path, dst: str | Path, started: float, written: int, read: int,
                **extra: Any) -> dict:
    import time

    seconds = time.perf_counter() - started
    return {
        "schema": SCHEMA_VERSION,
        "hpckpt_version": __version__,
        "command": kind,
        "source": str(src),
        "destination": str(dst),
        "bytes_written": written,
        "bytes_read": read,
        "read_amplification": round(read / written, 3) if written else None,
        "seconds": round(seconds, 3),
        "gb_per_s": round(written / seconds / 1e9, 3) if seconds > 0 else None,
        **extra,
    }


FRAGMENT_DIR = ".hpckpt-fanout"


def _spelling(framework: str | None):
    if framework == "mindspore":
        return lambda d: d.mindspore or d.torch
    return lambda d: d.torch


def plan_reshard(src: str | Path, spec: Any, *, include: Iterable[str] = (), exclude: Iterable[str] = (),
                 ranks: Iterable[int] | None = None, framework: str | None = None, dtype: str | None = None,
                 index: Any = None, casts: dict | None = None):
    """Read `src` (or take its already opened `index`) and plan its reshard onto `spec` (a
    `core.layout.LayoutSpec`); nothing is written. `casts` maps single tensors to a dtype."""
    from hpckpt.core import dtypes
    from hpckpt.core.plan import make_plan

    index = index if index is not None else open_index(src)
    names = select(list(index.tensors) + list(index.values), include, exclude)
    world_size = max(spec.mesh.ranks) + 1
    framework = framework or index.framework
    plan = make_plan(index, lambda entry: spec.resolve(entry.fqn, entry.shape), world_size, names=names,
                     ranks=ranks, dtype_spelling=_spelling(framework),
                     cast_to=dtypes.dtype(dtype) if dtype else None, casts=casts)
    return index, plan, framework


def _plan_summary(plan) -> dict:
    stats = plan.stats()
    return {
        "world_size": plan.world_size,
        "ranks": [
            {"rank": s.rank, "bytes_written": s.bytes_written, "bytes_read": s.bytes_read, "source_files": s.source_files}
            for s in stats
        ],
        "files": len(plan.files) + (1 if plan.values and plan.values_rank in plan.producing else 0),
        "bytes": sum(s.bytes_written for s in stats),
        "bytes_read": sum(s.bytes_read for s in stats),
    }


def keep_layout_spec(src: str | Path, mesh: Any, index: Any = None) -> Any:
    """A target that keeps each tensor's layout and changes only the mesh size (HSDP-style).

    Each tensor's split dims, as inferred from its chunks, go in order onto the last mesh dims
    (outer mesh dims replicate), with the split rule it was saved with; replicated tensors stay
    replicated; irregular ones (ragged) are split on dim 0 over the last mesh dim.
    """
    from hpckpt.core.layout import LayoutSpec, Replicate, Shard, TensorLayout, infer

    index = index if index is not None else open_index(src)
    layouts = {}
    for fqn, entry in index.tensors.items():
        found = infer(entry.shape, (c.box for c in entry.chunks), index.world_size)
        if found is not None and found.kind == "replicated":
            splits: list[Any] = []
        elif found is not None and found.kind == "sharded":
            splits = [Shard(d, "balanced" if r == "even" else r) for d, r in zip(found.dims, found.rules)]
        else:
            splits = [Shard(0)] if entry.shape else []
        splits = splits[-mesh.ndim:] if splits else []
        placements = (Replicate(),) * (mesh.ndim - len(splits)) + tuple(splits)
        layouts[fqn] = TensorLayout(mesh, placements)
    return LayoutSpec(mesh, layouts=layouts)


class Progress:
    """What the write commands report progress to: `start(total_bytes)`, then `advance(n)`."""

    def start(self, total: int) -> None: ...

    def advance(self, n: int) -> None: ...


def reshard(src: str | Path, dst: str | Path, spec: Any, *, include: Iterable[str] = (),
            exclude: Iterable[str] = (), ranks: Iterable[int] | None = None, force: bool = False,
            jobs: int | None = None, max_memory: int | None = None, framework: str | None = None,
            dtype: str | None = None, dry_run: bool = False, progress=None, sync: bool = True,
            index: Any = None, casts: dict | None = None) -> dict:
    """Reshard `src` into a HyperParallel DCP checkpoint at `dst` laid out by `spec`.

    With `ranks`, only those target ranks' files are written (fan-out); `finalize(dst)` writes
    the metadata once every rank's files are there.
    """
    import time

    from hpckpt.core import engine
    from hpckpt.core.metadata import dumps_metadata
    from hpckpt.core.staging import StagingDir, write_durably

    started = time.perf_counter()
    index, plan, framework = plan_reshard(src, spec, include=include, exclude=exclude, ranks=ranks,
                                          framework=framework, dtype=dtype, index=index, casts=casts)
    summary = _plan_summary(plan)
    if dry_run:
        return {**_run_report("reshard", src, dst, started, 0, 0), "dry_run": True, "plan": summary}
    if progress is not None:
        progress.start(summary["bytes"])
    options = dict(jobs=jobs, max_memory=max_memory or engine.DEFAULT_MAX_MEMORY,
                   progress=progress.advance if progress is not None else None,
                   file_metadata={"format": "ms"} if framework == "mindspore" else None, sync=sync)
    metadata_bytes = dumps_metadata(plan.metadata)
    if ranks is None:
        with StagingDir(Path(dst), force=force, sync=sync) as staging:
            engine.execute(plan, index, staging.path, **options)
            write_durably(staging.path / ".metadata", metadata_bytes, sync)
            staging.commit()
    else:
        _write_fragment(plan, index, Path(dst), metadata_bytes, options)
    return {**_run_report("reshard", src, dst, started, summary["bytes"], summary["bytes_read"]),
            "dry_run": False, "plan": summary, "finalized": ranks is None}


def _write_fragment(plan, index, dst: Path, metadata_bytes: bytes, options: dict) -> None:
    """Fan-out: this job's files go straight into `dst` (each written under a temporary name and
    renamed), then a record of them; the shared metadata waits in the fragment directory."""
    import hashlib
    import json as _json

    from hpckpt.core import engine
    from hpckpt.core.errors import DestinationExistsError
    from hpckpt.core.staging import write_durably

    if (dst / ".metadata").exists():
        raise DestinationExistsError(f"{dst} is already a finished checkpoint")
    fragments = dst / FRAGMENT_DIR
    fragments.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(metadata_bytes).hexdigest()
    plan_file = fragments / f"plan-{digest[:16]}.metadata"
    if not plan_file.exists():
        tmp = fragments / f".tmp-{os.getpid()}"
        write_durably(tmp, metadata_bytes)
        os.replace(tmp, plan_file)
    work = dst / f".hpckpt-tmp-{os.getpid()}"
    work.mkdir(exist_ok=True)
    try:
        engine.execute(plan, index, work, **options)
        names = sorted(p.name for p in work.iterdir())
        for name in names:
            os.replace(work / name, dst / name)
    finally:
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()
    record = {"plan": digest, "ranks": list(plan.producing), "files": names}
    write_durably(fragments / f"ranks-{min(plan.producing)}-{max(plan.producing)}-{digest[:16]}.json",
                  _json.dumps(record, sort_keys=True).encode())


def finalize(dst: str | Path) -> dict:
    """Write `.metadata` for a fanned-out reshard once every target rank's files are present.

    Raises:
        NotACheckpointError: `dst` holds no fan-out fragments.
        CorruptMetadataError: the fragments come from different plans.
        MissingFileError: some rank's files are missing (the message names the ranks).
    """
    import json as _json
    import shutil

    from hpckpt.core.errors import CorruptMetadataError, MissingFileError, NotACheckpointError
    from hpckpt.core.staging import write_durably
    from hpckpt.core.unpickle import loads

    dst = Path(dst)
    fragments = dst / FRAGMENT_DIR
    records = [_json.loads(p.read_text()) for p in sorted(fragments.glob("ranks-*.json"))] if fragments.is_dir() else []
    if not records:
        raise NotACheckpointError(f"{dst}: no fan-out fragments to finalize",
                                  hint="run `hpckpt reshard ... --rank R` for every target rank first")
    digests = {r["plan"] for r in records}
    if len(digests) != 1:
        raise CorruptMetadataError(f"{dst}: fragments come from {len(digests)} different plans (different sources or options)")
    (digest,) = digests
    metadata_bytes = (fragments / f"plan-{digest[:16]}.metadata").read_bytes()
    metadata = loads(metadata_bytes, what=str(fragments))
    needed = sorted({info.relative_path for info in metadata.storage_data.values()})
    done = {f for r in records for f in r["files"]}
    missing = [name for name in needed if name not in done or not (dst / name).is_file()]
    if missing:
        raise MissingFileError(f"{dst}: {len(missing)} file(s) not written yet, e.g. {missing[0]}",
                               hint="run the missing target ranks with --rank, then finalize again")
    write_durably(dst / ".metadata", metadata_bytes)
    shutil.rmtree(fragments)
    return {"schema": SCHEMA_VERSION, "destination": str(dst), "files": len(needed), "finalized": True}


CONSOLIDATE_FORMATS = ("safetensors", "hf", "pt", "dcp")


def _values_document(index, names: list[str]) -> dict:
    return {fqn: {"type": type(v).__name__, "value": _jsonable(v)}
            for fqn in names if fqn in index.values for v in [index.decode_value(fqn)]}


def consolidate(src: str | Path, out: str | Path, fmt: str = "safetensors", *, include: Iterable[str] = (),
                exclude: Iterable[str] = (), dtype: str | None = None, max_shard_size: str | int = "5GB",
                force: bool = False, jobs: int | None = None, max_memory: int | None = None, progress=None,
                sync: bool = True, index: Any = None, casts: dict | None = None, framework: str | None = None) -> dict:
    """Merge `src` into whole tensors: one safetensors file, Hugging Face shards, a torch.save
    file or a one-rank HyperParallel checkpoint. Non-tensor values go into the pt file, or into a
    JSON side file (`values.json` / `<name>.values.json`) for the safetensors formats.
    """
    import json as _json
    import time

    from hpckpt.core import dtypes, engine
    from hpckpt.core.plan import TargetFile, plan_whole_tensors
    from hpckpt.core.staging import StagingDir, fsync_files, refuse_existing, write_durably

    if fmt not in CONSOLIDATE_FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose one of {', '.join(CONSOLIDATE_FORMATS)}")
    out = Path(out)
    if fmt == "dcp":
        from hpckpt.core.layout import LayoutSpec

        report = reshard(src, out, LayoutSpec.for_world_size(1), include=include, exclude=exclude, force=force,
                         jobs=jobs, max_memory=max_memory, dtype=dtype, progress=progress, sync=sync,
                         index=index, casts=casts, framework=framework)
        return {**report, "command": "consolidate", "format": fmt}
    started = time.perf_counter()
    index = index if index is not None else open_index(src)
    names = select(index.tensors, include, exclude)
    value_names = select(index.values, include, exclude)
    cast_to = dtypes.dtype(dtype) if dtype else None
    budget = max_memory or engine.DEFAULT_MAX_MEMORY
    if fmt == "hf":
        cap = parse_size(max_shard_size)
        files = plan_whole_tensors(index, names, max_file_bytes=cap, cast_to=cast_to, casts=casts,
                                   file_names=lambda i, n: f"model-{i + 1:05d}-of-{n:05d}.safetensors")
    else:
        files = plan_whole_tensors(index, names, cast_to=cast_to, casts=casts,
                                   file_names=lambda i, n: out.name)
    written = sum(f.nbytes for f in files)
    read = sum(p.region.volume * t.dtype.itemsize for f in files for t in f.tensors for p in t.pieces)
    if progress is not None:
        progress.start(written)
    advance = progress.advance if progress is not None else (lambda n: None)
    # "pt" unless MindSpore's flavour is asked for: Hugging Face loaders accept only pt/tf/flax/mlx.
    file_metadata = {"format": "ms" if framework == "mindspore" else "pt"}
    if fmt == "hf":
        with StagingDir(out, force=force, sync=sync) as staging:
            from concurrent.futures import ThreadPoolExecutor

            n_jobs = max(1, jobs or engine.default_jobs())
            with ThreadPoolExecutor(n_jobs) as pool:
                futures = [pool.submit(engine.write_target_file, staging.path / f.name, f, index,
                                       budget=max(1, budget // n_jobs), progress=advance,
                                       metadata=file_metadata, sync=sync) for f in files]
                for future in futures:
                    future.result()
            if sync:
                fsync_files(staging.path / f.name for f in files)
            weight_map = {t.key: f.name for f in files for t in f.tensors}
            document = {"metadata": {"total_size": written}, "weight_map": dict(sorted(weight_map.items()))}
            write_durably(staging.path / "model.safetensors.index.json",
                          (_json.dumps(document, indent=2, sort_keys=True) + "\n").encode(), sync)
            if value_names:
                write_durably(staging.path / "values.json",
                              (_json.dumps(_values_document(index, value_names), indent=1) + "\n").encode(), sync)
            staging.commit()
        return {**_run_report("consolidate", src, out, started, written, read), "format": fmt, "files": len(files) + 1}
    refuse_existing(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    target: TargetFile = files[0]
    if fmt == "pt":
        _write_pt(out, target, index, value_names, budget, advance, sync)
    else:
        tmp = out.parent / f".{out.name}.hpckpt-tmp-{os.getpid()}"
        try:
            engine.write_target_file(tmp, target, index, budget=budget, progress=advance,
                                     metadata=file_metadata, sync=sync)
            if sync:
                fsync_files([tmp])
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        if value_names:
            side = out.with_name(out.name.removesuffix(".safetensors") + ".values.json")
            write_durably(side, (_json.dumps(_values_document(index, value_names), indent=1) + "\n").encode(), sync)
    return {**_run_report("consolidate", src, out, started, written, read), "format": fmt}


def _write_pt(out: Path, target, index, value_names: list[str], budget: int, progress, sync: bool) -> None:
    """Stream a torch.save file: tensors in checkpoint order, then the values. Tensor bytes are
    placed in the file by the engine (kernel copies where the source allows) and their CRC is read
    back on a second thread; peak memory is one tile (`budget`) plus the CRC buffer (8 MiB) plus
    the pickle of the names."""
    from hpckpt.core.engine import TileCopier
    from hpckpt.core.read import OpenFiles
    from hpckpt.core.torch_save_writer import TorchSaveWriter

    with TorchSaveWriter(out, fsync=sync) as writer:
        for t in target.tensors:
            writer.add_tensor(t.key, t.dtype, t.box.sizes)
        for fqn in value_names:
            writer.add_value(fqn, index.decode_value(fqn))
        with OpenFiles() as files:
            copier = TileCopier(index, files, -1, budget, progress, writeback=sync)
            for t in target.tensors:
                writer.write_tensor_in_place(t.key, lambda fd, offset, t=t: copier.write(t, offset, fd))


CONVERT_TARGETS = ("pt", "ms", "safetensors", "hf", "hp", "torch-dcp")
_EXTENSION_TARGETS = {".pt": "pt", ".pth": "pt", ".bin": "pt", ".ckpt": "ms", ".safetensors": "safetensors"}


def target_from_extension(dst: str | Path) -> str | None:
    """The container a destination file's extension names (`.pt`, `.ckpt`, `.safetensors`)."""
    return _EXTENSION_TARGETS.get(Path(dst).suffix.lower())


def _selected(names: tuple[str, ...], include: list[str], exclude: list[str]) -> bool:
    """An entry known by several names (before and after renaming) is kept when any of them
    matches an `include` glob (or there is none) and none matches an `exclude` glob."""
    def hit(globs: list[str]) -> bool:
        return any(fnmatch.fnmatchcase(n, g) for n in names for g in globs)

    return (not include or hit(include)) and not hit(exclude)


def map_names(index: CheckpointIndex, rules: Any, include: Iterable[str] = (), exclude: Iterable[str] = ()):
    """Rename and select `index`'s entries: returns (view index, `core.names.NameMapping` or
    None, per-tensor dtypes asked by the rules, derived tensors to compute). Globs match the
    source name or the destination name (`--exclude 'optim.*'` works whichever side says it)."""
    from hpckpt.core.view import renamed_view

    include, exclude = list(include), list(exclude)
    everything = list(index.tensors) + list(index.values)
    if rules is None:
        renames = {n: None for n in everything if not _selected((n,), include, exclude)}
        return renamed_view(index, renames), None, {}, ()
    from hpckpt.core.names import map_names as _map

    mapping = _map(everything, rules, shapes={n: e.shape for n, e in index.tensors.items()})
    renames: dict[str, str | None] = {}
    transposes, casts = {}, {}
    for source, entry in mapping.entries.items():
        keep = entry.destination is not None and _selected((source, entry.destination), include, exclude)
        renames[source] = entry.destination if keep else None
        if keep and entry.transpose is not None and source in index.tensors:
            transposes[source] = entry.transpose
        if keep and entry.dtype is not None:
            casts[entry.destination] = entry.dtype
    derived = tuple(d for d in mapping.derived if _selected((d.destination,), include, exclude))
    return renamed_view(index, renames, transposes), mapping, casts, derived


def convert(src: str | Path, dst: str | Path, to: str | None = None, *, spec: Any = None,
            framework: str | None = None, dtype: str | None = None, include: Iterable[str] = (),
            exclude: Iterable[str] = (), rules: Any = None, max_shard_size: str | int = "5GB",
            force: bool = False, jobs: int | None = None, max_memory: int | None = None, progress=None,
            sync: bool = True, dry_run: bool = False, crc: bool = False, command: str = "convert",
            index: CheckpointIndex | None = None) -> dict:
    """Convert `src` (any format hpckpt reads) into `to`: pt, ms (.ckpt), safetensors, hf, hp
    (HyperParallel DCP laid out by `spec`; default: the source's layout) or torch-dcp.

    `rules` (a `core.names.NameRules` or a preset name) renames, transposes and casts entries;
    `framework` picks the dtype spellings of an `hp` output ("torch" or "mindspore"); `index` is
    the source's when the caller has opened it already.
    """
    import tempfile
    import time

    from hpckpt.core import dtypes

    to = to or target_from_extension(dst)
    if to not in CONVERT_TARGETS:
        raise ValueError(f"unknown target {to!r}: choose one of {', '.join(CONVERT_TARGETS)}")
    started = time.perf_counter()
    source = index if index is not None else open_index(src)
    view, mapping, casts, derived = map_names(source, rules, include, exclude)
    report_extra: dict[str, Any] = {"source_format": source.format, "format": to}
    if mapping is not None:
        from hpckpt.core.names import mapping_json, render_mapping

        report_extra["names"] = {**mapping_json(mapping), "table": render_mapping(mapping)}
    if dry_run:
        would = {"tensors": len(view.tensors) + len(derived), "values": len(view.values),
                 "bytes": sum(e.nbytes for e in view.tensors.values())}
        return {**_run_report(command, src, dst, started, 0, 0), **report_extra, "dry_run": True, "would_write": would}
    with tempfile.TemporaryDirectory(prefix="hpckpt-derived-") as scratch:
        if derived:
            from hpckpt.core.derive import derive_values, with_tensors

            arrays = derive_values(source, derived)
            view = with_tensors(view, arrays, {d.destination: d.dtype for d in derived}, Path(scratch) / "derived.bin")
        common = dict(force=force, jobs=jobs, max_memory=max_memory, progress=progress, sync=sync, dtype=dtype,
                      index=view, casts=casts or None)
        if to in ("pt", "safetensors", "hf"):
            report = consolidate(src, dst, to, max_shard_size=max_shard_size, framework=framework, **common)
        elif to == "hp":
            target = spec if spec is not None else _source_layout(view)
            report = reshard(src, dst, target, framework=framework or view.framework, **common)
        elif to == "torch-dcp":
            target = spec if spec is not None else _source_layout(view)
            report = _write_torch_dcp(src, dst, target, **common)
        else:
            report = _write_ckpt(src, dst, view, casts, dtypes.dtype(dtype) if dtype else None, crc=crc,
                                 force=force, max_memory=max_memory, progress=progress, sync=sync)
    return {**report, **report_extra, "command": command, "seconds": round(time.perf_counter() - started, 3)}


def _source_layout(index: CheckpointIndex) -> Any:
    """The layout the source was saved with, tensor by tensor: the same boxes on the same number
    of ranks. A tensor split into n parts on W ranks gets the mesh (W / n, *parts) with its splits
    on the inner dims (replicated over the outer one, as HSDP saves); replicated tensors stay
    replicated; irregular ones (ragged) are split on dim 0 over all ranks."""
    import math

    from hpckpt.core.layout import LayoutSpec, Mesh, Replicate, Shard, TensorLayout, infer

    found = {fqn: infer(e.shape, e.boxes, index.world_size) for fqn, e in index.tensors.items()}
    grids = [math.prod(f.parts) for f in found.values() if f is not None and f.kind == "sharded"]
    world = max([index.world_size or 1, *grids])
    mesh = Mesh((world,))
    layouts = {}
    for fqn, f in found.items():
        if f is not None and f.kind == "sharded":
            splits = tuple(Shard(d, "balanced" if r == "even" else r) for d, r in zip(f.dims, f.rules))
            n = math.prod(f.parts)
            if world % n == 0 and world > n:
                layouts[fqn] = TensorLayout(Mesh((world // n, *f.parts)), (Replicate(),) + splits)
            else:
                layouts[fqn] = TensorLayout(Mesh(f.parts), splits)
        elif (f is not None and f.kind == "replicated") or not index.tensors[fqn].shape:
            layouts[fqn] = TensorLayout(mesh, (Replicate(),))
        else:
            layouts[fqn] = TensorLayout(mesh, (Shard(0),))
    return LayoutSpec(mesh, layouts=layouts)


def _write_torch_dcp(src: str | Path, dst: str | Path, spec: Any, *, force: bool, jobs: int | None,
                     max_memory: int | None, progress, sync: bool, dtype: str | None, index: Any,
                     casts: dict | None) -> dict:
    """A PyTorch DCP checkpoint: the reshard plan, written as `.distcp` archives + torch metadata."""
    import time

    from hpckpt.core import engine
    from hpckpt.core.staging import StagingDir
    from hpckpt.core.torch_dcp_write import write_torch_dcp

    started = time.perf_counter()
    _index, plan, _framework = plan_reshard(src, spec, index=index, casts=casts, dtype=dtype, framework="torch")
    summary = _plan_summary(plan)
    if progress is not None:
        progress.start(summary["bytes"])
    with StagingDir(Path(dst), force=force, sync=sync) as staging:
        write_torch_dcp(plan, index, staging.path, budget=max_memory or engine.DEFAULT_MAX_MEMORY,
                        progress=progress.advance if progress is not None else (lambda n: None), sync=sync)
        staging.commit()
    return {**_run_report("convert", src, dst, started, summary["bytes"], summary["bytes_read"]), "plan": summary}


def _write_ckpt(src: str | Path, dst: str | Path, index: CheckpointIndex, casts: dict, cast_to: Any, *,
                crc: bool, force: bool, max_memory: int | None, progress, sync: bool) -> dict:
    """A MindSpore `.ckpt`, streamed: peak memory is one tile (`max_memory`). Zero-element tensors
    are left out (MindSpore's format drops them); str/int/float/bool values become `str` entries and
    0-d tensors, anything else is left out; both are listed in the report's `skipped`."""
    import time

    import numpy as np

    from hpckpt.core import dtypes, engine
    from hpckpt.core.mindspore_ckpt import CkptWriter
    from hpckpt.core.plan import plan_whole_tensors
    from hpckpt.core.read import OpenFiles
    from hpckpt.core.staging import refuse_existing

    started = time.perf_counter()
    dst = Path(dst)
    refuse_existing(dst, force)
    dst.parent.mkdir(parents=True, exist_ok=True)
    (target,) = plan_whole_tensors(index, list(index.tensors), cast_to=cast_to, casts=casts or None)
    written = target.nbytes
    if progress is not None:
        progress.start(written)
    advance = progress.advance if progress is not None else (lambda n: None)
    scalars = {bool: "bool", int: "int64", float: "float32"}
    skipped: list[str] = []
    with CkptWriter(dst, crc=crc, sync=sync) as writer, OpenFiles() as files:
        copier = engine.TileCopier(index, files, -1, max_memory or engine.DEFAULT_MAX_MEMORY, advance, writeback=sync)
        for t in target.tensors:
            if not writer.begin_tensor(t.key, t.dtype, t.box.sizes):
                continue
            if writer.can_place():  # kernel copies straight into the file
                writer.write_in_place(lambda fd, offset, t=t: copier.write(t, offset, fd))
            else:
                for piece in copier.buffers(t):
                    writer.write(piece)
            writer.end_tensor()
        for fqn in index.values:
            value = index.decode_value(fqn)
            if isinstance(value, str):
                writer.add_string(fqn, value)
            elif type(value) in scalars:
                dtype = dtypes.dtype(scalars[type(value)])
                writer.add_tensor(fqn, dtype, (), np.array(value, dtype=dtype.np).tobytes())
            else:
                skipped.append(fqn)
    skipped = sorted(set(writer.skipped) | set(skipped))
    return {**_run_report("convert", src, dst, started, written, written), "skipped": skipped}


_KEEP_KIND = {"hyperparallel": "hp", "hyperparallel-legacy": "hp", "torch-dcp": "torch-dcp", "hf-sharded": "hf",
              "safetensors": "safetensors", "mindspore-ckpt": "pt", "torch-save": "ms"}


def ms_torch_plan(src: str | Path, dst: str | Path, *, to: str | None = None, to_format: str | None = None,
                  index: CheckpointIndex | None = None) -> dict:
    """Direction and container of `convert-ms-torch`: the other framework than the source's, and
    the source's kind of container unless `to_format` or the destination's extension says
    otherwise (a PyTorch DCP going to MindSpore becomes a HyperParallel DCP, which MindSpore reads).

    `index` is the source's, when the caller has opened it already (it is then not read again).

    Raises:
        UnknownFormatError: the source's framework cannot be told and `to` is not given.
    """
    from hpckpt.core.errors import UnknownFormatError
    from hpckpt.core.names import detect_direction

    index = index if index is not None else open_index(src)
    if to is None:
        side = index.framework
        if side is None:
            direction = detect_direction(list(index.tensors) + list(index.values))
            side = {"ms-to-torch": "mindspore", "torch-to-ms": "torch"}.get(direction or "")
        if side is None:
            raise UnknownFormatError(f"{src}: cannot tell whether MindSpore or PyTorch wrote it",
                                     hint="pass --to torch or --to mindspore")
        to = "torch" if side == "mindspore" else "mindspore"
    fmt = to_format or target_from_extension(dst) or _KEEP_KIND.get(index.format, "safetensors")
    if fmt == "torch-dcp" and to == "mindspore":
        fmt = "hp"
    if fmt == "ms" and to == "torch" or fmt == "pt" and to == "mindspore":
        fmt = "safetensors" if to_format is None else fmt
    return {"to": to, "format": fmt, "source_format": index.format}
