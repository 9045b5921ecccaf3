"""The flags every command spells the same way: ``--out`` (output folder or file) and ``--force`` (overwrite)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_command_group", "add_force", "add_out"]


def add_out(
    parser: argparse.ArgumentParser, help: str, *, required: bool = False, default: Any = None, **kwargs: Any
) -> argparse.Action:
    """Add ``--out`` (dest ``out``); ``kwargs`` go to ``add_argument``."""
    return parser.add_argument("--out", dest="out", required=required, default=default, help=help, **kwargs)


def add_command_group(
    sub: argparse._SubParsersAction, name: str, help: str, description: str | None = None
) -> argparse._SubParsersAction:
    """Add ``mita NAME`` and return the action that adds its sub-commands: one is required, its name
    lands in ``args.NAME_command`` and ``--help`` shows it as ``NAME_COMMAND``. ``description`` (say, the
    module's docstring) is shown by ``mita NAME --help`` as written."""
    parser = sub.add_parser(
        name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar=f"{name.upper()}_COMMAND")


def add_force(parser: argparse.ArgumentParser | Any, help: str) -> argparse.Action:
    """Add ``--force`` (dest ``force``, a flag)."""
    return parser.add_argument("--force", dest="force", action="store_true", help=help)
