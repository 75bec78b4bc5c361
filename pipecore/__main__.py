"""``python -m pipecore``: the same command line as ``pipecore``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
