"""The `hpckpt` command line: thin typer commands over `hpckpt.api`."""
