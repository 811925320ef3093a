"""The framework-free core: metadata model, safe pickles, dtypes, geometry, indexes and readers.

Nothing here imports torch or MindSpore at module level, so every command starts fast and the core
runs where neither framework is installed.
"""
