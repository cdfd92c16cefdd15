"""Import cycles among kvtier's modules, imports inside functions included (issue 30).

This counts the imports inside functions and methods too: a lazy import that exists to break a cycle is still a
cycle (the two modules still need each other; only the failure moved from import time to the
first call). Imports under `if TYPE_CHECKING:` do not count: they never run.

The graph: one node per module under kvtier/ (a package is its __init__.py); an edge for every
`import kvtier.x` / `from kvtier.x import y` / relative import anywhere in the module's code,
to kvtier.x.y when y is a submodule and to kvtier.x otherwise. Parent packages whose
__init__.py runs on the way are not edges (a package re-exporting its submodules would
otherwise be a cycle with each of them), nor are `importlib.import_module(name)` calls.

There is no cycle (issue 30 removed the last two: kvtier.model.gguf <-> kvtier.model.hf_config,
and kvtier.tiers.{hierarchy, host, keyring, purge, tenants} through owner_id and the offline
purge); a new one fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the graph
def module_paths(root: Path = REPO / "kvtier") -> dict[str, Path]:
    """Every module under `root` by dotted name (a package by its __init__.py)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _known(name: str, modules: set[str] | dict[str, Path]) -> str | None:
    """`name` or its longest prefix that is a module of `modules` (a name imported from a
    module is an edge to that module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def module_imports(source: str, module: str, is_package: bool, modules: set[str] | dict[str, Path]) -> set[str]:
    """The modules of `modules` that `module` imports anywhere in its code (module level, in
    functions, methods and classes), except under `if TYPE_CHECKING:`."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if not _is_type_checking(node.test):
                for child in node.body:
                    self.visit(child)
            for child in node.orelse:
                self.visit(child)

        def visit_Import(self, node: ast.Import) -> None:
            for alias in node.names:
                dep = _known(alias.name, modules)
                if dep is not None:
                    found.add(dep)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                dep = submodule if submodule in modules else _known(source, modules)
                if dep is not None:
                    found.add(dep)

    Visitor().visit(ast.parse(source, module))
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_paths()
    return {
        name: module_imports(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", modules)
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of `graph` with more than one node (Tarjan's
    algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: set[frozenset[str]] = set()
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph.get(root, ()))))]
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.add(frozenset(component))
    return out


def _show(found: set[frozenset[str]]) -> str:
    return "\n".join("  " + " <-> ".join(sorted(c)) for c in sorted(found, key=sorted)) or "  (none)"


# ----------------------------------------------------------------------------- the tests
def test_the_graph_sees_lazy_imports() -> None:
    graph = import_graph()
    assert sum(map(len, graph.values())) > 100, "the import graph looks empty: is the parser broken?"
    assert "kvtier.sched.output" in graph["kvtier.sched.scheduler"]
    assert "kvtier.tiers.remote" in graph["kvtier.tiers.hierarchy"]  # opened inside a method
    assert "kvtier.tiers.keyring" in graph["kvtier.tiers.hierarchy"]  # under TYPE_CHECKING and lazily


def test_no_import_cycles_among_kvtier_modules() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (lazy imports included; untangle them):\n" + _show(found)


def test_the_cycle_finder() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"f"}, "g": set()}
    assert cycles(graph) == {frozenset("abc"), frozenset("de")}
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == set()


def test_the_parser_resolves_imports() -> None:
    modules = {"p", "p.a", "p.b", "p.sub", "p.sub.c", "p.sub.d", "p.e"}
    source = """
import os
import p.a
from . import b
from .d import thing
from ..e import other
from p.sub import c, not_a_module
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from p import never
else:
    from p import b as again

def f():
    from p.sub.d import x
    import p.e.attribute
"""
    got = module_imports(source, "p.sub.c", False, modules)
    assert got == {"p.a", "p.sub.d", "p.e", "p.sub", "p.b"}
    # in a package's __init__.py, "." is the package itself
    assert module_imports("from . import c\nfrom .d import y\n", "p.sub", True, modules) == {"p.sub.c", "p.sub.d"}
