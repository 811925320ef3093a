"""The engine and its I/O: sources (files and memory), ranged reads, the copy engine, casts,
checksums and digests taken as bytes move, and the accounting of what a write carried.
"""
