"""The framework-free core, in rooms by concern (docs/architecture.md draws them):

- `geometry/`: boxes, layouts, plans;
- `io/`: sources, reads, the copy engine, digests;
- `commit/`: the destination, staging, durability, the manifest;
- `safety/`: opening input files, the allow-listed unpickler and its budgets, validation;
- `codecs/`: the formats' own bytes (safetensors, torch.save, DCP and HyperParallel metadata, .ckpt);
- at the top, the vocabulary every room shares: errors, dtypes, the checkpoint index and its view.

Nothing here imports torch or MindSpore, so every command starts fast and the core runs where
neither framework is installed; nothing here imports the converters above it.
"""
