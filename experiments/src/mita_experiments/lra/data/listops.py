"""ListOps (Nangia & Bowman 2018) as generated for Long Range Arena (Tay et al. 2021; spec section 7).

A sample is a nested list of operations on digits, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]`` -> 9.
Trees are drawn top-down: below the maximum depth a node is a leaf (a digit) with
probability ``leaf_prob``, otherwise an operator over 2..``max_args`` children. A tree
is kept only if its token count (operators, digits and closing brackets) lies in
``[min_length, max_length]`` and its text was not drawn before. Python's
``random.Random`` (Mersenne Twister) drives the draws, so a seed gives the same files
on any machine. Files use the LRA release layout: ``basic_{train,val,test}.tsv`` with a
``Source\\tTarget`` header and the LRA bracketing ``( ( [MAX 2 ) 9 ) ] )``.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ...utils.files import atomic_write

OPERATORS: dict[str, Callable[[list[int]], int]] = {
    "[MIN": min,
    "[MAX": max,
    "[MED": lambda xs: int(statistics.median(xs)),  # int() of the median: the lower of two middle values' mean
    "[SM": lambda xs: sum(xs) % 10,
}
END = "]"
SPLITS = ("train", "val", "test")
# Token ids: 0 is padding; the closing bracket is the token "X" (spec section 7).
VOCAB = ["<pad>", *(str(d) for d in range(10)), *OPERATORS, "X"]
TOKEN_IDS = {tok: i for i, tok in enumerate(VOCAB)}


class _TooLong(Exception):
    """Raised while drawing a tree as soon as it exceeds the length window."""


@dataclass(frozen=True)
class ListOpsSpec:
    """The generator's parameters; the defaults are LRA's ``basic`` task."""

    num_train: int = 96_000
    num_val: int = 2_000
    num_test: int = 2_000
    min_length: int = 500
    max_length: int = 2_000
    max_depth: int = 10
    max_args: int = 10
    leaf_prob: float = 0.75
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_train", "num_val", "num_test"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}")
        if self.max_depth < 1 or self.max_args < 2:
            raise ValueError(f"need max_depth >= 1 and max_args >= 2, got {self.max_depth}, {self.max_args}")
        if not 0.0 <= self.leaf_prob < 1.0:
            raise ValueError(f"leaf_prob must be in [0, 1), got {self.leaf_prob!r}")


def _draw(rng: random.Random, spec: ListOpsSpec, depth: int, budget: list[int]) -> tuple[str, int]:
    """One subtree as (LRA-bracketed text, value); ``budget`` holds the tokens still allowed."""
    leaf = depth >= spec.max_depth or rng.random() < spec.leaf_prob
    budget[0] -= 1 if leaf else 2  # a digit, or an operator and its closing bracket
    if budget[0] < 0:
        raise _TooLong
    if leaf:
        digit = rng.randrange(10)
        return str(digit), digit
    op = rng.choice(list(OPERATORS))
    children = [_draw(rng, spec, depth + 1, budget) for _ in range(rng.randint(2, spec.max_args))]
    text = op
    for child, _ in children:
        text = f"( {text} {child} )"
    return f"( {text} {END} )", OPERATORS[op]([value for _, value in children])


def tokenize(source: str) -> list[str]:
    """LRA source text to tokens: brackets ``(`` ``)`` dropped, ``]`` kept as the token ``X``."""
    return ["X" if tok == END else tok for tok in source.split() if tok not in ("(", ")")]


def encode(source: str) -> list[int]:
    """Token ids of a source string (see :data:`VOCAB`); unknown tokens raise a ValueError."""
    try:
        return [TOKEN_IDS[tok] for tok in tokenize(source)]
    except KeyError as err:
        raise ValueError(f"unknown ListOps token {err.args[0]!r}; valid tokens: {VOCAB[1:]}") from None


def evaluate(source: str) -> int:
    """The value of a ListOps expression (for checking labels)."""
    stack: list[list] = []
    for tok in tokenize(source):
        if tok in OPERATORS:
            stack.append([tok])
        elif tok == "X":
            op, *args = stack.pop()
            value = OPERATORS[op](args)
            if not stack:
                return value
            stack[-1].append(value)
        else:
            stack[-1].append(int(tok))
    raise ValueError(f"unbalanced ListOps expression: {source[:80]!r}")


def samples(spec: ListOpsSpec, count: int, rng: random.Random, seen: set[str]) -> Iterator[tuple[str, int]]:
    """``count`` new (source, target) pairs within the length window, never one in ``seen``."""
    made = 0
    while made < count:
        budget = [spec.max_length]
        try:
            text, value = _draw(rng, spec, 1, budget)
        except _TooLong:
            continue
        if spec.max_length - budget[0] < spec.min_length or text in seen:
            continue
        seen.add(text)
        made += 1
        yield text, value


def generate(out_dir: str | Path, spec: ListOpsSpec = ListOpsSpec(), overwrite: bool = False) -> dict[str, Path]:
    """Write ``basic_{train,val,test}.tsv`` under ``out_dir``; splits share no expression."""
    out = Path(out_dir)
    paths = {split: out / f"basic_{split}.tsv" for split in SPLITS}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"ListOps files exist already: {existing}; pass overwrite=True (--force)")
    out.mkdir(parents=True, exist_ok=True)
    rng, seen = random.Random(spec.seed), set()
    counts = {"train": spec.num_train, "val": spec.num_val, "test": spec.num_test}
    for split, path in paths.items():
        with atomic_write(path, "w", encoding="utf-8", newline="\n") as f:
            f.write("Source\tTarget\n")
            for text, value in samples(spec, counts[split], rng, seen):
                f.write(f"{text}\t{value}\n")
    return paths
