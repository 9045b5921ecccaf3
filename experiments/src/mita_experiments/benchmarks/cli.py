"""``mita demo``, ``mita bench`` and ``mita taxonomy``: the attention zoo on the command line."""

from __future__ import annotations

import argparse

from . import bench, demo


def cmd_demo(args: argparse.Namespace) -> int:
    """``mita demo``: agreement with the reference, then MiTA against SDPA."""
    return demo.run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """``mita bench``: time, throughput and memory of the registered methods against N."""
    return bench.run(args)


def cmd_taxonomy(args: argparse.Namespace) -> int:
    """``mita taxonomy``: the paper's five-dimensional taxonomy of every registered method."""
    from mita.attention import taxonomy_table

    print(taxonomy_table(args.format), end="")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help=demo.HELP, description=demo.__doc__)
    demo.add_arguments(p)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help=bench.HELP, description=bench.DESCRIPTION)
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("taxonomy", help="print the five-dimensional taxonomy of the attention methods")
    p.add_argument("--format", choices=["markdown", "csv"], default="markdown")
    p.set_defaults(func=cmd_taxonomy)
