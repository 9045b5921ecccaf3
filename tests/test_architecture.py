"""The import graph: dependencies point one way.

The library (``mita``): ops -> layers -> models -> integrations, ``mita.utils`` below all, and
nothing of the experiments. The experiments (``mita_experiments``): each experiment package
imports the library, ``mita_experiments.utils`` and the trainer, never another package's
private names; the trainer and the utils import no experiment.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mita

ROOTS = {"mita": Path(mita.__file__).parent}
try:
    import mita_experiments

    ROOTS["mita_experiments"] = Path(mita_experiments.__file__).parent
except ImportError:  # the library installed alone
    pass
ABOVE_OPS = ("mita.layers", "mita.models", "mita.integrations", "mita.attention", "mita.registrations")
#: the experiment packages of mita_experiments (besides them: the trainer, the utils and the command line)
EXPERIMENTS = ("benchmarks", "lra", "recall", "segmentation", "video", "vision")


def _module_name(root: str, path: Path) -> str:
    parts = (root, *path.relative_to(ROOTS[root]).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_module_name(r, p): p for r, base in ROOTS.items() for p in base.rglob("*.py")}
PACKAGES = {_module_name(r, p) for r, base in ROOTS.items() for p in base.rglob("__init__.py")}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(name: str) -> set[str]:
    """The modules and names ``name`` imports from mita or mita_experiments, anywhere (function
    bodies too; ``if TYPE_CHECKING`` blocks aside), as dotted paths."""
    path = FILES[name]
    package = name if name in PACKAGES else name.rpartition(".")[0]
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [base])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in ROOTS}


NAMES = {name: imports(name) for name in FILES}
GRAPH = {name: {m for m in deps if m in FILES} for name, deps in NAMES.items()}


def _bad(prefix: str, forbidden) -> dict[str, list[str]]:
    found = {n: sorted(m for m in d if forbidden(m)) for n, d in GRAPH.items() if n.startswith(prefix)}
    return {k: v for k, v in found.items() if v}


def test_no_import_cycles_between_modules() -> None:
    graph = {a: {b for b in bs if b not in PACKAGES and b != a} for a, bs in GRAPH.items() if a not in PACKAGES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, f"import cycles: {cycles}"


def test_ops_import_nothing_above_them() -> None:
    assert not (bad := _bad("mita.ops", lambda m: m.startswith(ABOVE_OPS))), bad


def test_layers_import_no_models_or_integrations() -> None:
    above = ("mita.models", "mita.integrations", "mita.attention", "mita.registrations")
    assert not (bad := _bad("mita.layers", lambda m: m.startswith(above))), bad


def test_the_library_imports_no_experiment() -> None:
    assert not (bad := _bad("mita.", lambda m: m.startswith("mita_experiments"))), bad


def test_the_graph_sees_the_imports() -> None:
    """The checks above are only as good as the parser: a known edge and a known absence."""
    assert "mita.ops.agent" in GRAPH["mita.layers.agent"]
    assert "mita.ops.pooling" in GRAPH["mita.ops.mita.grouped"]
    assert "mita.layers.agent" not in GRAPH["mita.ops.agent"]


def test_utils_import_only_utils() -> None:
    """``mita.utils`` is below everything: it may import torch and the standard library, no other mita module."""
    assert GRAPH.get("mita.utils.options") is not None
    assert not (bad := _bad("mita.utils", lambda m: not m.startswith("mita.utils"))), bad


needs_experiments = pytest.mark.skipif("mita_experiments" not in ROOTS, reason="mita-experiments not installed")


@needs_experiments
def test_every_experiment_package_is_listed() -> None:
    """A new experiment package joins :data:`EXPERIMENTS`, so that the checks below cover it."""
    top = {n.split(".")[1] for n in PACKAGES if n.startswith("mita_experiments.") and n.count(".") == 1}
    assert top - {"trainer", "utils"} == set(EXPERIMENTS)


@needs_experiments
def test_the_trainer_imports_no_experiment() -> None:
    experiments = tuple(f"mita_experiments.{e}" for e in EXPERIMENTS)
    assert GRAPH.get("mita_experiments.trainer.loop") is not None
    assert not (bad := _bad("mita_experiments.trainer", lambda m: m.startswith(experiments))), bad


@needs_experiments
def test_the_graph_sees_the_experiments_imports() -> None:
    """A known edge between experiments (segmentation builds on the digits testbed's public names), and
    that the segmentation experiment's modules are all parsed."""
    assert "mita_experiments.vision.digits.Tensors" in NAMES["mita_experiments.segmentation.task"]
    assert "mita_experiments.vision.digits" in GRAPH["mita_experiments.segmentation.task"]
    parsed = {n for n in GRAPH if n.startswith("mita_experiments.segmentation.")}
    assert {"mita_experiments.segmentation.task", "mita_experiments.segmentation.train"} <= parsed


@needs_experiments
def test_experiment_utils_import_no_experiment() -> None:
    ok = ("mita_experiments.utils", "mita.utils")
    assert GRAPH.get("mita_experiments.utils.checkpoint") is not None
    assert not (bad := _bad("mita_experiments.utils", lambda m: not m.startswith(ok))), bad


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@needs_experiments
def test_no_private_imports_across_packages() -> None:
    """A module imports another package's public names only (``from x import _y`` stays inside x's package)."""

    def package_of(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[0] == "mita_experiments" else parts[0]

    bad = {
        n: sorted(m for m in names if _private(m.rpartition(".")[2]) and package_of(m) != package_of(n))
        for n, names in NAMES.items()
    }
    assert not {k: v for k, v in bad.items() if v}, bad
