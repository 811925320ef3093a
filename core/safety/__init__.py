"""Input safety: every file a reader opens, every pickle it reads and every rules file it takes
passes through here (regular files only, sizes, allow-listed globals, budgets, structural checks).
"""
