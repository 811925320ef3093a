"""`hpckpt diff A B`: two checkpoints of any formats compared entry by entry, streaming."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hpckpt.cli import _options as opt
from hpckpt.cli._errors import handles_errors, location
from hpckpt.cli._option_groups import Select, expand_options

EXAMPLES = """Examples:

  hpckpt diff ckpt/ ckpt-64/                              after a reshard: bit-identical?
  hpckpt diff ckpt/ model.safetensors --allow-dtype --atol 1e-2   after a cast to bf16
  hpckpt diff net.ckpt model.pt --names ms-to-torch       across frameworks, names mapped
  hpckpt diff a/ b/ --include 'model.*' --json
"""

DIFFER = 25  # exit code: the checkpoints differ (beyond the tolerances)


@handles_errors
@expand_options
def diff(
    a: Annotated[Path, typer.Argument(parser=location, help="First checkpoint (any format hpckpt reads).")],
    b: Annotated[Path, typer.Argument(parser=location, help="Second checkpoint (any format hpckpt reads).")],
    names: Annotated[Optional[str], typer.Option(
        "--names", help="Rename A's entries to B's first: a preset (ms-to-torch, torch-to-ms, torch-to-ms-adamw) "
                        "or a TOML rules file.")] = None,
    atol: Annotated[float, typer.Option("--atol", min=0.0, help="Absolute tolerance per element.")] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", min=0.0, help="Relative tolerance per element (of B's value).")] = 0.0,
    allow_dtype: Annotated[bool, typer.Option("--allow-dtype", help="A dtype change alone is no difference.")] = False,
    select: Select = Select(),
    max_memory: opt.MaxMemory = "64MiB",
    html: Annotated[Optional[Path], typer.Option(
        "--html", metavar="FILE", help="Also write a self-contained page: per tensor, where the two differ "
        "(blocks coloured by error, numbers on hover).")] = None,
) -> None:
    """Compare two checkpoints entry by entry; exit 0 when equal within the tolerances, 25 when not."""
    from hpckpt import api
    from hpckpt.api.diff import diff as compare
    from hpckpt.cli import _output
    from hpckpt.cli._progress import TerminalProgress
    from hpckpt.cli.convert import name_rules

    rules = None
    if names is not None:
        is_file = names.endswith(".toml") or Path(names).is_file()
        rules = name_rules(Path(names), None, None) if is_file else name_rules(None, names, None)
    with TerminalProgress("diff") as progress:
        progress.phase(f"comparing {a} and {b}")
        report = compare(a, b, names=rules, select=select.selection(), atol=atol, rtol=rtol,
                         allow_dtype=allow_dtype, max_memory=api.parse_size(max_memory), progress=progress,
                         grids=html is not None)
    doc = report.to_json()
    if html is not None:
        doc["html"] = {"path": str(html), "bytes": _write_page(html, report, doc)}
    if _output.json_mode():
        _output.emit_json(doc)
    else:
        render(doc)
        if html is not None:
            _output.result_line(f"wrote {html} ({_output.human_bytes(doc['html']['bytes'])})")
    raise typer.Exit(0 if doc["equal"] else DIFFER)


def _number(x) -> str:
    return x if isinstance(x, str) else f"{x:.3g}"


def _write_page(path: Path, report, doc: dict) -> int:
    """The diff's page (`cli/html/diff.js`): every compared tensor with its error blocks."""
    from hpckpt.cli.html import write_page

    tensors = [[t.name, t.status, t.dtype_a, t.dtype_b, list(t.shape_a), t.differing, j["max_abs"], j["max_rel"],
                t.grid.to_json() if t.grid is not None else None]
               for t, j in zip(report.tensors, doc["tensors"])]
    counts = ", ".join(f"{n} {status}" for status, n in sorted(doc["counts"].items()))
    meta = {"title": f"{doc['a']} vs {doc['b']}: {'equal' if doc['equal'] else 'DIFFERENT'}",
            "facts": [f"{doc['format'][0]} vs {doc['format'][1]}", counts or "no tensor in common",
                      f"atol {doc['atol']}, rtol {doc['rtol']}", f"only in A: {len(doc['only_a'])}, only in B: "
                      f"{len(doc['only_b'])}"],
            "selected": next((t[0] for t in tensors if t[1] in ("differ", "shape")), "")}
    document = {"kind": "diff", "meta": meta, "tensors": tensors, "only_a": doc["only_a"], "only_b": doc["only_b"],
                "values": doc["values"]}
    return write_page(path, meta["title"], "diff.js", document)


def render(doc: dict) -> None:
    from hpckpt.cli._output import result_line
    from hpckpt.cli._tables import write_table

    changed = [t for t in doc["tensors"] if t["dtype"][0] != t["dtype"][1]]
    shown = [t for t in doc["tensors"] if t["status"] in ("differ", "shape")
             or (t["dtype"][0] != t["dtype"][1] and not doc["allow_dtype"])]
    if shown:
        write_table("Tensors that differ",
                    [("name", "left"), ("status", "left"), ("dtype", "left"), ("shape", "left"),
                     ("differing", "right"), ("max abs", "right"), ("max rel", "right")],
                    [(t["name"], t["status"], " -> ".join(dict.fromkeys(t["dtype"])),
                      " vs ".join(dict.fromkeys(str(s) for s in t["shape"])),
                      f"{t['differing']} of {t['elements']}", _number(t["max_abs"]), _number(t["max_rel"]))
                     for t in shown])
    values = [v for v in doc["values"] if not v["equal"]]
    if values:
        write_table("Values that differ", [("name", "left"), ("A", "left"), ("B", "left")],
                    [(v["name"], v["a"], v["b"]) for v in values])
    for side, key in (("A", "only_a"), ("B", "only_b")):
        if doc[key]:
            write_table(f"Only in {side}", [("name", "left")], [(n,) for n in doc[key]])
    counts = doc["counts"]
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no tensors in common"
    tolerance = f" (atol {doc['atol']:g}, rtol {doc['rtol']:g})" if doc["atol"] or doc["rtol"] else ""
    verdict = "equal" if doc["equal"] else "DIFFERENT"
    if changed:
        summary += f" ({len(changed)} in another dtype{', allowed' if doc['allow_dtype'] else ''})"
    result_line(f"{verdict}{tolerance}: {summary}; {len(doc['values'])} values, "
                f"{sum(not v['equal'] for v in doc['values'])} differ; only in A: {len(doc['only_a'])}, "
                f"only in B: {len(doc['only_b'])}")
