"""``python -m partita.launcher``: the same as the ``partita`` command."""

from __future__ import annotations

import sys

from partita.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
