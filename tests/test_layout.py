"""The package layout DESIGN names: layers import only those below them, no module-level import
cycle, and no module imports another's private names."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> the package it installs as (pyproject.toml's package-dir).
FOLDERS = {"servekit": "servekit", "handlers": "servekit.handlers", "optimizations": "servekit.optimizations",
           "benchmarks": "servekit.benchmarks"}
# Each layer and the packages it must never import (DESIGN.md: runtime < serving < client < tooling).
FORBIDDEN = {
    "servekit.optimizations": ("servekit.handlers", "servekit.benchmarks", "servekit.cli", "servekit.torchserve",
                               "ts"),
    "servekit.handlers": ("servekit.benchmarks", "servekit.cli"),
}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports(path: Path, top_level_only: bool) -> list[tuple[str, list[str]]]:
    """(module, names) of each `import` / `from ... import` in the file; with `top_level_only`,
    those executed at import time (not inside functions or `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = False
            if isinstance(child, ast.Import) and (inner or not top_level_only):
                found.extend((a.name, []) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0 and (inner or not top_level_only):
                found.append((child.module, [a.name for a in child.names]))
            visit(child, inner)

    visit(tree, True)
    return found


MODULES = modules()


def test_no_module_imports_another_modules_private_names() -> None:
    bad = [f"{name}: from {mod} import {n}" for name, path in MODULES.items()
           for mod, names in imports(path, top_level_only=False) if mod.startswith("servekit") and mod != name
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_those_below(layer: str) -> None:
    bad = [f"{name} imports {mod}" for name, path in MODULES.items() if name.startswith(layer)
           for mod, _ in imports(path, top_level_only=False)
           if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[layer])]
    assert not bad, "\n".join(bad)


def test_no_import_cycle_at_import_time() -> None:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for mod, names in imports(path, top_level_only=True):
            # `from pkg import sub` imports the submodule pkg.sub where there is one.
            targets = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES] or [mod]
            deps.update(t for t in targets if t in MODULES and t != name)
        graph[name] = deps
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                cycle = walk(dep)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_class_defines_a_method_twice() -> None:
    """A second `def` of the same name silently replaces the first: the embedding runner once had two
    `embed`s, and every served batch took the per-request retry path for it."""
    twice = []
    for path in sorted(p for top in ("handlers", "optimizations", "servekit", "benchmarks")
                       for p in (ROOT / top).rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef)):
                continue
            seen: set[str] = set()
            for item in node.body:
                if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                # property setters and registrations (singledispatch, custom ops' fakes) reuse names on purpose
                if any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter", "register", "register_fake")
                       for d in item.decorator_list):
                    continue
                if item.name in seen:
                    twice.append(f"{path.relative_to(ROOT)}:{item.lineno} {getattr(node, 'name', '<module>')}.{item.name}")
                seen.add(item.name)
    assert not twice, twice
