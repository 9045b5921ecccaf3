"""The ``mita`` command line: ``mita demo``, ``mita bench``, ``mita taxonomy``, ``mita lra ...``, ``mita vision ...``.

Each command lives in its own module, which exposes ``add_parser(subparsers)``; the
parser it adds sets ``func``, called with the parsed arguments.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "mita.benchmarks.demo",
    "mita.benchmarks.bench",
    "mita.cli_taxonomy",
    "mita.lra.cli",
    "mita.recall.cli",
    "mita.vision.cli",
]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

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
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"mita {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
