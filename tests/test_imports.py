"""The jaxquant import graph has no circles, between modules or between packages, and imports only downward.

The static checks read every ``import`` statement of every module, function-level (lazy) imports
included, so a circle or an upward import hidden behind a deferred import is caught too. The layers, bottom up:
primitives <- zero <- (checkpoint) <- training <- tp <- cli; checkpoint imports nothing of training, tp or cli.
The subprocess check imports the lowest modules in fresh interpreters.
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


# Package -> the jaxquant packages its modules may import (besides its own). The top-level modules (the export
# table ``jaxquant``, ``__main__``) may import anything; below cli, nothing imports the export table.
LAYERS = {
    "primitives": set(),
    "zero": {"primitives"},
    "checkpoint": {"primitives", "zero"},
    "training": {"primitives", "zero", "checkpoint"},
    "tp": {"primitives", "zero", "checkpoint", "training"},
    "cli": {"primitives", "zero", "checkpoint", "training", "tp", "jaxquant"},
}


def package_of(module: str) -> str:
    """``jaxquant.zero.layout`` -> ``zero``; a top-level module is its own: ``jaxquant`` (the export table),
    ``__main__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """package -> the other packages its modules import."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        mine = package_of(module)
        out.setdefault(mine, set()).update(package_of(d) for d in deps if package_of(d) != mine)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import against ``LAYERS``."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if package_of(m) in LAYERS and package_of(d) != package_of(m)
                  and package_of(d) not in LAYERS[package_of(m)])


def test_find_cycle_detects_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_checks_catch_a_package_circle_and_an_upward_import():
    """Two modules that import no module of each other's but whose packages do (primitives.ops -> zero.x,
    zero.y -> primitives.z): a circle between the packages and an import against the layer order."""
    graph = {"jaxquant.primitives.ops": {"jaxquant.zero.x"}, "jaxquant.zero.x": set(),
             "jaxquant.zero.y": {"jaxquant.primitives.z"}, "jaxquant.primitives.z": set()}
    assert find_cycle(graph) is None
    assert find_cycle(package_graph(graph)) in (["primitives", "zero", "primitives"], ["zero", "primitives", "zero"])
    assert upward_imports(graph) == ["jaxquant.primitives.ops -> jaxquant.zero.x"]
    assert upward_imports({"jaxquant.checkpoint.a": {"jaxquant.training.b"}, "jaxquant.training.b": set()}) == [
        "jaxquant.checkpoint.a -> jaxquant.training.b"]
    assert upward_imports({"jaxquant.zero.a": {"jaxquant"}, "jaxquant": set()}) == ["jaxquant.zero.a -> jaxquant"]


def test_import_graph_has_no_circle():
    graph = import_graph()
    assert len(graph) > 20, sorted(graph)  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_packages_import_each_other_without_a_circle():
    cycle = find_cycle(package_graph(import_graph()))
    assert cycle is None, "package circle: " + " -> ".join(cycle)


def test_packages_import_only_downward():
    graph = import_graph()
    assert {package_of(m) for m in graph} == set(LAYERS) | {"jaxquant", "__main__"}   # every package has its layer
    assert upward_imports(graph) == []


def defines(path: pathlib.Path, name: str) -> bool:
    """Whether the module at ``path`` defines ``name`` at top level (a def, a class or an assignment; an import
    is a re-export, not a definition)."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def test_the_export_table_names_the_module_that_defines_each_name():
    import jaxquant
    files = _module_files()
    assert defines(files["jaxquant.training.policy"], "TrainState")
    assert not defines(files["jaxquant.training.dense"], "split_master")   # imported there, not defined
    wrong = [f"{name}: {module}" for name, module in jaxquant._EXPORTS.items()
             if name not in jaxquant._MODULES and not defines(files[module], name)]
    assert wrong == []
    assert all(module in files for module in jaxquant._EXPORTS.values())


@pytest.mark.parametrize("module", ["jaxquant.primitives.ops.table", "jaxquant.primitives.ops",
                                    "jaxquant.primitives.formats"])
def test_module_imports_in_a_fresh_interpreter(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
