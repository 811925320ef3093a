"""`python -m hpckpt` runs the command-line interface."""

from hpckpt.cli.app import main

if __name__ == "__main__":
    main()
