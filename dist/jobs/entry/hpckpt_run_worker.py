"""The script torchrun and msrun start on every rank (and msrun once more as its scheduler)."""

from hpckpt.dist.jobs.worker import main

if __name__ == "__main__":
    raise SystemExit(main())
