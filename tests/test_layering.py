"""Layering, read from the source with `ast` (imports inside functions count: a lazy import is still
an import): no import circle among forgepack's modules, the pack runtime imports nothing of forgepack
outside itself, and `forgepack/pack/__init__.py` imports nothing (so reading a manifest does not load
the builder, the gate and the shim generator), and the runtime holds each helper it shares with the
build side once."""

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


def _body(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """A function as code, without its name, docstring and recursive references to itself."""
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    dump = ast.dump(ast.Module([*body], []))
    return ast.dump(node.args) + dump.replace(f"Name(id='{node.name}'", "Name(id='<self>'")


def _definitions(source: str) -> list[tuple[str, str, str]]:
    """(kind, name, body) for every top-level function and class of a module's source."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append(("function", node.name, _body(node)))
        elif isinstance(node, ast.ClassDef):
            found.append(("class", node.name, ""))
    return found


def _written_twice(modules: dict[str, list[tuple[str, str, str]]], runtime: set[str]) -> list[str]:
    """Pairs that say one idea twice: a function of the runtime whose body another module (or another
    runtime file) writes again, or a public class of the runtime that the build side defines again."""
    bodies, classes = {}, {}
    for name in sorted(runtime):
        for kind, what, body in modules[name]:
            if kind == "function" and len(body) > 200:  # a one-line accessor may legitimately recur
                bodies.setdefault(body, f"{name}.{what}")
            elif kind == "class" and not what.startswith("_"):
                classes[what] = f"{name}.{what}"
    found = []
    for name, defs in modules.items():
        for kind, what, body in defs:
            here = f"{name}.{what}"
            if kind == "function" and bodies.get(body, here) != here:
                found.append(f"{here} is {bodies[body]} again")
            elif kind == "class" and name not in runtime and what in classes:
                found.append(f"{here} is {classes[what]} again")
    return found


def test_the_duplicate_finder_finds_a_helper_written_twice():
    sha = ("def sha(path):\n    h = hashlib.sha256()\n    with path.open('rb') as f:\n"
           "        for block in iter(lambda: f.read(1 << 20), b''):\n            h.update(block)\n"
           "    return h.hexdigest()\n")
    flat = ("def {0}(r):\n    if isinstance(r, torch.Tensor):\n        return [r]\n"
            "    return [t for x in r for t in {0}(x)] if isinstance(r, list) else []\n")
    parse = {n: _definitions(src) for n, src in {
        "rt.a": sha + flat.format("flatten") + "class Tol:\n    pass\n", "rt.b": flat.format("_flat"),
        "build": sha.replace("def sha", "def _sha256") + "class Tol:\n    x = 1\n",
    }.items()}
    assert _written_twice(parse, {"rt.a", "rt.b"}) == [
        "rt.b._flat is rt.a.flatten again", "build._sha256 is rt.a.sha again", "build.Tol is rt.a.Tol again"]


def test_the_runtime_holds_each_helper_once():
    """Where the runtime and the build side need the same helper or value type, the runtime holds it and
    the build side imports it (a file's sha256, an op's flattened outputs, an output's tolerance)."""
    runtime = {m for m in MODULES if m == RUNTIME or m.startswith(RUNTIME + ".")}
    found = _written_twice({name: _definitions(MODULES[name].read_text()) for name in MODULES}, runtime)
    assert found == [], "; ".join(found)
