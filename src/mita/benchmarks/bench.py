"""``mita bench``: placeholder until the benchmark suite lands."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed and memory benchmarks (not available yet)")
    p.set_defaults(func=lambda args: print("mita bench: not available yet") or 1)
