"""Geometry and plans: boxes in global coordinates, layouts, and which rank stores which box.

Pure arithmetic over shapes and ranks (numpy only): nothing here opens a file.
"""
