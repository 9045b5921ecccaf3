"""``python -m mita.lra ...``: the ``mita lra`` command on its own (same arguments), e.g. under torchrun."""

from __future__ import annotations

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["lra", *sys.argv[1:]]))
