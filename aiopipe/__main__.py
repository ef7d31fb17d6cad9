"""``python -m aiopipe``: the command line (see :mod:`aiopipe.cli`)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
