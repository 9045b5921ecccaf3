"""``mita vision``: command-line entry (placeholder until the vision commands land)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vision", help="vision experiments (not available yet)")
    p.set_defaults(func=lambda args: print("mita vision: not available yet") or 1)
