"""`diff`: two checkpoints of any formats compared entry by entry, in bounded memory.

What a user runs after a conversion, to see that it changed nothing but what was asked. Tensors
are read a block of rows at a time from both sides (at most `max_memory` of float64 values
each); a block whose bytes are equal needs no arithmetic. Values are decoded by the safe
unpickler and compared by type and value (a tuple is not a list).

Within the tolerances means, per element, `|a - b| <= atol + rtol * |b|`, NaN against NaN and
the same infinity counting as equal (numpy's `isclose` with `equal_nan`). Integer and bool
tensors are compared exactly as integers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.api.convert import rename
from hpckpt.api.options import Selection
from hpckpt.api.reports import envelope
from hpckpt.converters import open_index
from hpckpt.core.commit.lock import reading
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.overlap import check_inside
from hpckpt.core.index import CheckpointIndex, TensorEntry
from hpckpt.core.view import renamed_view
from hpckpt.core.io.cast import to_float32
from hpckpt.core.io.read import OpenFiles, read_box
from hpckpt.core.safety.validate import refuse_interrupted

DEFAULT_MAX_MEMORY = 64 * 1024 * 1024
GRID = 32  # cells per side of a tensor's error map (`diff --html`)


class ErrorGrid:
    """Where one tensor's two sides differ, reduced onto at most GRID x GRID cells: dim 0 down,
    the other dims (flattened, row-major) across; per cell the largest absolute and relative
    error and how many elements lie outside the tolerances. Filled block by block as the diff
    reads, so it costs no second read."""

    def __init__(self, shape: tuple[int, ...]):
        rows = shape[0] if shape else 1
        columns = math.prod(shape[1:]) if len(shape) > 1 else 1
        self.row_edges = np.unique(np.linspace(0, rows, min(GRID, rows) + 1).round().astype(np.int64))
        self.col_edges = np.unique(np.linspace(0, columns, min(GRID, columns) + 1).round().astype(np.int64))
        cells = (len(self.row_edges) - 1, len(self.col_edges) - 1)
        self.max_abs, self.max_rel = np.zeros(cells), np.zeros(cells)
        self.differing = np.zeros(cells, np.int64)

    def add(self, start: int, err: np.ndarray, rel: np.ndarray, outside: np.ndarray) -> None:
        """The errors of rows `start..` (arrays of the block's shape)."""
        n = err.shape[0] if err.ndim else 1
        cells = np.searchsorted(self.row_edges, np.arange(start, start + n), "right") - 1
        at = self.col_edges[:-1]
        for target, values, reduce in ((self.max_abs, err, np.maximum), (self.max_rel, rel, np.maximum),
                                       (self.differing, outside.astype(np.int64), np.add)):
            per_cell = reduce.reduceat(values.reshape(n, -1), at, axis=1)
            reduce.at(target, cells, per_cell)

    def to_json(self) -> dict:
        return {"row_edges": self.row_edges.tolist(), "col_edges": self.col_edges.tolist(),
                "max_abs": [[_finite(x) for x in row] for row in self.max_abs.tolist()],
                "max_rel": [[_finite(x) for x in row] for row in self.max_rel.tolist()],
                "differing": self.differing.tolist()}


@dataclass
class TensorDiff:
    """One tensor present on both sides. `status`: "identical" (same dtype, shape and bytes),
    "close" (within the tolerances), "differ", or "shape" (other shapes: values not compared)."""

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    status: str = "identical"
    elements: int = 0
    differing: int = 0  # elements outside the tolerances
    max_abs: float = 0.0
    max_rel: float = 0.0
    grid: ErrorGrid | None = None  # where they differ (`diff(..., grids=True)`), not in to_json

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "dtype": [self.dtype_a, self.dtype_b],
                "shape": [list(self.shape_a), list(self.shape_b)], "elements": self.elements,
                "differing": self.differing, "max_abs": _finite(self.max_abs), "max_rel": _finite(self.max_rel)}


@dataclass
class DiffReport:
    a: str
    b: str
    format_a: str
    format_b: str
    atol: float
    rtol: float
    allow_dtype: bool
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[dict] = field(default_factory=list)  # {"name", "equal", "a", "b"} (types and reprs)

    @property
    def equal(self) -> bool:
        if self.only_a or self.only_b or any(not v["equal"] for v in self.values):
            return False
        for t in self.tensors:
            if t.status in ("differ", "shape") or (t.dtype_a != t.dtype_b and not self.allow_dtype):
                return False
        return True

    def to_json(self) -> dict:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        # `ok`: the exit code is 0 (the checkpoints are equal within the tolerances), as verify's
        return {**envelope("diff", ok=self.equal),
                "a": self.a, "b": self.b, "format": [self.format_a, self.format_b], "equal": self.equal,
                "atol": self.atol, "rtol": self.rtol, "allow_dtype": self.allow_dtype,
                "only_a": self.only_a, "only_b": self.only_b, "counts": counts,
                "dtype_changed": [t.name for t in self.tensors if t.dtype_a != t.dtype_b],
                "tensors": [t.to_json() for t in self.tensors], "values": self.values}


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no inf or nan


def _bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def _values_of(raw: np.ndarray, entry: TensorEntry) -> np.ndarray:
    """Elements as numbers numpy can subtract: floats as float64, integers and bools as int64
    (raw bits of bfloat16 and float8 decoded)."""
    d = entry.dtype
    if d.is_floating:
        values = raw if d.is_exact_in_numpy else to_float32(raw.reshape(-1), d).reshape(raw.shape)
        return values.astype(np.float64, copy=False)
    if raw.dtype.kind in "iub":
        return raw.astype(np.int64, copy=False) if raw.dtype.kind != "u" or raw.dtype.itemsize < 8 else raw
    return raw


def _compare(name: str, ea: TensorEntry, eb: TensorEntry, ia: CheckpointIndex, ib: CheckpointIndex,
             fa: OpenFiles, fb: OpenFiles, atol: float, rtol: float, budget: int, grids: bool = False) -> TensorDiff:
    out = TensorDiff(name, ea.dtype.name, eb.dtype.name, tuple(ea.shape), tuple(eb.shape))
    if out.shape_a != out.shape_b:
        out.status = "shape"
        return out
    shape = out.shape_a
    out.elements = math.prod(shape)
    if out.elements == 0:
        return out
    same_dtype = ea.dtype.name == eb.dtype.name
    rows = shape[0] if shape else 1
    per_row = max(1, out.elements // rows) * 8  # float64 working copies dominate
    step = max(1, budget // (per_row * 8))  # the block, both sides, their differences and masks
    bitwise = same_dtype
    for start in range(0, rows, step):
        n = min(step, rows - start)
        box = Box((start, *(0,) * (len(shape) - 1)), (n, *shape[1:])) if shape else Box((), ())
        a, b = read_box(ia, ea, box, fa), read_box(ib, eb, box, fb)
        if same_dtype and np.array_equal(_bytes(a), _bytes(b)):
            continue
        bitwise = False
        va, vb = _values_of(a, ea), _values_of(b, eb)
        if va.dtype.kind == "f" or vb.dtype.kind == "f":
            va, vb = va.astype(np.float64, copy=False), vb.astype(np.float64, copy=False)
            with np.errstate(invalid="ignore", over="ignore"):
                close = np.isclose(va, vb, rtol=rtol, atol=atol, equal_nan=True)
                both = np.isfinite(va) & np.isfinite(vb)
                err = np.abs(va - vb, where=both, out=np.zeros_like(va))
                rel = np.divide(err, np.abs(vb), where=both & (vb != 0), out=np.zeros_like(va))
            mismatched_specials = ~both & ~close
            if mismatched_specials.any():
                out.max_abs = out.max_rel = math.inf
                err = np.where(mismatched_specials, np.inf, err)
                rel = np.where(mismatched_specials, np.inf, rel)
        else:
            err = np.abs(va - vb).astype(np.float64)
            close = err <= atol + rtol * np.abs(vb)
            rel = np.divide(err, np.abs(vb), where=vb != 0, out=np.zeros(err.shape))
        out.differing += int(close.size - np.count_nonzero(close))
        out.max_abs = max(out.max_abs, float(err.max(initial=0.0)))
        out.max_rel = max(out.max_rel, float(rel.max(initial=0.0)))
        if grids:
            if out.grid is None:
                out.grid = ErrorGrid(shape)
            out.grid.add(start, err, rel, ~close)
    if bitwise:
        out.status = "identical"
    else:
        out.status = "differ" if out.differing else "close"
    return out


def _value(index: CheckpointIndex, name: str) -> Any:
    return index.decode_value(name)


def _selected_b(index_a: CheckpointIndex, index_b: CheckpointIndex, view_a: CheckpointIndex, mapping: Any,
                select: Selection) -> CheckpointIndex:
    """B's entries the selection keeps: those A's kept entries are renamed to, whichever side's
    names the globs are written in, and B's others the globs keep by their own names (a B entry
    that some left-out A entry is renamed to stays out)."""
    kept = {*view_a.tensors, *view_a.values}
    of_a = set(mapping.destinations()) if mapping is not None else {*index_a.tensors, *index_a.values}
    every_b = [*index_b.tensors, *index_b.values]
    return renamed_view(index_b, {n: None for n in every_b if n not in kept and (n in of_a or not select.keeps(n))})


def diff(a: str | Path, b: str | Path, *, names: Any = None, select: Selection = Selection(), atol: float = 0.0,
         rtol: float = 0.0, allow_dtype: bool = False, max_memory: int = DEFAULT_MAX_MEMORY,
         progress: Any = None, grids: bool = False) -> DiffReport:
    """Compare checkpoints `a` and `b` (any formats). `names`: rules or a preset renaming `a`'s
    entries to `b`'s names first (as `convert --names`); `allow_dtype`: a dtype change alone is
    not a difference (the values are still compared); `grids`: each differing tensor keeps where
    it differs (`TensorDiff.grid`, what `diff --html` draws).

    Raises:
        HpckptError: either checkpoint cannot be read (its documented error).
    """
    with reading(a), reading(b):
        index_a, index_b = open_index(a), open_index(b)
        for index in (index_a, index_b):
            refuse_interrupted(index)  # as every command that reads data: leftovers of a killed save
        view_a, mapping = rename(index_a, names, select)[:2]
        view_b = index_b if select.everything else _selected_b(index_a, index_b, view_a, mapping, select)
        report = DiffReport(str(a), str(b), index_a.format, index_b.format, atol, rtol, allow_dtype)
        names_a = [*view_a.tensors, *view_a.values]
        names_b = [*view_b.tensors, *view_b.values]
        set_a, set_b = set(names_a), set(names_b)
        report.only_a = [n for n in names_a if n not in set_b]
        report.only_b = [n for n in names_b if n not in set_a]
        common = [n for n in view_a.tensors if n in view_b.tensors]
        for name in common:  # a corrupt shape or chunk is reported as such before any byte is read
            for entry in (view_a.tensors[name], view_b.tensors[name]):
                check_inside(name, tuple(entry.shape), *entry.chunk_arrays())
        total = sum(view_a.tensors[n].nbytes for n in common)
        if progress is not None:
            progress.start(total)
        with OpenFiles() as fa, OpenFiles() as fb:
            for name in common:
                ea, eb = view_a.tensors[name], view_b.tensors[name]
                report.tensors.append(_compare(name, ea, eb, view_a, view_b, fa, fb, atol, rtol, max_memory, grids))
                if progress is not None:
                    progress.advance(ea.nbytes)
        for name in (n for n in view_a.values if n in view_b.values):
            va, vb = _value(view_a, name), _value(view_b, name)
            equal = type(va) is type(vb) and _same(va, vb)
            report.values.append({"name": name, "equal": equal, "a": f"{type(va).__name__} {va!r}"[:200],
                                  "b": f"{type(vb).__name__} {vb!r}"[:200]})
        for name in (n for n in view_a.tensors if n in view_b.values):
            report.only_a.append(name)  # a tensor on one side, a value on the other: not the same entry
        for name in (n for n in view_a.values if n in view_b.tensors):
            report.only_b.append(name)
    return report


def _same(x: Any, y: Any) -> bool:
    """Equal by value, with a float NaN equal to itself (a saved NaN learning rate is unchanged)."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - values whose == raises are not equal
        return False
