"""The package's import graph: dependencies point one way (ops -> layers -> models -> integrations)."""

from __future__ import annotations

import ast
from pathlib import Path

import mita

ROOT = Path(mita.__file__).parent
ABOVE_OPS = ("mita.layers", "mita.models", "mita.integrations", "mita.attention", "mita.registrations")


def _module_name(path: Path) -> str:
    parts = ("mita", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}
PACKAGES = {_module_name(p) for p in ROOT.rglob("__init__.py")}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(name: str) -> set[str]:
    """The mita modules ``name`` imports anywhere (function bodies too; ``if TYPE_CHECKING`` blocks aside)."""
    path = MODULES[name]
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
    return {m for m in found if m in MODULES}


GRAPH = {name: imports(name) for name in MODULES}


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
    bad = {
        name: sorted(m for m in deps if m.startswith(ABOVE_OPS))
        for name, deps in GRAPH.items()
        if name.startswith("mita.ops")
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def test_layers_import_no_models_or_integrations() -> None:
    above = ("mita.models", "mita.integrations", "mita.attention", "mita.registrations")
    bad = {n: sorted(m for m in d if m.startswith(above)) for n, d in GRAPH.items() if n.startswith("mita.layers")}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_graph_sees_the_imports() -> None:
    """The checks above are only as good as the parser: a known edge and a known absence."""
    assert "mita.ops.agent" in GRAPH["mita.layers.agent"]
    assert "mita.ops.pooling" in GRAPH["mita.ops.mita.grouped"]
    assert "mita.layers.agent" not in GRAPH["mita.ops.agent"]


def test_utils_import_only_utils() -> None:
    """``mita.utils`` is below everything: it may import torch and the standard library, no other mita module."""
    bad = {
        n: sorted(m for m in d if not m.startswith("mita.utils"))
        for n, d in GRAPH.items()
        if n.startswith("mita.utils")
    }
    assert GRAPH.get("mita.utils.checkpoint") and not {k: v for k, v in bad.items() if v}, bad
