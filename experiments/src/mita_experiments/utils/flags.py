"""The flags every command spells the same way: ``--out`` (output folder or file) and
``--force`` (overwrite). The old spellings ``--output``, ``--run-dir`` and ``--overwrite``
still work for one release and print a deprecation warning.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["add_force", "add_out"]


def _warn(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    print(f"{parser.prog}: warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)


class _Out(argparse.Action):
    """Stores the value (``True`` for a flag without one); warns when a deprecated spelling was used."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string != self.option_strings[0]:
            _warn(parser, option_string, self.option_strings[0])
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


class _Force(_Out):
    """``store_true`` that warns when a deprecated spelling was used."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)


def add_out(
    parser: argparse.ArgumentParser,
    help: str,
    *,
    required: bool = False,
    default: Any = None,
    deprecated: Sequence[str] = (),
    **kwargs: Any,
) -> argparse.Action:
    """Add ``--out`` (dest ``out``), with ``deprecated`` old spellings that warn (e.g. ``["--output"]``)."""
    return parser.add_argument(
        "--out",
        *deprecated,
        dest="out",
        action=_Out,
        required=required,
        default=default,
        help=help + _old(deprecated),
        **kwargs,
    )


def add_force(parser: argparse.ArgumentParser | Any, help: str, *, deprecated: Sequence[str] = ()) -> argparse.Action:
    """Add ``--force`` (dest ``force``), with ``deprecated`` old spellings that warn (e.g. ``["--overwrite"]``)."""
    return parser.add_argument("--force", *deprecated, dest="force", action=_Force, help=help + _old(deprecated))


def _old(deprecated: Sequence[str]) -> str:
    return f" ({', '.join(deprecated)}: deprecated spelling)" if deprecated else ""
