"""The jaxquant import graph has no circles (issue 30).

The static check reads every ``import`` statement of every module, function-level (lazy) imports
included, so a circle hidden behind a deferred import is caught too. The subprocess check imports
the modules that once formed a circle (``group_table`` <-> ``ops``) in fresh interpreters.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxquant"


def _module_files() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the jaxquant modules it imports anywhere in its source (``from pkg import mod``
    counts as importing ``pkg.mod``; ``from pkg import name`` as importing ``pkg``)."""
    files = _module_files()
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    mod = ".".join(pkg + ([mod] if mod else []))
                for alias in node.names:
                    if f"{mod}.{alias.name}" in files:
                        deps.add(f"{mod}.{alias.name}")
                    elif mod in files:
                        deps.add(mod)
        deps.discard(name)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle [a, b, ..., a] of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_find_cycle_detects_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_group_table_does_not_import_ops():
    graph = import_graph()
    assert "jaxquant.primitives.ops" not in graph["jaxquant.zero.group_table"]
    assert "jaxquant.zero.group_table" in graph["jaxquant.primitives.ops"]


def test_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 20, sorted(graph)  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["jaxquant.zero.group_table", "jaxquant.primitives.ops",
                                    "jaxquant.primitives.formats"])
def test_module_imports_in_a_fresh_interpreter(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
