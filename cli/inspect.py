"""`hpckpt inspect PATH`: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from hpckpt.cli._errors import handles_errors

EXAMPLES = """Examples:

  hpckpt inspect ckpt/                          summary, tensors and values
  hpckpt inspect ckpt/ --include 'model.*'      only the model
  hpckpt inspect ckpt/ --shards '*embed*'       chunk boxes per rank and file
  hpckpt inspect ckpt/ --json | jq .counts      one JSON document (schema in the README)
"""


@handles_errors
def inspect(
    path: Path = typer.Argument(..., help="Checkpoint directory or file (format is detected)."),
    include: Optional[List[str]] = typer.Option(None, "--include", "-i", metavar="GLOB", help="Only entries whose name matches (repeatable)."),
    exclude: Optional[List[str]] = typer.Option(None, "--exclude", "-x", metavar="GLOB", help="Leave out entries whose name matches (repeatable)."),
    shards: Optional[List[str]] = typer.Option(None, "--shards", "-s", metavar="GLOB", help="Show the chunk boxes of matching tensors per rank and file."),
    no_values: bool = typer.Option(False, "--no-values", help="Do not read and decode non-tensor values."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON document instead of tables."),
) -> None:
    """Show the format, world size, files, tensors (dtype, shape, chunks) and values of a checkpoint."""
    from hpckpt import api

    document = api.inspect(path, include or (), exclude or (), shards or (), decode_values=not no_values)
    if json_output:
        from hpckpt.cli._output import emit_json

        emit_json(document)
    else:
        render(document)



def render(doc: dict) -> None:
    from rich.table import Table

    from hpckpt.cli._output import human_bytes, stdout_console

    console = stdout_console()
    counts = doc["counts"]
    framework = f" (written by {doc['framework']})" if doc["framework"] else ""
    world = doc["world_size"]
    n_meta = sum(1 for f in doc["files"] if f["path"].endswith(("metadata", ".json")))
    summary = Table.grid(padding=(0, 2))
    summary.add_row("Checkpoint", doc["path"])
    summary.add_row("Format", f"{doc['format']} {doc['format_version']}{framework}")
    summary.add_row("World size", f"{world} (from file names; ranks without data write no file)" if world else "-")
    summary.add_row("Files", f"{len(doc['files'])} ({n_meta} metadata, {len(doc['files']) - n_meta} data), {human_bytes(doc['total_bytes'])}")
    summary.add_row("Tensors", f"{counts['tensors']} in {counts['chunks']} chunks, {human_bytes(counts['tensor_bytes'])}")
    summary.add_row("Values", str(counts["values"]))
    console.print(summary)

    if doc["tensors"]:
        table = Table(title="Tensors", title_justify="left", show_edge=False, pad_edge=False)
        for name, justify in (("name", "left"), ("dtype", "left"), ("shape", "left"), ("chunks", "right"), ("size", "right")):
            table.add_column(name, justify=justify, no_wrap=name != "name", overflow="fold")
        for t in doc["tensors"]:
            table.add_row(t["fqn"], t["dtype"], _shape(t["shape"]), str(t["chunks"]), human_bytes(t["bytes"]))
        console.print()
        console.print(table)

    if doc["values"]:
        table = Table(title="Values", title_justify="left", show_edge=False, pad_edge=False)
        table.add_column("name", overflow="fold")
        table.add_column("type")
        table.add_column("value", overflow="fold", max_width=80)
        for v in doc["values"]:
            shown = f"[red]{v['error']}[/red]" if "error" in v else _short(v.get("value"))
            table.add_row(v["fqn"], v.get("type") or "?", shown)
        console.print()
        console.print(table)

    for shard in doc.get("shards", []):
        table = Table(title=f"Chunks of {shard['fqn']}", title_justify="left", show_edge=False, pad_edge=False)
        for name in ("#", "offsets", "sizes", "rank", "file", "key"):
            table.add_column(name, overflow="fold")
        for i, c in enumerate(shard["chunks"]):
            rank = "-" if c["rank"] is None else str(c["rank"])
            table.add_row(str(i), _shape(c["offsets"]), _shape(c["sizes"]), rank, c["file"], c["key"])
        console.print()
        console.print(table)


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _short(value: object) -> str:
    from rich.markup import escape

    text = repr(value) if not isinstance(value, str) else repr(value)
    return escape(text if len(text) <= 60 else text[:57] + "...")
