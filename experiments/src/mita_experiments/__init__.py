"""mita's experiments, benchmarks and command line (``mita ...``), apart from the library.

Each experiment has one package (``lra``, ``recall``, ``vision``, ``video``, ``benchmarks``);
they import the library (:mod:`mita`) and :mod:`mita_experiments.utils`, never each other's
private names.
"""

from mita import __version__

__all__ = ["__version__"]
