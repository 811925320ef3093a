"""Layouts: which box of a global tensor each rank of a device mesh holds.

The resharding engine describes a source or target checkpoint as one `TensorLayout` per tensor:
a `Mesh` (shape plus the global ranks in row-major order, last mesh dim fastest) and one placement
per mesh dim, PyTorch DTensor style:

* `Shard(dim, rule)`: split tensor dim `dim` over that mesh dim. `rule="balanced"` is
  HyperParallel's default (the first `len % n` parts are one larger, like `numpy.array_split`);
  `rule="ceil"` is PyTorch's (`torch.chunk`: parts of `ceil(len / n)`, trailing parts may be
  empty). Several Shards of the same tensor dim split it successively, the first mesh dim being
  the outermost split.
* `Replicate()`: every rank along that mesh dim holds the same data.
* `RaggedShard(dims, local_units)`: HyperParallel's non-uniform flat sharding; each rank holds a
  flat row-major interval, recorded as the minimal ordered sequence of N-D boxes (`ragged.py`).

Empty boxes (size 0 on some dim) are returned like any other, because HyperParallel records
them as chunks. Converters read MindSpore/HyperParallel `tensor_map`s and `.layout` JSON files,
`LayoutSpec` resolves a target layout per tensor from a world size, rules or layout files, and
`infer` recognises the layout that produced a saved tensor's chunk boxes.

Placement text (`parse_placements`, one token per mesh dim): `R`, `S<d>` or `S(<d>)`, optionally
`S<d>:ceil` / `S<d>:balanced`, and `Ragged(<dims>;<units>)`. Rules files are TOML, see
`RULES_FILE_EXAMPLE`.

Modules: `placements` (split rules and placements), `mesh`, `tensor_layout` (`TensorLayout`,
`from_tensor_map`), `ragged` (RaggedShard geometry), `text` (mesh and placement text),
`layout_file` (`.layout` JSON), `rules` (TOML layout rules), `spec` (`LayoutSpec`) and `infer`.

Errors: an impossible layout raises `GeometryError`; malformed `.layout` files raise
`CorruptMetadataError`; a bad layout rules file raises `LayoutRuleError` (a `ValueError`), a
missing one `PathNotFoundError`; wrong arguments and malformed placement/mesh strings (usage
errors) raise `ValueError`.
"""

from hpckpt.core.geometry.layout.infer import InferredLayout, infer, inferred_layouts
from hpckpt.core.geometry.layout.layout_file import load_layout_file
from hpckpt.core.geometry.layout.mesh import Mesh
from hpckpt.core.geometry.layout.placements import RULES, Placement, RaggedShard, Replicate, Shard, split
from hpckpt.core.geometry.layout.ragged import decompose_flat_interval
from hpckpt.core.geometry.layout.rules import RULES_FILE_EXAMPLE, load_rules, pattern_matches
from hpckpt.core.geometry.layout.spec import LayoutSpec
from hpckpt.core.geometry.layout.tensor_layout import TensorLayout, from_tensor_map, to_tensor_map
from hpckpt.core.geometry.layout.text import parse_mesh, parse_placements
from hpckpt.core.safety.rules_file import check_table_keys

__all__ = [
    "RULES", "split", "Shard", "Replicate", "RaggedShard", "Placement",
    "Mesh", "TensorLayout", "from_tensor_map", "decompose_flat_interval",
    "parse_mesh", "parse_placements", "load_layout_file",
    "RULES_FILE_EXAMPLE", "load_rules", "pattern_matches", "check_table_keys",
    "LayoutSpec", "InferredLayout", "infer", "inferred_layouts",
]
