"""Nothing lost silently: every entry of a write is written, skipped with its reason, or the run fails.

Every writing command passes through `api.pipeline.write` and `core.io.write.write_plan`, and these
checks run there, so no format and no command can bypass them:

1. `check_plan` (pipeline): the plan holds every entry the command asked for (tensors and values);
2. `check_layout`: before a byte is copied, the writer placed every planned box of the ranks
   this run writes, each once and with its size, for every tensor it did not report as skipped;
3. `check_written`: before the output is committed, its metadata read back by the format's own
   hpckpt reader lists every entry that was not skipped, in its kind (a tensor as a tensor of the
   planned dtype and shape, a value as a value, unless the writer reported it `converted`), and
   nothing else. A dict value of a nested format (torch.save) reads back as its leaves
   (`cfg` as `cfg.hidden`, `cfg.layers`): that is the same value, not a loss.

A failure is a bug in hpckpt or in a writer, never the user's: it is an internal error (exit 1)
naming the entries, raised before the destination exists.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from hpckpt.core.errors import AccountingError
from hpckpt.core.geometry.plan import Plan
from hpckpt.core.index import CheckpointIndex
from hpckpt.core.io.output import OutputLayout


def _names(fqns: Iterable[str], limit: int = 5) -> str:
    fqns = sorted(fqns)
    shown = ", ".join(repr(f) for f in fqns[:limit])
    return shown + (f" and {len(fqns) - limit} more" if len(fqns) > limit else "")


def check_plan(plan: Plan, tensors: Iterable[str], values: Iterable[str]) -> None:
    """The plan carries every requested tensor and value."""
    missing = (set(tensors) - {t.fqn for t in plan.tensors}) | (set(values) - {v.fqn for v in plan.values})
    if missing:
        raise AccountingError(f"{len(missing)} entries would be lost (not in the plan): {_names(missing)}")


def check_source_chunks(plan: Plan, source: CheckpointIndex) -> None:
    """Before anything is written (or space is asked for), the stored chunks of every planned
    tensor are read as boxes and lie inside their tensor: a corrupt shape is reported as what it
    is, not as the terabytes it would take to write. The arrays are built again by the engine,
    tensor by tensor: a little time, where keeping them would hold much memory (docs/design-figures.md).

    Raises:
        CorruptMetadataError: a chunk's offsets or sizes do not fit the tensor's dims.
        GeometryError: a chunk lies outside its tensor.
    """
    from hpckpt.core.geometry.overlap import check_inside

    for tensor in plan.tensors:
        entry = source.tensors[tensor.fqn]
        offsets, sizes = entry.chunk_arrays()
        check_inside(tensor.fqn, tuple(entry.shape), offsets, sizes)


def check_layout(plan: Plan, layout: OutputLayout) -> None:
    """Every planned box of a producing rank is placed once, with its size, unless its tensor is skipped."""
    skipped = {fqn for fqn, _ in layout.skipped}
    placed = Counter((p.tensor.fqn, p.box.index) for f in layout.files for p in f.boxes)
    sizes = {(p.tensor.fqn, p.box.index): p.nbytes for f in layout.files for p in f.boxes}
    producing = set(plan.producing)
    wrong: set[str] = set()
    for tensor in plan.tensors:
        if tensor.fqn in skipped:
            continue
        for box in tensor.boxes:
            if box.rank not in producing:
                continue
            key = (tensor.fqn, box.index)
            if placed.get(key) != 1 or sizes[key] != tensor.box_nbytes(box):
                wrong.add(tensor.fqn)
    if wrong:
        raise AccountingError(f"the writer did not place every box of {len(wrong)} tensors: {_names(wrong)}")


def _leaves_by_parent(names: set[str], parents: set[str]) -> dict[str, list[str]]:
    """The read-back value names that are leaves of a planned value (`cfg.hidden` of `cfg`)."""
    out: dict[str, list[str]] = {}
    for name in names - parents:
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:cut])
            if parent in parents:
                out.setdefault(parent, []).append(name)
                break
    return out


def check_written(plan: Plan, layout: OutputLayout, written: CheckpointIndex) -> None:
    """The output's own metadata lists every entry that was not skipped, in its kind, and no other."""
    skipped = {fqn for fqn, _ in layout.skipped}
    converted = {fqn for fqn, _ in layout.converted}
    problems: list[str] = []
    leaves = _leaves_by_parent(set(written.values), {v.fqn for v in plan.values})
    for tensor in plan.tensors:
        if tensor.fqn in skipped:
            continue
        got = written.tensors.get(tensor.fqn)
        if got is None:
            problems.append(f"tensor {tensor.fqn!r} is missing")
        elif got.dtype != tensor.dtype or tuple(got.shape) != tuple(tensor.shape):
            problems.append(f"tensor {tensor.fqn!r} reads back as {got.dtype} {list(got.shape)}, "
                            f"not {tensor.dtype} {list(tensor.shape)}")
    for value in plan.values:
        if value.fqn in skipped:
            continue
        if value.fqn in converted:
            if value.fqn not in written.tensors and value.fqn not in written.values:
                problems.append(f"converted value {value.fqn!r} is missing")
        elif value.fqn not in written.values and value.fqn not in leaves:
            kind = "a tensor" if value.fqn in written.tensors else "missing"
            problems.append(f"value {value.fqn!r} is {kind}")
    expected = {t.fqn for t in plan.tensors} | {v.fqn for v in plan.values}
    extra = (set(written.tensors) | set(written.values)) - expected - {n for ns in leaves.values() for n in ns}
    if extra:
        problems.append(f"entries that were not planned: {_names(extra)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise AccountingError(f"the {written.format} output does not hold what was planned: "
                              f"{'; '.join(problems[:3])}{more}")
