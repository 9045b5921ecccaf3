"""``python -m mita.lra ...``: the ``mita lra`` command on its own (same arguments)."""

from __future__ import annotations

import argparse
import sys

from .cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mita.lra")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["lra", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"mita lra: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
