"""The size rules of the code (DEVELOPERS.md, "How we write code"; issue 53): no module over 400 lines and no
function over 80 in the package, the services and the benchmarks. The Triton kernels (kernels/) and generated
protobuf modules are aside. A module or function that grows past them is split along a real seam."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("src", "services", "bench")
MODULE_LINES, FUNCTION_LINES = 400, 80


def _modules() -> list[Path]:
    return [
        p
        for root in ROOTS
        for p in sorted((REPO / root).rglob("*.py"))
        if not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


def test_no_module_over_400_lines():
    modules = _modules()
    assert len(modules) > 100, "the roots moved: update ROOTS"
    long = {str(p.relative_to(REPO)): n for p in modules if (n := p.read_text().count("\n")) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def test_no_function_over_80_lines():
    long = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and (n := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
                long[f"{p.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {FUNCTION_LINES} lines: {long}"
