"""``key=value`` options, the one parser of every command line and config string.

Values are Python literals where they parse (``8``, ``0.5``, ``(8, 8)``, ``None``,
``{'a': 1}``) and strings otherwise. Keys may be dotted (``data.generate.num_train``) to
reach into nested configs. A key given twice is an error, never "last one wins".
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["apply_assignments", "parse_assignment", "parse_assignments", "parse_config", "parse_value", "split_items"]


#: the JSON spellings of None, True and False: configurations are JSON files, so --set takes them too
JSON_LITERALS = {"null": None, "true": True, "false": False}


def parse_value(text: str) -> Any:
    """``text`` as a Python literal (or JSON's ``null``, ``true``, ``false``) if it is one, else the stripped string."""
    text = text.strip()
    if text in JSON_LITERALS:
        return JSON_LITERALS[text]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def split_items(text: str) -> list[str]:
    """Split at the commas outside brackets and quotes: ``"a=1,b=(2,3)"`` -> ``["a=1", "b=(2,3)"]``."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_assignment(item: str, what: str = "option", typed: bool = True) -> tuple[str, Any]:
    """``"key=value"`` as ``(key, value)``, the value typed by :func:`parse_value` unless
    ``typed=False`` (then the stripped text); a ValueError names ``what`` otherwise."""
    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq or not key or any(not part for part in key.split(".")):
        raise ValueError(f"{what} {item!r} must read key=value (keys may be dotted: a.b=1)")
    return key, parse_value(text) if typed else text.strip()


def parse_assignments(items: Iterable[str], what: str = "option", typed: bool = True) -> dict[str, Any]:
    """``["k=v", ...]`` as a dict (values as :func:`parse_assignment`); a key given twice is a ValueError."""
    out: dict[str, Any] = {}
    for item in items:
        key, value = parse_assignment(item, what, typed)
        if key in out:
            raise ValueError(f"{what} {key!r} is given twice ({out[key]!r} and {value!r}); give it once")
        out[key] = value
    return out


def parse_config(text: str, what: str = "config") -> tuple[str, dict[str, Any]]:
    """``"name:k=v,k=w"`` as ``(name, options)`` (commas inside brackets do not split)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a {what} is a name like 'mita:topk=32', got {text!r}")
    name, _, rest = text.partition(":")
    try:
        return name.strip(), parse_assignments(split_items(rest), f"{what} option")
    except ValueError as err:
        raise ValueError(f"{err} (in {text!r})") from None


def apply_assignments(
    config: Mapping[str, Any], assignments: Mapping[str, Any], what: str = "--set", open_sections: Iterable[str] = ()
) -> dict[str, Any]:
    """A deep copy of ``config`` with each dotted key set.

    Args:
        config: nested dicts.
        assignments: dotted key -> value, e.g. ``{"data.generate.num_train": 2000}``.
        what: how errors name the source of the assignments (default ``"--set"``).
        open_sections: dotted sections that may gain new keys (default none: every key on
            the path must exist, so typos fail loudly).

    Returns:
        The new config; ``config`` is left unchanged.
    """
    open_sections = set(open_sections)
    out = copy.deepcopy(dict(config))
    for key, value in assignments.items():
        node, parts = out, key.split(".")
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the config"
            if not isinstance(node, dict):
                raise ValueError(f"{what} {key}: {where} is a {type(node).__name__}, not a section with keys")
            if part not in node and not (depth == len(parts) - 1 and ".".join(parts[:depth]) in open_sections):
                raise ValueError(f"{what} {key}: unknown key {part!r}; {where} keys: {sorted(node)}")
            if depth == len(parts) - 1:
                node[part] = value
            else:
                node = node[part]
    return out
