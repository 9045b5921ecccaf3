"""The flags every command spells the same way: ``--out`` (output folder or file) and ``--force`` (overwrite)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_force", "add_out"]


def add_out(
    parser: argparse.ArgumentParser, help: str, *, required: bool = False, default: Any = None, **kwargs: Any
) -> argparse.Action:
    """Add ``--out`` (dest ``out``); ``kwargs`` go to ``add_argument``."""
    return parser.add_argument("--out", dest="out", required=required, default=default, help=help, **kwargs)


def add_force(parser: argparse.ArgumentParser | Any, help: str) -> argparse.Action:
    """Add ``--force`` (dest ``force``, a flag)."""
    return parser.add_argument("--force", dest="force", action="store_true", help=help)
