"""No import cycle in stapo_megatron: between its files, and between its subpackages.

The graph is read from the source with ``ast``: every import statement, at module level or inside a
function (a lazy import hides a cycle from the interpreter until the function runs, but the two
files still depend on each other) or under ``TYPE_CHECKING``. A file is a node by its module name
(``stapo_megatron.config.core``; a package's ``__init__.py`` by the package's name). An import names
the module it imports and, for ``from m import x``, ``m.x`` when that is a module of its own; the
packages above the named module, which Python also runs, are left out: a package that re-exports
its modules would otherwise close a cycle with each of them. For the subpackage graph a node is a
subpackage (``config``, ``trainer``, ...); the top-level modules (``stapo_megatron.cli``) are the
entry points above them and not nodes.
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
    """``stapo_megatron.config.core`` for ``config/core.py``; ``stapo_megatron.config`` for its ``__init__.py``."""
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package_dir: Path) -> list[tuple[str, str | None, int]]:
    """Each import of the file as (absolute module, the name ``from`` takes of it or None, line)."""
    module = _module_name(path, package_dir)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found += [(name, alias.name, node.lineno) for alias in node.names]
    return found


def module_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, dict[str, str]]:
    """module -> {module of the package it imports: the first place that does, ``path:line``}.
    ``from m import x`` imports the module ``m.x`` when there is one (``from stapo_megatron import
    trainer`` imports the subpackage), else ``m``."""
    files = {_module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, dict[str, str]] = {}
    for source, path in files.items():
        edges = graph.setdefault(source, {})
        for name, taken, line in _imports(path, package_dir):
            target = f"{name}.{taken}" if taken and f"{name}.{taken}" in files else name
            if target in files and target != source:
                edges.setdefault(target, f"{path.relative_to(package_dir.parent)}:{line}")
    return graph


def subpackage_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, dict[str, str]]:
    """subpackage -> {subpackage it imports: the first place that does, ``path:line``}, from
    :func:`module_graph`."""
    graph: dict[str, dict[str, str]] = {}
    for source, edges in sorted(module_graph(package_dir).items()):
        outer = _subpackage(source, package_dir)
        if outer is None:
            continue
        found = graph.setdefault(outer, {})
        for target, where in edges.items():
            inner = _subpackage(target, package_dir)
            if inner is not None and inner != outer:
                found[inner] = min(found.get(inner, where), where, key=_place)
    return graph


def _place(where: str) -> tuple[str, int]:
    path, _, line = where.rpartition(":")
    return path, int(line)


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


def _said(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    return "\n".join(f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False))


def _write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / PACKAGE
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def test_the_graph_is_read_from_lazy_and_relative_imports(tmp_path):
    package = _write_package(
        tmp_path,
        {
            "alpha/__init__.py": "",
            "beta/__init__.py": "",
            "gamma/__init__.py": "",
            "alpha/a.py": f"def f():\n    from {PACKAGE}.beta import b\n",
            "beta/b.py": "from ..gamma import c\n",
            "gamma/c.py": f"import {PACKAGE}.alpha.a\n",
        },
    )
    graph = subpackage_graph(package)
    assert graph == {
        "alpha": {"beta": f"{PACKAGE}/alpha/a.py:2"},
        "beta": {"gamma": f"{PACKAGE}/beta/b.py:1"},
        "gamma": {"alpha": f"{PACKAGE}/gamma/c.py:1"},
    }
    assert find_cycle(graph) == ["alpha", "beta", "gamma", "alpha"]
    del graph["gamma"]["alpha"]
    assert find_cycle(graph) == []


def test_the_file_graph_sees_a_cycle_inside_one_subpackage(tmp_path):
    """Two files of one subpackage importing each other (one of them lazily, one under
    TYPE_CHECKING) are a cycle; a package re-exporting its own modules is not."""
    package = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "alpha/__init__.py": "from .a import f\nfrom .b import g\n",
            "alpha/a.py": f"from {PACKAGE}.alpha.b import g\n\ndef f():\n    return g()\n",
            "alpha/b.py": f"def g():\n    from {PACKAGE}.alpha import c\n",
            "alpha/c.py": f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {PACKAGE}.alpha.a import f\n",
        },
    )
    graph = module_graph(package)
    alpha = f"{PACKAGE}.alpha"
    assert graph[alpha] == {
        f"{alpha}.a": f"{PACKAGE}/alpha/__init__.py:1",
        f"{alpha}.b": f"{PACKAGE}/alpha/__init__.py:2",
    }
    assert graph[f"{alpha}.b"] == {f"{alpha}.c": f"{PACKAGE}/alpha/b.py:2"}
    assert find_cycle(graph) == [f"{alpha}.a", f"{alpha}.b", f"{alpha}.c", f"{alpha}.a"]
    assert subpackage_graph(package) == {"alpha": {}}


def test_no_import_cycle_between_subpackages():
    graph = subpackage_graph()
    assert {"config", "runtime", "models", "loss", "trainer"} <= set(graph)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle between subpackages:\n" + _said(graph, cycle)


def test_no_import_cycle_between_files():
    graph = module_graph()
    assert {f"{PACKAGE}.cli", f"{PACKAGE}.trainer.trainer", f"{PACKAGE}.checkpoint.dist"} <= set(graph)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle between files:\n" + _said(graph, cycle)
