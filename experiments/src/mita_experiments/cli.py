"""The ``mita`` command line: ``mita demo``, ``mita bench``, ``mita taxonomy``, ``mita lra ...``,
``mita vision ...``, ``mita video ...``.

Each package with commands has a ``cli`` module exposing ``add_parser(subparsers)`` and
public ``cmd_*`` handlers; the parser it adds sets ``func``, called with the parsed
arguments. Every command spells its output flag ``--out`` and its overwrite flag
``--force`` (:mod:`mita_experiments.utils.flags`). A refused input (bad value, missing or existing
file) ends the command with one line on stderr and exit status 2, Ctrl-C with one line and
exit status 130 (a training run saves a checkpoint first); ``MITA_TRACEBACK=1`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMAND_MODULES = [
    "mita_experiments.benchmarks.cli",
    "mita_experiments.lra.cli",
    "mita_experiments.recall.cli",
    "mita_experiments.vision.cli",
    "mita_experiments.video.cli",
    "mita_experiments.segmentation.cli",
]
#: errors that mean "the input was refused", reported in one line (exit status 2)
USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def build_parser() -> argparse.ArgumentParser:
    from mita import __version__

    parser = argparse.ArgumentParser(prog="mita", description="MiTA attention: demos, benchmarks and experiments.")
    parser.add_argument("--version", action="version", version=f"mita {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as err:
        if os.environ.get("MITA_TRACEBACK") == "1":
            raise
        text = " ".join(str(err).split())
        print(f"mita {args.command}: {text or 'interrupted'}", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if os.environ.get("MITA_TRACEBACK") == "1":
            raise
        text = " ".join(str(err).split()) or type(err).__name__
        if isinstance(err, OSError) and err.filename is not None and str(err.filename) not in text:
            text = f"{text}: {err.filename}"
        print(f"mita {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
