"""A HyperParallel checkpoint written from chunks held in memory, placed on ranks by the caller.

Examples, tests and benchmarks need checkpoints with an exact layout (which rank stores which
box). This is a save from memory: the chunks become an in-memory source (`core.io.memory_source`),
their placement a plan (`core.geometry.plan.plan_as_given`), and the one HyperParallel writer, engine and
commit write it, so these checkpoints are byte for byte what hpckpt writes everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpckpt.converters import index_cache
from hpckpt.converters.base import WriterOptions
from hpckpt.converters.hyperparallel.reader import HyperParallelReader
from hpckpt.converters.hyperparallel.writer import HyperParallelWriter
from hpckpt.core.dtypes import DType
from hpckpt.core.geometry.box import Box
from hpckpt.core.geometry.plan import PlannedValue, plan_as_given
from hpckpt.core.io.memory_source import MemoryTensor, memory_index
from hpckpt.core.io.write import ManifestFields, WriteSettings, write_plan


@dataclass(frozen=True)
class ChunkData:
    rank: int
    box: Box
    data: bytes  # C-order little-endian bytes of the box


def write_checkpoint(root: Path, tensors: dict[str, tuple[DType, tuple[int, ...], list[ChunkData]]],
                     values: dict[str, tuple[int, Any]] | None = None, framework: str = "torch") -> None:
    """Write a HyperParallel checkpoint at `root` (replacing it); every value is `(rank, value)`.

    Each rank's chunks are stored in the order given; every entry's nesting path is its own name.
    """
    values = values or {}
    memory = {
        fqn: MemoryTensor(dtype, tuple(shape), [
            (c.box, np.frombuffer(c.data, dtype=dtype.np).reshape(c.box.sizes)) for c in chunks])
        for fqn, (dtype, shape, chunks) in tensors.items()
    }
    source = memory_index(memory, {fqn: value for fqn, (_rank, value) in values.items()}, framework=framework)
    ranks = [c.rank for _, _, chunks in tensors.values() for c in chunks] + [rank for rank, _ in values.values()]
    plan = plan_as_given({fqn: (dtype, shape, [(c.rank, c.box) for c in chunks])
                          for fqn, (dtype, shape, chunks) in tensors.items()},
                         max(ranks, default=0) + 1,
                         values=[PlannedValue(fqn, rank) for fqn, (rank, _value) in values.items()],
                         nesting={fqn: (fqn,) for fqn in [*tensors, *values]})
    writer = HyperParallelWriter(WriterOptions(framework=framework))
    write_plan(plan, source, writer, Path(root), WriteSettings(sync=False, force=True),
               read_back=HyperParallelReader().read_index,
               fields=ManifestFields("hyperparallel", describe=index_cache.snapshot,
                                     command="hpckpt.converters.hyperparallel.from_memory.write_checkpoint"))
