"""HyperParallel DCP, the primary format: `.metadata` (or rank-local `{r}.metadata` / legacy
`.rank{r}_metadata`) plus `_rank{r}_.safetensors` and `.bytes` files, as HyperParallel's own
save writes them (docs/formats.md; the metadata classes: `core/codecs/hyperparallel_metadata.py`).
`reader` reads both layouts; `writer` writes the current one."""

from hpckpt.converters.hyperparallel.reader import HyperParallelReader
from hpckpt.converters.hyperparallel.writer import HyperParallelWriter

__all__ = ["HyperParallelReader", "HyperParallelWriter"]
