"""``mita lra``: command-line entry (placeholder until the lra commands land)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lra", help="lra experiments (not available yet)")
    p.set_defaults(func=lambda args: print("mita lra: not available yet") or 1)
