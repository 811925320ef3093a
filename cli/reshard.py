"""`hpckpt reshard SRC -o DST`: a new world size or parallel layout, streamed in bounded memory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import ParallelWrite, Select, TargetLayout, expand_options

EXAMPLES = """Examples:

  hpckpt reshard ckpt/ -o ckpt-64/ --world-size 64           FSDP-style: dim 0 over 64 ranks
  hpckpt reshard ckpt/ -o out/ --mesh 2x4 --placements R,S0  HSDP: replicate x shard
  hpckpt reshard ckpt/ -o out/ --mesh 2x4 --layout-rules tp.toml   per-tensor placements
  hpckpt reshard ckpt/ -o out/ --layout-file rank0.layout --layout-file rank1.layout
  hpckpt reshard ckpt/ -o out/ --mesh 2x8 --keep-layout      same layouts, new mesh size
  hpckpt reshard ckpt/ -o out/ --world-size 64 --plan        what each rank reads and writes
  hpckpt reshard ckpt/ -o mf/iteration_00000100 --to mindformers --world-size 8   (tracker in mf/)
  hpckpt reshard ckpt/ -o out/ --world-size 64 --rank 0-15   this machine's share (fan-out)
  hpckpt reshard --finalize out/                             metadata, once every share is done
"""


@handles_errors
@expand_options
def reshard(
    src: Annotated[Optional[Path], typer.Argument(
        parser=location, help="Source checkpoint (any format hpckpt reads); with --finalize, the destination.")] = None,
    out: Annotated[Optional[Path], typer.Option("--output", "-o", parser=location, help="Destination directory.")] = None,
    to: Annotated[opt.LayoutFormatName, typer.Option(
        "--to", "-t", help="The destination's format: hyperparallel (hp), torch-dcp or mindformers (mf).")] = "hyperparallel",
    layout: TargetLayout = TargetLayout(),
    rank: Annotated[Optional[List[str]], typer.Option(
        "--rank", "-r", metavar="R", help="Write only these target ranks (e.g. 3, 0-7); repeatable.")] = None,
    finalize: Annotated[bool, typer.Option("--finalize", help="Write the metadata of a fanned-out reshard.")] = False,
    select: Select = Select(),
    dtype: opt.DType = None,
    framework: opt.Framework = None,
    keep_replicas: opt.KeepReplicas = False,
    write: ParallelWrite = ParallelWrite(),
    dry_run: Annotated[bool, typer.Option(
        "--plan", "--dry-run", help="Print what each target rank reads and writes; copy nothing.")] = False,
    html: Annotated[Optional[Path], typer.Option(
        "--html", metavar="FILE", help="With --plan: also write the plan as a self-contained page (source and "
        "target shard maps side by side, what each target rank writes, reads and opens).")] = None,
    bandwidth: Annotated[Optional[str], typer.Option(
        "--bandwidth", metavar="READ,WRITE", help="The source's read and the destination's write speed per second "
        "for the predicted time (e.g. 2GiB,1GiB); default: measured by a short probe, cached per file system.")] = None,
) -> None:
    """Reshard a checkpoint to a new world size or layout (output: HyperParallel DCP, or --to's format)."""
    from hpckpt import api
    from hpckpt.cli import _output, _targets
    from hpckpt.cli._progress import TerminalProgress

    if html is not None and not dry_run:
        raise typer.BadParameter("--html goes with --plan (the plan's page)", param_hint="--html")
    speeds = _bandwidth_option(bandwidth)
    if finalize:
        if src is None:
            raise typer.BadParameter("--finalize needs the destination directory")
        report = api.finalize(src)
    else:
        if src is None or out is None:
            raise typer.BadParameter("give SRC and -o DST")
        from hpckpt.core.commit.lock import reading

        with TerminalProgress("reshard") as progress, reading(src):  # before its metadata is read
            try:
                ranks = _targets.parse_ranks(rank)
                settings = write.settings(progress)
                layout.check()
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
            index = _targets.open_source(src, progress)
            try:
                spec = layout.spec(index)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
            report = api.reshard(src, out, spec, select=select.selection(), ranks=ranks,
                                 framework=framework, dtype=dtype, settings=settings, dry_run=dry_run, index=index,
                                 to=to, keep_replicas=keep_replicas)
            prediction = _predicted(src, out, index, report, speeds, sync=settings.sync, probe=dry_run)
            if html is not None:
                progress.phase(f"writing {html}")
                page = {"path": str(html), "bytes": _write_plan_page(
                    html, src, index, spec, to, dtype, keep_replicas, select.selection(), report, prediction)}
    _output.warn_skipped(report)
    extra = {"prediction": prediction} if not finalize and prediction is not None else {}
    if html is not None:
        extra["html"] = page
    if _output.json_mode():
        _output.emit_json({**report.to_json(), **extra})
    else:
        render(report, extra.get("prediction"))
        if html is not None:
            _output.result_line(f"wrote {html} ({_output.human_bytes(page['bytes'])})")


def _bandwidth_option(text: Optional[str]):
    """`--bandwidth READ,WRITE` as an `api.predict.Bandwidth` (None when not given)."""
    if text is None:
        return None
    from hpckpt.api.predict import Bandwidth
    from hpckpt.core.sizes import parse_rate

    parts = text.split(",")
    try:
        read, write = (parse_rate(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        read = write = None
    if not read or not write:
        raise typer.BadParameter(f"{text!r}: give the read and the write speed per second, e.g. 2GiB,1GiB",
                                 param_hint="--bandwidth")
    return Bandwidth(float(read), float(write))


def _predicted(src, out, index, report, speeds, *, sync: bool, probe: bool) -> dict | None:
    """The plan timed (`api.predict`): with the speeds given, else measured (a dry run probes;
    a real run uses only what is cached, and then shows predicted beside measured)."""
    from hpckpt.api.predict import measure, predict

    if "plan" not in report or report["plan"] is None:
        return None
    speeds = speeds or measure(src, out, index, sync=sync, probe=probe)
    if speeds is None:
        return None
    found = predict(report["plan"], speeds)
    if not report["dry_run"]:
        found["measured_seconds"] = round(report["seconds"], 4)
    return found


def _write_plan_page(path: Path, src, index, spec, to: str, dtype, keep_replicas: bool, selection, report,
                     prediction: dict | None = None) -> int:
    """The plan's page (`api.plan_view`, drawn by `cli/html/shard_map.js`)."""
    from hpckpt.api.plan_view import plan_view
    from hpckpt.api.reshard import reshard_target
    from hpckpt.cli.html import write_plan_page

    target = reshard_target(to, spec, dtype=dtype, keep_replicas=keep_replicas)
    names = None if selection.everything else selection.names([*index.tensors, *index.values])
    return write_plan_page(path, src, report["destination"], index.format, report["format"],
                           plan_view(index, target, names, planned=report.planned), prediction)


def _per_file(prediction: dict) -> str:
    per_file = prediction.get("write_seconds_per_file", 0)
    return f" + {per_file * 1e3:.1f} ms per file" if per_file else ""


def render(report, prediction: dict | None = None) -> None:
    from hpckpt.cli._output import human_bytes, rate, result_line
    from hpckpt.cli._tables import write_table

    if "plan" not in report:
        result_line(f"Finalized {report['destination']}: {report['files']} files, metadata written")
        return
    plan = report["plan"]
    if report["dry_run"]:
        seconds = {r["rank"]: r["seconds"] for r in (prediction or {}).get("ranks", [])}
        write_table(
            f"Plan: {report['source']} -> {report['destination']} ({plan['world_size']} ranks)",
            [("rank", "right"), ("writes", "right"), ("reads", "right"), ("source files", "right"),
             ("predicted s", "right")],
            [(str(r["rank"]), human_bytes(r["bytes_written"]), human_bytes(r["bytes_read"]), str(r["source_files"]),
              f"{seconds[r['rank']]:.2f}" if r["rank"] in seconds else "-") for r in plan["ranks"]],
        )
        amplification = plan["bytes_read"] / plan["bytes"] if plan["bytes"] else 0
        print(f"\nTotal: writes {human_bytes(plan['bytes'])} in {plan['files']} files, reads "
              f"{human_bytes(plan['bytes_read'])} (read amplification {amplification:.2f})")
        if prediction:
            print(f"Predicted: {prediction['seconds']:.2f} s (reads at {human_bytes(prediction['read_bytes_per_s'])}/s, "
                  f"{prediction['read_from']}; writes at {human_bytes(prediction['write_bytes_per_s'])}/s"
                  f"{_per_file(prediction)}, {prediction['write_from']})")
        return
    state = "written" if report["finalized"] else "written (fan-out share; run `hpckpt reshard --finalize` when all are done)"
    predicted = f"; predicted {prediction['seconds']:.2f} s" if prediction else ""
    result_line(f"{report['destination']}: {plan['world_size']} ranks, {plan['files']} files, "
                f"{human_bytes(report['bytes_written'])} {state} in {report['seconds']:.2f} s "
                f"({rate(report)}{predicted})")
