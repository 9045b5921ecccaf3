"""``mita taxonomy``: the paper's five-dimensional taxonomy of every registered attention."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("taxonomy", help="print the five-dimensional taxonomy of the attention methods")
    p.add_argument("--format", choices=["markdown", "csv"], default="markdown")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .attention import taxonomy_table

    print(taxonomy_table(args.format), end="")
    return 0
