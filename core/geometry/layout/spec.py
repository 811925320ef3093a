"""`LayoutSpec`: the target layout of every tensor, from a world size, rules or `.layout` files.

What `reshard` and `convert` are given as their target: it resolves `(fqn, shape)` to a
`TensorLayout`, fitted to the tensor (a 0-d tensor is replicated, a Shard of a dim the tensor
does not have becomes Replicate).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from hpckpt.core.errors import GeometryError
from hpckpt.core.geometry.layout.layout_file import read_layout_records
from hpckpt.core.geometry.layout.mesh import Mesh
from hpckpt.core.geometry.layout.placements import Placement, RaggedShard, Replicate, Shard, check_rule
from hpckpt.core.geometry.layout.rules import load_rules_file, pattern_matches
from hpckpt.core.geometry.layout.tensor_layout import TensorLayout


class LayoutSpec:
    """Resolves `(fqn, shape) -> TensorLayout` for every tensor of a checkpoint.

    Precedence: an exact entry of `layouts` (from `.layout` files), then the first matching
    rule, then `default`, then Replicate everywhere. Before use, placements are fitted to the
    tensor: a 0-d tensor is always replicated, and a Shard or RaggedShard of a dim the tensor
    does not have falls back to Replicate for that mesh dim (so "S1" can be a default for a
    model with 1-D biases). In FSDP mode a tensor whose dim 0 is empty is replicated as well.

    Raises:
        ValueError: neither a mesh nor layouts to take one from.
        GeometryError: `default` or a rule has not one placement per mesh dim.
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        default: Sequence[Placement] | None = None,
        rules: Sequence[tuple[str, Sequence[Placement]]] = (),
        layouts: Mapping[str, TensorLayout] | None = None,
        *,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        fsdp: bool = False,
    ):
        self.layouts = dict(layouts or {})
        if mesh is None and not self.layouts:
            raise ValueError("a LayoutSpec needs a mesh (or a world size), or layouts to take ranks from")
        self.mesh = mesh or _union_mesh(self.layouts.values())
        self.default = tuple(default) if default is not None else (Replicate(),) * self.mesh.ndim
        self.rules = [(pattern, tuple(p)) for pattern, p in rules]
        self.shapes = dict(shapes or {})
        self.fsdp = fsdp
        for placements in [self.default] + [p for _, p in self.rules]:
            TensorLayout(self.mesh, placements)  # fail now, not at the first tensor

    @classmethod
    def for_world_size(cls, world_size: int, rule: str = "balanced") -> "LayoutSpec":
        """FSDP-style target: a 1-D mesh of `world_size` ranks, Shard(0) with `rule` for all.

        Raises:
            ValueError: world size < 1 or unknown rule.
        """
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        return cls(Mesh((world_size,)), (Shard(0, check_rule(rule)),), fsdp=True)

    @classmethod
    def from_toml(cls, path: str | Path, mesh: Mesh | None = None) -> "LayoutSpec":
        """Load a layout rules file (see `rules.load_rules_file`); `mesh` overrides its `mesh` key.

        Raises:
            PathNotFoundError: the file does not exist.
            LayoutRuleError: invalid file, or no mesh in the file nor given.
        """
        parts = load_rules_file(path, mesh)
        return cls(parts.mesh, parts.default, parts.rules)

    def with_default(self, default: Sequence[Placement]) -> "LayoutSpec":
        """The same spec with other placements for the tensors no rule matches (validated)."""
        return LayoutSpec(self.mesh, default, self.rules, self.layouts, shapes=self.shapes, fsdp=self.fsdp)

    @classmethod
    def from_layout_files(cls, path: str | Path | Sequence[str | Path]) -> "LayoutSpec":
        """Target layouts from HyperParallel `.layout` files; other tensors are replicated
        over every rank the files mention.

        Raises:
            PathNotFoundError, CorruptMetadataError, GeometryError: see `load_layout_file`.
        """
        rec = read_layout_records(path)
        return cls(Mesh((len(rec.ranks),), tuple(rec.ranks)), layouts=rec.layouts, shapes=rec.shapes)

    def resolve(self, fqn: str, shape: Sequence[int]) -> TensorLayout:
        """Return the layout of tensor `fqn` of global `shape`, validated against it.

        Raises:
            GeometryError: the chosen layout cannot apply to `shape` (wrong placements count,
                RaggedShard preconditions), or `shape` differs from a `.layout` full_shape.
        """
        shape = tuple(shape)
        if fqn in self.layouts:
            if fqn in self.shapes and self.shapes[fqn] != shape:
                raise GeometryError(f"{fqn}: the layout file says shape {list(self.shapes[fqn])}, the tensor is {list(shape)}")
            layout = self.layouts[fqn]
        else:
            placements = next((p for pattern, p in self.rules if pattern_matches(pattern, fqn)), self.default)
            layout = TensorLayout(self.mesh, self._fit(placements, shape))
        layout.validate(shape)
        return layout

    def misfits(self, shapes: Mapping[str, Sequence[int]]) -> list["Misfit"]:
        """Every split placement given by a rule or the default that some tensor it applies to
        cannot take (a dim the tensor lacks; that mesh dim then replicates it), with how many
        tensors it does split. 0-d tensors, always replicated, and `.layout` entries do not count.
        """
        found: dict[tuple[str, int], Misfit] = {}
        for fqn, shape in shapes.items():
            shape = tuple(shape)
            if fqn in self.layouts or not shape or (self.fsdp and shape[0] < 1):
                continue
            source, placements = self._chosen(fqn)
            for k, p in enumerate(placements):
                if isinstance(p, Replicate):
                    continue
                m = found.setdefault((source, k), Misfit(str(p), source, k))
                if _beyond(p, len(shape)):
                    m.unfit.append(fqn)
                else:
                    m.fits += 1
        return [m for m in found.values() if m.unfit]

    def _chosen(self, fqn: str) -> tuple[str, tuple[Placement, ...]]:
        """Which placements apply to `fqn`, and where they come from (a rule, or the default)."""
        for i, (pattern, placements) in enumerate(self.rules, 1):
            if pattern_matches(pattern, fqn):
                return f"rule {i}", placements
        return "default", self.default

    def _fit(self, placements: tuple[Placement, ...], shape: tuple[int, ...]) -> tuple[Placement, ...]:
        if not shape or (self.fsdp and shape[0] < 1):
            return (Replicate(),) * len(placements)
        return tuple(Replicate() if _beyond(p, len(shape)) else p for p in placements)


class Misfit:
    """One placement (mesh dim `mesh_dim` of a rule or the default): the tensors it cannot split
    (`unfit`) and how many it does split (`fits`)."""

    def __init__(self, placement: str, source: str, mesh_dim: int):
        self.placement, self.source, self.mesh_dim = placement, source, mesh_dim
        self.unfit: list[str] = []
        self.fits = 0


def _beyond(p: Placement, ndim: int) -> bool:
    """True when `p` splits a tensor dim that an `ndim`-D tensor does not have."""
    if isinstance(p, Shard):
        return p.dim >= ndim
    return isinstance(p, RaggedShard) and len(p.dims) > ndim


def _union_mesh(layouts: Iterable[TensorLayout]) -> Mesh:
    ranks = sorted({r for layout in layouts for r in layout.mesh.ranks})
    return Mesh((len(ranks),), tuple(ranks))
