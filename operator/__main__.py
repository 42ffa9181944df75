"""``python -m loraserve.operator`` and the ``loraserve-operator`` command."""

from __future__ import annotations

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
