"""Layering, read from the source with `ast` (imports inside functions count: a lazy import is still
an import): no import circle among forgepack's modules, the pack runtime imports nothing of forgepack
outside itself, and `forgepack/pack/__init__.py` imports nothing (so reading a manifest does not load
the builder, the gate and the shim generator)."""

from __future__ import annotations

import ast
from pathlib import Path

import forgepack

ROOT = Path(forgepack.__file__).resolve().parent
RUNTIME = "forgepack.runtime"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py")) if "templates/kernels" not in p.as_posix()}


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str) -> list[tuple[str, int, int]]:
    """(imported forgepack module, relative level, line) for every import statement in the module."""
    found = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package(name).split(".")
                package = package[:len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
            if len(targets) < len(node.names):
                targets.append(base)
            found += [(t, node.level, node.lineno) for t in targets]
    return [(t, level, line) for t, level, line in found if t == "forgepack" or t.startswith("forgepack.")]


GRAPH = {name: sorted({t for t, _, _ in _imports(name) if t in MODULES and t != name}) for name in MODULES}


def _cycle(graph: dict[str, list[str]]) -> list[str]:
    """One import circle (its modules, the first repeated at the end), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in graph:
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_the_walk_sees_the_package():
    assert {"forgepack.opcall", "forgepack.fusion", "forgepack.runtime.graphs", "forgepack.pack.gate"} <= set(MODULES)
    assert "forgepack.runtime.stockcall" in GRAPH["forgepack.opcall"]
    # relative imports resolve, and imports inside functions count
    assert "forgepack.runtime.graphkeys" in GRAPH["forgepack.runtime.graphs"]
    assert "forgepack.runtime.modules" in GRAPH["forgepack.runtime"]  # `from . import modules` in a function


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_no_import_circle_among_forgepack_modules():
    assert _cycle(GRAPH) == [], " -> ".join(_cycle(GRAPH))


def test_the_runtime_imports_nothing_of_forgepack_outside_itself():
    for name in (m for m in MODULES if m == RUNTIME or m.startswith(RUNTIME + ".")):
        for target, level, line in _imports(name):
            where = f"{MODULES[name].relative_to(ROOT.parent)}:{line}"
            assert target == RUNTIME or target.startswith(RUNTIME + "."), f"{where} imports {target}"
            # inside a pack the runtime is `forgepack_pack_<name>`: only relative imports reach it there
            assert level == 1, f"{where} imports {target} by its forgepack name"


def test_the_pack_package_imports_nothing():
    assert _imports("forgepack.pack") == []


def test_fusion_does_not_load_the_pack_builder():
    """What importing `forgepack.fusion` loads, parent packages included (Python runs each one's
    `__init__`), holds nothing of the wheel builder, the gate or the shim generator."""
    seen, todo = set(), ["forgepack.fusion"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += GRAPH[name] + [p for p in parents if p in MODULES]
    assert not seen & {"forgepack.pack.builder", "forgepack.pack.gate", "forgepack.pack.shimgen"}, sorted(seen)
