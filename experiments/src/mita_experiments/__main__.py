"""``python -m mita_experiments ...`` is the ``mita`` command (same arguments), e.g. under
``torchrun --nproc_per_node N -m mita_experiments lra train ...``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
