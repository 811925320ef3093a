"""`hpckpt inspect PATH`: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import expand_options

EXAMPLES = """Examples:

  hpckpt inspect ckpt/                          summary, tensors and values
  hpckpt inspect ckpt/ --summary                counts by dtype and layout, ranks grouped
  hpckpt inspect ckpt/ --map '*embed*'          a tensor's boxes as a grid coloured by rank
  hpckpt inspect ckpt/ --html map.html          the shard map as a page for a browser
  hpckpt inspect ckpt/ --include 'model.*'      only the model
  hpckpt inspect ckpt/ --shards '*embed*'       chunk boxes per rank and file
  hpckpt inspect ckpt/ --json | jq .counts      one JSON document (docs/commands.md)
"""


@handles_errors
@expand_options
def inspect(
    path: Path = typer.Argument(..., parser=location, help="Checkpoint directory or file (format is detected)."),
    include: Optional[List[str]] = typer.Option(None, "--include", "-i", metavar="GLOB", help="Only entries whose name matches (repeatable)."),
    exclude: Optional[List[str]] = typer.Option(None, "--exclude", "-x", metavar="GLOB", help="Leave out entries whose name matches (repeatable)."),
    shards: Optional[List[str]] = typer.Option(None, "--shards", "-s", metavar="GLOB", help="Show the chunk boxes of matching tensors per rank and file."),
    no_values: bool = typer.Option(False, "--no-values", help="Do not read and decode non-tensor values."),
    summary: bool = typer.Option(False, "--summary", help="Counts, bytes, dtypes, layouts and one line per group "
                                 "of ranks that store alike; no line per tensor or value."),
    map_names: Optional[List[str]] = typer.Option(None, "--map", "-m", metavar="NAME", help="Draw the stored boxes of "
                                                  "this tensor (a glob: the first 8 matches) as a grid coloured by rank."),
    html: Optional[Path] = typer.Option(None, "--html", metavar="FILE", help="Also write a self-contained HTML page: "
                                        "the shard map of every tensor, searchable, and the bytes of every rank."),
) -> None:
    """Show the format, world size, files, tensors (dtype, shape, chunks) and values of a checkpoint."""
    from hpckpt import api
    from hpckpt.cli import _output
    from hpckpt.cli._progress import TerminalProgress
    from hpckpt.converters import open_index

    select = api.Selection.of(include, exclude)
    with TerminalProgress("inspect") as progress:
        progress.phase(f"reading metadata of {path}")
        index = open_index(path, use_cache=True)
        report = api.inspect(path, select, shards or (), decode_values=not no_values,
                             summary_only=summary or bool(map_names), index=index)
        doc = report.to_json()
        if html is not None:
            progress.phase(f"writing {html}")
            size = _write_html(html, index, doc, select, (map_names or [None])[0])
    if _output.json_mode():
        if html is not None:
            doc["html"] = {"path": str(html), "bytes": size}
        _output.emit_json(doc)
        return
    render(doc)
    if map_names:
        from hpckpt.cli.shard_map_text import draw

        draw(index, map_names)
    if html is not None:
        _output.result_line(f"wrote {html} ({_output.human_bytes(size)})")


def _write_html(path: Path, index, doc: dict, select, selected: str | None) -> int:
    """The shard map page of the selected tensors (`cli.html`, `shard_map.js`)."""
    from hpckpt.api.shard_map import shard_map
    from hpckpt.cli.html import map_document, write_page

    data = shard_map(index, select.names(index.tensors))
    world = doc["world_size"]
    meta = {"title": f"{doc['path']}: shard map",
            "facts": [f"{doc['format']} {doc['format_version']}", f"world size {world or '-'}",
                      f"{doc['counts']['tensors']} tensors in {doc['counts']['chunks']} chunks",
                      f"{doc['counts']['values']} values"],
            "selected": selected or ""}
    document = {"kind": "inspect", "meta": meta, "maps": [map_document(data)]}
    return write_page(path, meta["title"], "shard_map.js", document)


def render(doc: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    from hpckpt.cli._output import human_bytes, printable, stdout_console
    from hpckpt.cli._tables import write_table

    console = stdout_console()
    counts = doc["counts"]
    if doc.get("written_by"):  # hpckpt wrote it, spelling dtypes as a framework does
        framework = f" (written by {doc['written_by']}" + (f", {doc['framework']} dtypes)" if doc["framework"] else ")")
    else:
        framework = f" (written by {doc['framework']})" if doc["framework"] else ""
    world = doc["world_size"]
    n_meta = sum(1 for f in doc["files"] if f.get("kind") == "metadata")
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_row("Checkpoint", Text(printable(doc["path"])))
    summary.add_row("Format", Text(printable(f"{doc['format']} {doc['format_version']}{framework}")))
    if doc.get("based_on"):  # an incremental save: files of these checkpoints are read too
        summary.add_row("Based on", Text(printable(", ".join(doc["based_on"]))))
    summary.add_row("World size", _world_size(world, doc.get("world_size_exact", False)))
    summary.add_row("Files", f"{len(doc['files'])} ({n_meta} metadata, {len(doc['files']) - n_meta} data), {human_bytes(doc['total_bytes'])}")
    summary.add_row("Tensors", f"{counts['tensors']} in {counts['chunks']} chunks, {human_bytes(counts['tensor_bytes'])}")
    summary.add_row("Values", str(counts["values"]))
    for note in doc.get("notes", []):  # plain text: a note quotes names from the checkpoint
        summary.add_row("Note", Text(printable(note)))
    console.print(summary)
    console.file.flush()
    if doc.get("summary") and not doc["tensors"] and not doc["values"]:  # --summary
        _render_summary(doc["summary"])

    if doc["tensors"]:
        write_table(
            f"Tensors ({len(doc['tensors'])})",
            [("name", "left"), ("dtype", "left"), ("shape", "left"), ("layout", "left"), ("chunks", "right"), ("size", "right")],
            [(t["fqn"], t["dtype"], _shape(t["shape"]), t["layout"], str(t["chunks"]), human_bytes(t["bytes"]))
             for t in doc["tensors"]],
        )
    if doc["values"]:
        write_table(
            f"Values ({len(doc['values'])})",
            [("name", "left"), ("type", "left"), ("value", "left")],
            [(v["fqn"], v.get("type") or "?", f"error: {v['error']}" if "error" in v else _short(v.get("value")))
             for v in doc["values"]],
        )
    for shard in doc.get("shards", []):
        write_table(
            f"Chunks of {shard['fqn']} ({len(shard['chunks'])})",
            [("#", "right"), ("offsets", "left"), ("sizes", "left"), ("rank", "right"), ("file", "left"), ("key", "left")],
            [(str(i), _shape(c["offsets"]), _shape(c["sizes"]), "-" if c["rank"] is None else str(c["rank"]), c["file"], c["key"])
             for i, c in enumerate(shard["chunks"])],
        )


def _render_summary(summary: dict) -> None:
    from hpckpt.cli._output import human_bytes
    from hpckpt.cli._tables import write_table

    for key, title in (("dtypes", "dtype"), ("layouts", "layout")):
        write_table(f"By {title}", [(title, "left"), ("tensors", "right"), ("size", "right")],
                    [(row[title], str(row["tensors"]), human_bytes(row["bytes"])) for row in summary[key]])
    write_table("Ranks (grouped by what each stores)",
                [("ranks", "left"), ("count", "right"), ("data files each", "right"), ("on disk each", "right")],
                [(g["ranks"], str(g["count"]), str(g["files"]), human_bytes(g["bytes"])) for g in summary["rank_groups"]])


def _world_size(world: int | None, exact: bool) -> str:
    """Exact when hpckpt's writer recorded it; else a lower bound: a rank without data writes no file."""
    if not world:
        return "-"
    if exact:
        return f"{world} (recorded by the writer)"
    return f"at least {world} (from file names; ranks without data write no file)"


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
