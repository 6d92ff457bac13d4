"""The package's layout: no import cycle between coat_ds's modules, no module over
400 lines, the top of coat_ds/ is its public face (`__init__.py`) and subpackages, the
library never imports train.py's harness (coat_ds.train), and the configuration dataclasses
(coat_ds.config) sit below everything that reads them.

The import map is read from the source with `ast`, not by importing: every `import` and
`from ... import` of a coat_ds module, absolute or relative, at the top of a module or inside
a function (a lazy import is a dependency all the same; it only runs later). Importing
`a.b.c` from outside package `a.b` runs `a/b/__init__.py` first, so that package is a
dependency too.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "coat_ds")
MAX_LINES = 400


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py under coat_ds/ (a package is its __init__)."""
    found = {}
    base = os.path.dirname(ROOT)
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _package_of(module: str, path: str) -> str:
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(module: str, path: str, node, modules: dict) -> set[str]:
    """The coat_ds modules one import statement of `module` names."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = _package_of(module, path).split(".")
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself.
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    out = set()
    for name in names:
        while name and name not in modules:  # `import coat_ds.x.y` with y a name, not a module
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the coat_ds modules importing it runs (packages' __init__ included)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        own = set(_ancestors(module))  # already being imported when `module` runs
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, path, node, modules):
                    deps |= {target, *(a for a in _ancestors(target) if a not in own)}
        deps.discard(module)
        graph[module] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one
    cycle through it, so that a failure names the imports to break."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_one_cycle(graph, set(c)) for c in comps]


def _one_cycle(graph, comp: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside it."""
    start = min(comp)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]] & comp):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError("a component without a cycle")


def test_graph_reads_relative_absolute_and_lazy_imports():
    graph = import_graph()
    assert "coat_ds.optim.state" in graph["coat_ds.optim.coat_adamw"]  # from . import state as st
    assert "coat_ds.config" in graph["coat_ds.optim.state"]  # from ..config import OptimStateConfig
    # coat_ds/__init__ imports the DeepSpeed integration inside a function only.
    assert "coat_ds.integrations.deepspeed" in graph["coat_ds"]
    # A submodule's import runs its package's __init__ first.
    assert "coat_ds.kernels" in graph["coat_ds.optim.state"]


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_module_over_400_lines():
    long = {}
    for module, path in _modules().items():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[module] = n
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_top_level_is_the_public_face_and_subpackages():
    loose = [n for n in os.listdir(ROOT) if n.endswith(".py") and n != "__init__.py"]
    assert not loose, f"modules at the top of coat_ds/ (each belongs in a subpackage): {loose}"
    for name in os.listdir(ROOT):
        folder = os.path.join(ROOT, name)
        if os.path.isdir(folder) and name != "__pycache__" and any(f.endswith(".py") for f in os.listdir(folder)):
            assert os.path.isfile(os.path.join(folder, "__init__.py")), f"coat_ds/{name}/ is no package"


def test_library_does_not_import_the_harness():
    graph = import_graph()
    bad = sorted(m for m, deps in graph.items() if not (m == "coat_ds.train" or m.startswith("coat_ds.train."))
                 and any(d == "coat_ds.train" or d.startswith("coat_ds.train.") for d in deps))
    assert not bad, f"library modules importing coat_ds.train: {bad}"


def test_config_imports_only_what_sits_below_it():
    graph = import_graph()
    below = ("coat_ds.config", "coat_ds.kernels", "coat_ds._compat")
    bad = {m: sorted(d for d in deps if not d.startswith(below)) for m, deps in graph.items()
           if m.startswith("coat_ds.config")}
    assert not any(bad.values()), f"coat_ds.config importing the layers that read it: {bad}"
