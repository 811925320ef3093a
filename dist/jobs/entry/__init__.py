"""Holds only the launcher's entry script: a script's directory goes first on `sys.path`, so
nothing that could shadow another module may sit next to it."""
