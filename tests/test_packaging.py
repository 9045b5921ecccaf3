"""Packaging, checked from the source tree without building (``scripts/wheel-check.sh`` builds).

- every non-Python file of a package (configs, C++ sources and headers) is matched by a
  ``[tool.setuptools.package-data]`` glob of its distribution, and every quoted ``#include`` of
  the C++ sources is such a file: the wheel carries what the code opens;
- every third-party import is declared: in ``src/mita`` by ``mita``'s dependencies or the extra
  of that package (timm -> ``[timm]``, transformers -> ``[hf]``; triton is optional and guarded),
  in ``experiments/src`` by ``mita-experiments``' dependencies or extras (an experiment package
  named like an extra by that extra);
- ``import mita`` imports no extra and no experiment; the build floor admits the metadata;
- CI runs the README's test command, first.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "src" / "mita").is_dir():
    pytest.skip("needs the source tree (a checkout)", allow_module_level=True)

#: distribution -> (its folder, its import package)
DISTS = {"mita": (ROOT, "mita"), "mita-experiments": (ROOT / "experiments", "mita_experiments")}
#: third-party packages that only an extra of mita brings: import name -> that extra
MITA_EXTRA_OF = {"timm": "timm", "transformers": "hf"}
#: imported only behind a check that they are installed (``find_spec`` or ``except ImportError``)
OPTIONAL = {"triton", "flash_attn"}
#: experiment packages named like an extra of mita-experiments, whose imports that extra must declare
EXPERIMENT_EXTRA = {"lra": "lra", "vision": "vision", "video": "video"}
#: import names whose distribution is named otherwise, for packages not installed here
KNOWN_DISTS = {"PIL": "pillow", "sklearn": "scikit-learn", "yaml": "pyyaml", "flash_attn": "flash-attn"}
DATA_SUFFIXES = (".json", ".cpp", ".cc", ".c", ".h", ".hpp", ".cuh", ".cu", ".txt", ".yaml", ".yml", ".csv")


def _pyproject(dist: str) -> dict:
    return tomllib.loads((DISTS[dist][0] / "pyproject.toml").read_text(encoding="utf-8"))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(req: str) -> tuple[str, set[str]]:
    """'mita[timm]==0.1.0; python_version>"3"' -> ('mita', {'timm'})."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
    assert m, f"cannot read the requirement {req!r}"
    return _norm(m.group(1)), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


def _declared(dist: str, extras: set[str] = frozenset(), seen: set | None = None) -> set[str]:
    """Normalized names of what ``dist[extras]`` declares, references to mita / mita-experiments followed."""
    seen = set() if seen is None else seen
    if (dist, frozenset(extras)) in seen:
        return set()
    seen.add((dist, frozenset(extras)))
    project = _pyproject(dist)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {})[extra]
    names = set()
    for req in reqs:
        name, sub = _requirement(req)
        names.add(name)
        if name in DISTS:
            names |= _declared(name, sub, seen)
    return names


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # import name -> distributions (slow: once)


def _dists_of(module: str) -> set[str]:
    found = _installed().get(module) or [KNOWN_DISTS.get(module, module)]
    return {_norm(d) for d in found}


def _package_dirs(dist: str) -> dict[str, Path]:
    folder, top = DISTS[dist]
    base = folder / "src"
    return {
        ".".join(p.parent.relative_to(base).parts): p.parent
        for p in (base / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def _package_data(dist: str) -> dict[str, set[Path]]:
    """Glob -> the files it matches, as setuptools applies ``[tool.setuptools.package-data]``."""
    globs = _pyproject(dist).get("tool", {}).get("setuptools", {}).get("package-data", {})
    packages = _package_dirs(dist)
    matched = {}
    for key, patterns in globs.items():
        folders = packages.values() if key in ("", "*") else [packages[key]]
        for pattern in patterns:
            matched[f"{key}: {pattern}"] = {f for d in folders for f in d.glob(pattern) if f.is_file()}
    return matched


def _data_files(dist: str) -> set[Path]:
    folder, top = DISTS[dist]
    return {
        p
        for p in (folder / "src" / top).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".pyc")
    }


def _py_files(dist: str) -> list[Path]:
    folder, top = DISTS[dist]
    return sorted(p for p in (folder / "src" / top).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("dist", DISTS)
def test_every_data_file_is_package_data(dist):
    matched = _package_data(dist)
    shipped = set().union(*matched.values()) if matched else set()
    missing = sorted(str(p.relative_to(ROOT)) for p in _data_files(dist) - shipped)
    assert not missing, f"{dist}: not matched by any package-data glob (so not in the wheel): {missing}"
    stale = [glob for glob, files in matched.items() if not files]
    assert not stale, f"{dist}: package-data globs that match no file: {stale}"


@pytest.mark.parametrize("dist", DISTS)
def test_files_the_code_names_are_package_data(dist):
    """File names in the code (``"fused_cpu.cpp"``, ``"recall.json"``) and the C++ sources' quoted
    ``#include``s: each that is a file of the package ships; each include exists."""
    matched = _package_data(dist)
    shipped = {p.resolve() for files in matched.values() for p in files}
    data = _data_files(dist)
    by_name: dict[str, set[Path]] = {}
    for p in data:
        by_name.setdefault(p.name, set()).add(p)
    named = set()
    for py in _py_files(dist):
        for node in ast.walk(ast.parse(py.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(DATA_SUFFIXES):
                named |= by_name.get(Path(node.value).name, set())
    problems = [
        f"{p.relative_to(ROOT)} (named in the code) is not package data" for p in named if p.resolve() not in shipped
    ]
    for source in (p for p in data if p.suffix in (".cpp", ".cc", ".c", ".h", ".hpp", ".cu", ".cuh")):
        for include in re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(encoding="utf-8"), re.M):
            header = (source.parent / include).resolve()
            if not header.is_file():
                problems.append(f'{source.relative_to(ROOT)}: #include "{include}" is no file beside it')
            elif header not in shipped:
                problems.append(f'{source.relative_to(ROOT)}: #include "{include}" is not package data')
    assert not problems, "\n".join(problems)


def _module_name(dist: str, path: Path) -> str:
    parts = path.relative_to(DISTS[dist][0] / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class _Imports(ast.NodeVisitor):
    """Every import of a module: (absolute module name, line, in a function, under ``try/except ImportError``)."""

    def __init__(self, module: str, is_package: bool):
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, int, bool, bool]] = []
        self._function = 0
        self._guarded = 0

    def _function_body(self, node):
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function_body

    def visit_Try(self, node):
        catches = {ast.unparse(h.type) if h.type else "" for h in node.handlers}
        guarded = bool(catches & {"", "ImportError", "ModuleNotFoundError", "Exception"}) or any(
            "ImportError" in c for c in catches
        )
        self._guarded += guarded
        for stmt in node.body:
            self.visit(stmt)
        self._guarded -= guarded
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def visit_If(self, node):
        if "TYPE_CHECKING" in ast.unparse(node.test):  # never runs
            return self.generic_visit(ast.Module(body=node.orelse, type_ignores=[]))
        self.generic_visit(node)

    def _add(self, name: str, line: int):
        self.found.append((name, line, self._function > 0, self._guarded > 0))

    def visit_Import(self, node):
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node):
        if node.level == 0:
            self._add(node.module, node.lineno)
            return
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)]
        module = ".".join([*base, node.module] if node.module else base)
        self._add(module, node.lineno)
        for alias in node.names:  # `from . import attention`: a submodule, maybe
            self._add(f"{module}.{alias.name}", node.lineno)


def _imports(dist: str) -> dict[str, tuple[Path, list[tuple[str, int, bool, bool]]]]:
    out = {}
    for py in _py_files(dist):
        name = _module_name(dist, py)
        visitor = _Imports(name, py.name == "__init__.py")
        visitor.visit(ast.parse(py.read_text(encoding="utf-8")))
        out[name] = (py, visitor.found)
    return out


def _third_party(module: str) -> str | None:
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in {d[1] for d in DISTS.values()} or top == "__future__":
        return None
    return top


def _guard_problems(dist: str, imports: dict) -> list[str]:
    """An optional package is imported under ``try/except ImportError``, or behind a ``find_spec`` of
    it: in a function, or in a module that the rest of the distribution imports only in functions."""
    sources = {name: py.read_text(encoding="utf-8") for name, (py, _) in imports.items()}
    eager = {target for _, found in imports.values() for target, _, lazy, _ in found if not lazy}
    problems = []
    for name, (py, found) in imports.items():
        for target, line, lazy, guarded in found:
            top = _third_party(target)
            if top not in OPTIONAL or guarded:
                continue
            checked = any(re.search(rf"find_spec\(\s*['\"]{top}['\"]", text) for text in sources.values())
            if not checked:
                problems.append(f"{py.relative_to(ROOT)}:{line}: {top} is imported but never checked with find_spec")
            elif not lazy and name in eager:
                problems.append(f"{py.relative_to(ROOT)}:{line}: imports {top}, and is itself imported eagerly")
    return problems


def test_mita_imports_are_declared():
    base = _declared("mita")
    imports = _imports("mita")
    problems = _guard_problems("mita", imports)
    for _, (py, found) in imports.items():
        for target, line, _, _ in found:
            top = _third_party(target)
            if top is None or top in OPTIONAL:
                continue
            where = f"{py.relative_to(ROOT)}:{line}: {top}"
            if top in MITA_EXTRA_OF:
                extra = MITA_EXTRA_OF[top]
                if not _dists_of(top) & _declared("mita", {extra}) - base:
                    problems.append(f"{where} is not declared by mita[{extra}] (or is a base dependency too)")
            elif not _dists_of(top) & base:
                problems.append(f"{where} ({_dists_of(top)}) is not a dependency of mita; declare it or add an extra")
            if target.split(".")[0] == "mita_experiments":
                problems.append(f"{where}: the library imports an experiment")
    assert not problems, "\n".join(problems)


def test_experiment_imports_are_declared():
    extras = set(_pyproject("mita-experiments")["project"].get("optional-dependencies", {}))
    everything = _declared("mita-experiments", extras)
    imports = _imports("mita-experiments")
    problems = _guard_problems("mita-experiments", imports)
    for name, (py, found) in imports.items():
        area = name.split(".")[1] if "." in name else ""
        for target, line, _, _ in found:
            top = _third_party(target)
            if top is None or top in OPTIONAL:
                continue
            where = f"{py.relative_to(ROOT)}:{line}: {top} ({', '.join(sorted(_dists_of(top)))})"
            if not _dists_of(top) & everything:
                problems.append(f"{where} is declared by neither mita-experiments' dependencies nor an extra")
            elif area in EXPERIMENT_EXTRA:
                extra = EXPERIMENT_EXTRA[area]
                if not _dists_of(top) & _declared("mita-experiments", {extra}):
                    problems.append(f"{where}: mita_experiments.{area} needs it, mita-experiments[{extra}] lacks it")
    assert not problems, "\n".join(problems)


def test_import_mita_imports_no_extra_and_no_experiment():
    """In a fresh interpreter (the test session has imported timm already): the library's import and
    an op call load none of the extras' packages or the experiments. (Not triton: torch's own
    ``torch._dynamo`` imports it where it is installed; mita's imports of it are checked statically.)"""
    code = (
        "import sys, torch, mita\n"
        "from mita import attention\n"
        "q = torch.randn(1, 2, 16, 8)\n"
        "mita.mita_attention(q, q, q, num_landmarks=2, topk=4, impl='grouped')\n"
        "attention.build_op('sdpa')(q, q, q)\n"
        "blocked = ('timm', 'transformers', 'mita_experiments', 'flash_attn')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in blocked))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", f"import mita loaded: {out.stdout}"


@pytest.mark.parametrize("dist", DISTS)
def test_build_floor_admits_the_metadata(dist):
    """``license = "MIT"`` (a PEP 639 expression) and ``license-files`` need setuptools >= 77."""
    meta = _pyproject(dist)
    project = meta["project"]
    requires = meta["build-system"]["requires"]
    if isinstance(project.get("license"), str) or "license-files" in project:
        floors = [m.group(1) for r in requires if (m := re.fullmatch(r"setuptools\s*>=\s*([0-9.]+)", r.strip()))]
        assert floors, f"{dist}: [build-system] requires {requires}, no setuptools>= floor"
        assert tuple(int(x) for x in floors[0].split(".")) >= (77,), f"{dist}: setuptools>={floors[0]} < 77"
    for pattern in project.get("license-files", []):
        assert list(DISTS[dist][0].glob(pattern)), f"{dist}: license-files {pattern!r} matches no file"


def test_ci_runs_the_readme_test_command_first():
    """``.ci/run`` calls the README's test command (its second code line) exactly, before the
    wheel check and the docs build."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```[a-z]*\n(.*?)```", readme, re.S)
    assert block, "README.md has no code block"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) >= 2 and "pytest" in lines[1], f"the README's second code line is no test command: {lines}"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    ci = [line for line in ci if not line.startswith("#")]
    assert lines[1].strip() in ci, f".ci/run does not run the README's test command {lines[1]!r}"
    first = ci.index(lines[1].strip())
    later = [i for i, line in enumerate(ci) if "wheel-check" in line or "mkdocs" in line]
    assert all(i > first for i in later), ".ci/run must run the README's test command first"
