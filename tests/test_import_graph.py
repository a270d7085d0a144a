"""No import cycle between the subpackages of stapo_megatron.

The graph is read from the source with ``ast``: every import statement, at module level or inside a
function (a lazy import hides a cycle from the interpreter until the function runs, but the two
packages still depend on each other). A node is a subpackage (``config``, ``trainer``, ...); the
top-level modules (``stapo_megatron.cli``) are the entry points above them and not nodes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import stapo_megatron

PACKAGE_DIR = Path(stapo_megatron.__file__).parent
PACKAGE = PACKAGE_DIR.name


def _subpackage(module: str, package_dir: Path) -> str | None:
    """``config`` for ``stapo_megatron.config.core``; None for anything outside a subpackage."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or not (package_dir / parts[1]).is_dir():
        return None
    return parts[1]


def _module_name(path: Path, package_dir: Path) -> str:
    return ".".join(path.relative_to(package_dir.parent).with_suffix("").parts)


def _imported_modules(path: Path, package_dir: Path) -> list[tuple[str, int]]:
    """The absolute names of the modules a file imports, each with its line."""
    module = _module_name(path, package_dir)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # ``from stapo_megatron import trainer`` imports the subpackage itself
            found += [(name, node.lineno)] + [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
    return found


def subpackage_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, dict[str, str]]:
    """subpackage -> {subpackage it imports: the first place that does, ``path:line``}."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        source = _subpackage(_module_name(path, package_dir), package_dir)
        if source is None:
            continue
        edges = graph.setdefault(source, {})
        for name, line in _imported_modules(path, package_dir):
            target = _subpackage(name, package_dir)
            if target is not None and target != source:
                edges.setdefault(target, f"{path.relative_to(package_dir.parent)}:{line}")
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str]:
    """One cycle of ``graph`` as its nodes, the first repeated at the end; [] when there is none."""
    state: dict[str, str] = {}  # node -> "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_graph_is_read_from_lazy_and_relative_imports(tmp_path):
    package = tmp_path / PACKAGE
    for name in ("alpha", "beta", "gamma"):
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "alpha" / "a.py").write_text(f"def f():\n    from {PACKAGE}.beta import b\n")
    (package / "beta" / "b.py").write_text("from ..gamma import c\n")
    (package / "gamma" / "c.py").write_text(f"import {PACKAGE}.alpha.a\n")
    graph = subpackage_graph(package)
    assert graph == {
        "alpha": {"beta": f"{PACKAGE}/alpha/a.py:2"},
        "beta": {"gamma": f"{PACKAGE}/beta/b.py:1"},
        "gamma": {"alpha": f"{PACKAGE}/gamma/c.py:1"},
    }
    assert find_cycle(graph) == ["alpha", "beta", "gamma", "alpha"]
    del graph["gamma"]["alpha"]
    assert find_cycle(graph) == []


def test_no_import_cycle_between_subpackages():
    graph = subpackage_graph()
    assert {"config", "runtime", "models", "loss", "trainer"} <= set(graph)
    cycle = find_cycle(graph)
    where = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    assert not cycle, "import cycle between subpackages:\n" + "\n".join(where)
