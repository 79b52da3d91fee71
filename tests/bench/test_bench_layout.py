"""bench/'s layout: scripts import shared helpers from bench/common.py (or a library module of their own, one
without ``__main__``), never another script; every module stays at most 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted((REPO / "bench").rglob("*.py"))
MAX_LINES = 400


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_bench_script_imports_another():
    scripts = {path.stem: path for path in MODULES if '__name__ == "__main__"' in path.read_text()}
    assert {"compare", "merge_trees", "soak"} <= set(scripts) and "common" not in scripts
    for path in MODULES:
        imported = imported_names(path) & set(scripts)
        assert not imported, f"{path.relative_to(REPO)} imports the script(s) {sorted(imported)}: use bench/common.py"


def test_bench_modules_are_at_most_400_lines():
    for path in MODULES:
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_LINES, f"{path.relative_to(REPO)}: {lines} lines (split it by job)"
