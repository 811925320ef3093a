"""Layout inference: recognise the layout that produced a saved tensor's chunk boxes.

`inspect` and `reshard --keep-layout` use it to tell a Shard(0) over 4 ranks, a replicated tensor
or RaggedShard-style flat intervals from the boxes a checkpoint records.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hpckpt.core.errors import CorruptMetadataError
from hpckpt.core.geometry.box import Box, full_box
from hpckpt.core.geometry.layout.mesh import Mesh
from hpckpt.core.geometry.layout.placements import RULES, Replicate, Shard, split
from hpckpt.core.geometry.layout.tensor_layout import TensorLayout


@dataclass(frozen=True)
class InferredLayout:
    """What a saved tensor's chunk boxes reveal about the layout that wrote them.

    `kind` is "replicated" (one full box), "sharded" (a grid of per-dim splits, each matching a
    rule) or "irregular" (`detail` "ragged": consecutive flat row-major intervals, as RaggedShard
    writes; else "unknown"). For "sharded", `dims`, `parts` and `rules` are per split tensor dim;
    a rule is "balanced", "ceil" or "even" (both rules give these boxes).
    """

    kind: str
    dims: tuple[int, ...] = ()
    parts: tuple[int, ...] = ()
    rules: tuple[str, ...] = ()
    detail: str = ""

    def to_layout(self) -> TensorLayout | None:
        """A layout that produces the same distinct boxes (mesh = the parts), or None if irregular."""
        if self.kind == "replicated":
            return TensorLayout(Mesh((1,)), (Replicate(),))
        if self.kind != "sharded":
            return None
        placements = tuple(Shard(d, "balanced" if r == "even" else r) for d, r in zip(self.dims, self.rules))
        return TensorLayout(Mesh(self.parts), placements)

    def __str__(self) -> str:
        if self.kind == "sharded":
            return ", ".join(f"S{d}/{n} {r}" for d, n, r in zip(self.dims, self.parts, self.rules))
        return f"irregular ({self.detail})" if self.kind == "irregular" else self.kind


def infer(entry_shape: Sequence[int], chunk_boxes: Iterable[Box], world_size: int | None = None) -> InferredLayout | None:
    """Recognise the layout behind a tensor's chunk boxes (duplicates are ignored).

    De-duplication may merge trailing empty parts, so their count is taken as `world_size` when
    that fits (one split dim), else one more than the non-empty parts.

    Args:
        entry_shape: the tensor's global shape.
        chunk_boxes: the boxes of its saved chunks, in any order.
        world_size: ranks that saved the checkpoint, if known.

    Returns:
        The inferred layout, or None when there are no boxes or a box lies outside the tensor.
    """
    shape = tuple(entry_shape)
    boxes = list(dict.fromkeys(chunk_boxes))
    if not boxes or not all(b.inside(shape) for b in boxes):
        return None
    if len(boxes) == 1 and boxes[0] == full_box(shape):
        return InferredLayout("replicated")
    per_dim = [sorted({(b.offsets[d], b.sizes[d]) for b in boxes}) for d in range(len(shape))]
    if math.prod(len(iv) for iv in per_dim) != len(boxes):
        return _irregular(shape, boxes)
    split_dims = [d for d, iv in enumerate(per_dim) if len(iv) > 1]
    if not split_dims:  # one box, not the full tensor
        return _irregular(shape, boxes)
    found = []
    for d in split_dims:
        match = _match_split(shape[d], per_dim[d], world_size if len(split_dims) == 1 else None)
        if match is None:
            return _irregular(shape, boxes)
        found.append(match)
    return InferredLayout("sharded", tuple(split_dims), tuple(n for n, _ in found), tuple(r for _, r in found))


@functools.lru_cache(maxsize=4096)
def _all_splits_cached(length: int, parts: int, rule: str) -> tuple[tuple[int, int], ...]:
    return tuple(split(length, parts, i, rule) for i in range(parts))


def _all_splits(length: int, parts: int, rule: str) -> list[tuple[int, int]]:
    """Every part of a split; cached, since a checkpoint's tensors share a few (length, parts)."""
    return list(_all_splits_cached(length, parts, rule))


def _match_split(length: int, intervals: list[tuple[int, int]], world_size: int | None) -> tuple[int, str] | None:
    """Find `(parts, rule)` whose split of `length` gives exactly these intervals."""
    nonempty = [iv for iv in intervals if iv[1] > 0]
    if len(nonempty) == len(intervals):
        candidates = [len(intervals)]
    else:
        if len(intervals) - len(nonempty) > 1 or intervals[-1] != (length, 0):
            return None  # both rules put empty parts at the end, at offset `length`
        k = len(nonempty)
        candidates = ([world_size] if world_size and world_size > k else []) + [k + 1]
    for n in candidates:
        expected = nonempty + [(length, 0)] * (n - len(nonempty))
        ok = [r for r in RULES if _all_splits(length, n, r) == expected]
        if ok:
            return n, ("even" if len(ok) == 2 else ok[0])
    return None


def _irregular(shape: tuple[int, ...], boxes: list[Box]) -> InferredLayout:
    """Tell RaggedShard-style boxes (flat intervals tiling the tensor) from anything else."""
    intervals = []
    for b in boxes:
        if b.is_empty:
            continue
        if not _flat_contiguous(b, shape):
            return InferredLayout("irregular", detail="unknown")
        start = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(b.offsets))
        intervals.append((start, start + b.volume))
    intervals.sort()
    end = 0
    for start, stop in intervals:
        if start != end:
            return InferredLayout("irregular", detail="unknown")
        end = stop
    return InferredLayout("irregular", detail="ragged" if end == math.prod(shape) else "unknown")


def _flat_contiguous(b: Box, shape: tuple[int, ...]) -> bool:
    """True when a box is one flat row-major interval: sizes 1, then any, then full dims."""
    d = 0
    while d < len(shape) - 1 and b.sizes[d] == 1:
        d += 1
    return all(b.sizes[e] == shape[e] and b.offsets[e] == 0 for e in range(d + 1, len(shape)))


def inferred_layouts(index) -> dict[str, str]:
    """fqn -> the layout a `CheckpointIndex`'s chunks reveal ("S0/4 balanced", "replicated",
    "irregular (ragged)"); remembered on each entry, so a snapshot can keep it. Tensors whose
    shape and boxes are the same (a model's layers) are inferred once: a 10,000-tensor
    checkpoint has a few dozen such patterns."""
    out, patterns = {}, {}
    for fqn, entry in index.tensors.items():
        if entry.layout_hint is None:
            entry.layout_hint = _hint(entry, index.world_size, patterns)
        out[fqn] = entry.layout_hint
    return out


def _hint(entry, world_size: int | None, patterns: dict) -> str:
    """The layout text of one tensor, looked up in `patterns` (shape and box arrays -> text)."""
    try:
        offsets, sizes = entry.chunk_arrays()
    except CorruptMetadataError:  # (chunks of other dims than the tensor: `infer` says None)
        found = infer(entry.shape, entry.boxes, world_size)
        return str(found) if found is not None else "invalid"
    key = (tuple(entry.shape), offsets.shape, offsets.tobytes(), sizes.tobytes())
    hint = patterns.get(key)
    if hint is None:
        boxes = [Box(tuple(o), tuple(z)) for o, z in zip(offsets.tolist(), sizes.tolist())]
        found = infer(entry.shape, boxes, world_size)
        hint = patterns[key] = str(found) if found is not None else "invalid"
    return hint
