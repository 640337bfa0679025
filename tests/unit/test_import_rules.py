"""The import rules of docs/architecture.md, checked on the source: every import statement,
including function-local ones and those under ``if TYPE_CHECKING:``.

Between packages: each may import only the packages of its row; the app (``rlhf_run``) may
import every component and nothing imports it. Inside a package: the modules import each other
one way, without a cycle.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("rlhf_core", "buffer", "weight_server", "rollout_workers", "learner", "gateway")
APP = "rlhf_run"
PACKAGES = (*COMPONENTS, APP)
ALLOWED = {
    "rlhf_core": set(),
    "buffer": {"rlhf_core"},
    "weight_server": {"rlhf_core"},
    "rollout_workers": {"rlhf_core", "buffer", "weight_server"},
    "learner": {"rlhf_core", "buffer", "weight_server"},
    "gateway": {"rlhf_core", "buffer"},
    APP: set(COMPONENTS),
}


def module_name(path: Path, root: Path) -> str:
    """``buffer/client.py`` -> ``buffer.client``; ``buffer/__init__.py`` -> ``buffer``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path) -> set[str]:
    """Dotted names of every module an import statement anywhere in the file names. For
    ``from X import y`` that is ``X.y`` when ``y`` is a module under ``root``, else ``X``
    (``from buffer import keys`` depends on ``buffer.keys``, not on ``buffer/__init__``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x`, `from ..y import z`
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            else:
                base = node.module.split(".")
            for alias in node.names:
                sub = root.joinpath(*base, alias.name)
                is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
                found.add(".".join([*base, alias.name] if is_module else base))
    return found


def python_files(pkg: str, root: Path) -> list[Path]:
    return sorted((root / pkg).rglob("*.py"))


def project_imports(pkg: str, root: Path = ROOT) -> dict[str, set[str]]:
    """{file: {project packages it imports}} for every .py file in ``root/pkg``."""
    return {
        str(path.relative_to(root)): {m.split(".")[0] for m in imported_modules(path, root)} & set(PACKAGES)
        for path in python_files(pkg, root)
    }


def forbidden_imports(pkg: str, root: Path = ROOT) -> dict[str, list[str]]:
    """{file: [packages it imports against its row of ALLOWED]} (empty when the rule holds)."""
    allowed = ALLOWED[pkg] | {pkg}
    return {f: sorted(names - allowed) for f, names in project_imports(pkg, root).items() if names - allowed}


def module_graph(pkg: str, root: Path = ROOT) -> dict[str, set[str]]:
    """{module: {modules of the same package it imports}}. Importing ``pkg.a`` also runs
    ``pkg/__init__``, but that is Python's loading order, not a dependency: only what a
    module names counts (``from pkg import Name`` names ``pkg`` itself)."""
    files = python_files(pkg, root)
    modules = {module_name(p, root) for p in files}
    return {
        module_name(p, root): (imported_modules(p, root) & modules) - {module_name(p, root)}
        for p in files
    }


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): the module sets
    inside which every module reaches every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per tangle, written as a path that starts and ends at the same module."""
    return sorted(_cycle_in(graph, component) for component in tangles(graph))


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside it)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")  # Tarjan said there is one


# ---------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("pkg", PACKAGES)
def test_import_rule(pkg):
    assert python_files(pkg, ROOT), f"no python files found in {pkg}"
    bad = forbidden_imports(pkg)
    assert bad == {}, f"{pkg} may import only {sorted(ALLOWED[pkg])}; these files import more: {bad}"


@pytest.mark.parametrize("pkg", COMPONENTS)
def test_no_component_imports_the_app(pkg):
    # the roles never know the app exists: they run the same under another launcher
    importers = sorted(f for f, names in project_imports(pkg).items() if APP in names)
    assert importers == [], f"{APP} is the app on top; components must not import it: {importers}"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_cycle_inside_a_package(pkg):
    graph = module_graph(pkg)
    cycles = import_cycles(graph)
    assert not cycles, (
        f"{pkg} has import cycles (type-only and function-local imports count): "
        + "; ".join(" -> ".join(c) for c in cycles)
        + f" (modules tangled together: {sorted(sorted(t) for t in tangles(graph))}). "
        "Move what both sides need into a lower module, or pass it in."
    )


#: what the planner (``rlhf_run/plan/``) imports: the leaf and itself, so the simulation and the
#: search run without the components or the launcher; three modules reach further by their job:
#: measure.py times the real stages, machine.py fits contention to real runs, fromrun.py reads a
#: run's timeline.jsonl
PLAN_ALLOWED = {"rlhf_core", "rlhf_run.plan"}
PLAN_REACHES = {
    "rlhf_run/plan/measure.py": {"buffer", "learner", "rollout_workers", "weight_server"},
    "rlhf_run/plan/machine.py": {"rlhf_run.launch"},
    "rlhf_run/plan/fromrun.py": {"rlhf_run.progress"},
}


def test_the_planner_depends_only_on_the_leaf():
    def unit(module: str) -> str:  # rlhf_run.plan.des -> rlhf_run.plan, buffer.keys -> buffer
        parts = module.split(".")
        return ".".join(parts[:2]) if parts[0] == APP else parts[0]

    found = {str(p.relative_to(ROOT)): {unit(m) for m in imported_modules(p, ROOT) if m.split(".")[0] in PACKAGES}
             for p in python_files(f"{APP}/plan", ROOT)}
    extra = {f: sorted(names - PLAN_ALLOWED - PLAN_REACHES.get(f, set())) for f, names in found.items()}
    assert {f: names for f, names in extra.items() if names} == {}, (
        f"rlhf_run/plan may import only {sorted(PLAN_ALLOWED)} (and what PLAN_REACHES names for its modules)")


# ---------------------------------------------------------------------------- the checkers


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_sees_imports(tmp_path):
    # the real checker, pointed at a made-up tree: it must notice every kind of forbidden import,
    # or the rule test could never fail
    _write(tmp_path, {
        "buffer/__init__.py": "from buffer.keys import RunKeys\n",
        "buffer/keys.py": "import rlhf_core.wire\nfrom . import scripts\n",
        "buffer/scripts.py": (
            "from typing import TYPE_CHECKING\n"
            "from learner.lm_head import x\n"
            "import rollout_workers.engine\n"
            "if TYPE_CHECKING:\n    from weight_server import WeightServer\n"
            "def later():\n    from rlhf_run import launch\n"
        ),
        "learner/trainer.py": "from rlhf_run.summary import SUMMARY_FILE\nfrom buffer import LearnerClient\n",
    })
    assert forbidden_imports("buffer", tmp_path) == {
        "buffer/scripts.py": ["learner", "rlhf_run", "rollout_workers", "weight_server"],
    }
    assert forbidden_imports("learner", tmp_path) == {"learner/trainer.py": ["rlhf_run"]}
    assert forbidden_imports(APP, tmp_path) == {}  # no such folder: nothing to complain about


def test_cycle_checker_sees_type_only_and_local_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.client import Client\nfrom pkg.metrics import snap\n",
        "pkg/client.py": "from pkg import keys\nfrom pkg.prompts import claim\n",
        "pkg/keys.py": "PREFIX = 'p'\n",
        # a type-only import back up to the facade
        "pkg/prompts.py": (
            "from typing import TYPE_CHECKING\nfrom .keys import PREFIX\n"
            "if TYPE_CHECKING:\n    from pkg.client import Client\n"
        ),
        # a function-local import of a name the package re-exports
        "pkg/metrics.py": "def snap():\n    from pkg import Client\n",
    })
    graph = module_graph("pkg", tmp_path)
    assert graph == {
        "pkg": {"pkg.client", "pkg.metrics"},
        "pkg.client": {"pkg.keys", "pkg.prompts"},  # `from pkg import keys` names the module, not pkg
        "pkg.keys": set(),
        "pkg.prompts": {"pkg.keys", "pkg.client"},
        "pkg.metrics": {"pkg"},
    }
    assert import_cycles(graph) == [["pkg", "pkg.metrics", "pkg"], ["pkg.client", "pkg.prompts", "pkg.client"]]
    graph["pkg.prompts"].discard("pkg.client")
    graph["pkg.metrics"].clear()
    assert import_cycles(graph) == []
    # a longer cycle is written out in order, and only its members are named
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert tangles(graph) == [{"a", "b", "c"}]


# ---------------------------------------------------------------------------- every package loads


@pytest.mark.parametrize("pkg", PACKAGES)
def test_all_packages_import(pkg):
    """Every module of every package imports (a moved module leaves no stale import behind), and
    every name a package's ``__all__`` promises exists."""
    for path in python_files(pkg, ROOT):
        name = module_name(path, ROOT)
        if name.endswith("__main__"):
            continue  # runs the entry point on import
        importlib.import_module(name)
    module = importlib.import_module(pkg)
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert missing == [], f"{pkg}.__all__ promises names it does not have: {missing}"
