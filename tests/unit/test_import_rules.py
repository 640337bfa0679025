"""The import rule of docs/architecture.md, checked on the source (every import statement)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf_core", "buffer", "weight_server", "rollout_workers", "learner")
ALLOWED = {
    "rlhf_core": set(),
    "buffer": {"rlhf_core"},
    "weight_server": {"rlhf_core"},
    "rollout_workers": {"rlhf_core", "buffer", "weight_server"},
    "learner": {"rlhf_core", "buffer", "weight_server"},
}


def project_imports(pkg: str) -> dict[str, set[str]]:
    """{file: {project packages it imports}} for every .py file in pkg."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names & set(PACKAGES)
    return found


@pytest.mark.parametrize("pkg", PACKAGES)
def test_import_rule(pkg):
    files = project_imports(pkg)
    assert files, f"no python files found in {pkg}"
    bad = {f: sorted(names - ALLOWED[pkg] - {pkg}) for f, names in files.items() if names - ALLOWED[pkg] - {pkg}}
    assert bad == {}, f"{pkg} may import only {sorted(ALLOWED[pkg])}"


def test_checker_sees_imports(tmp_path):
    # the checker itself must notice a forbidden import, or the rule test could never fail
    tree = ast.parse("from learner.losses import x\nimport rollout_workers.engine\n")
    names = {n.module.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names |= {a.name.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"learner", "rollout_workers"}


def test_all_packages_import():
    import buffer, learner, rollout_workers, weight_server  # noqa: F401,E401
