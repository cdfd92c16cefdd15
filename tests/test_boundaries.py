"""Layer boundaries: the bookkeeping layers import no torch, FastAPI, Prometheus client or redis.

The simulator and the property tests drive kvcache/, sched/, cost/, the tier base and the tier
hierarchy with no model, so importing them must not pull in heavy or server-side packages
(docs/architecture.md, "Layers and packages"); redis belongs to kvtier/tiers/remote.py alone."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [
    "kvtier.kvcache",
    "kvtier.sched",
    "kvtier.cost",
    "kvtier.sim",
    "kvtier.tiers.base",
    "kvtier.tiers.hierarchy",
    "kvtier.trace",
]
"""Packages (every module in them) and single modules."""
FORBIDDEN = ["torch", "fastapi", "prometheus_client", "redis"]

# Imports every module of each package that exists, one at a time, and records which forbidden
# top-level packages appeared in sys.modules after each import. With "stub", the top-level
# `kvtier` package is replaced by an empty one, so that only the layers' own imports count.
_PROBE = """
import importlib, importlib.util, json, pkgutil, sys, types
packages, forbidden, stub = json.loads(sys.argv[1]), set(json.loads(sys.argv[2])), sys.argv[3] == "stub"

def loaded():
    return {name.split(".")[0] for name in sys.modules} & forbidden

report = {"imported": [], "culprits": {}}
already = loaded()
if stub:
    spec = importlib.util.find_spec("kvtier")
    top = types.ModuleType("kvtier")
    top.__path__ = list(spec.submodule_search_locations)
    sys.modules["kvtier"] = top
for pkg in packages:
    if importlib.util.find_spec(pkg) is None:
        continue
    mod = importlib.import_module(pkg)
    names = [pkg] + ([info.name for info in pkgutil.walk_packages(mod.__path__, pkg + ".")]
                     if hasattr(mod, "__path__") else [])
    for name in names:
        importlib.import_module(name)
        report["imported"].append(name)
        new = sorted(loaded() - already)
        if new:
            report["culprits"][name] = new
            already |= set(new)
print(json.dumps(report))
"""


def probe(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(PACKAGES), json.dumps(FORBIDDEN), mode],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "kvtier.kvcache.manager" in report["imported"] and "kvtier.sched.output" in report["imported"]
    return report


@pytest.mark.parametrize("mode", ["stub", "real"], ids=["layer-modules", "through-kvtier-package"])
def test_bookkeeping_layers_import_no_torch_fastapi_or_prometheus(mode: str) -> None:
    """layer-modules: the modules of kvcache/, sched/, cost/ themselves. through-kvtier-package:
    a plain `import kvtier.kvcache`, which also runs kvtier/__init__.py (keep it lazy)."""
    culprits = probe(mode)["culprits"]
    assert culprits == {}, (
        "these imports pull in forbidden packages (module: packages it first loaded): "
        f"{culprits}; move the import into the layer that needs it or import it lazily"
        + (" (kvtier/__init__.py runs first: make its re-exports lazy, PEP 562 __getattr__)" if mode == "real" else "")
    )


def test_the_cache_layer_does_not_import_the_scheduler() -> None:
    """kvcache/ sits below sched/: the scheduler's records it needs (BlockCopy) live in kvcache."""
    code = (
        "import importlib, pkgutil, sys, kvtier.kvcache as k\n"
        "[importlib.import_module(i.name) for i in pkgutil.walk_packages(k.__path__, 'kvtier.kvcache.')]\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvtier.sched')))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def _new_kvtier_modules(statement: str) -> list[str]:
    """kvtier modules that `statement` imports beyond what `import kvtier` already did."""
    code = (
        "import json, sys, kvtier\n"
        "before = set(sys.modules)\n"
        f"{statement}\n"
        "print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith('kvtier'))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_engine_config_imports_no_other_kvtier_module() -> None:
    """kvtier/config.py holds plain dataclasses: the scheduler's and the tiers' configs are
    imported when an EngineConfig first needs their defaults, not with the module."""
    assert _new_kvtier_modules("import kvtier.config") == ["kvtier.config"]


def test_the_bench_flags_do_not_import_the_kvtier_command() -> None:
    """kvtier/cli/main.py adds `kvtier bench` from kvtier/bench/cli.py, never the other way round:
    the flag types they share live in kvtier/cli/args.py."""
    assert "kvtier.cli.main" not in _new_kvtier_modules("import kvtier.bench.cli")


# ------------------------------------------------------------------ import cycles
def _module_names() -> dict[str, Path]:
    """Every module of the kvtier package by dotted name (a package by its __init__.py)."""
    out: dict[str, Path] = {}
    for path in sorted((REPO / "kvtier").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(path: Path, module: str) -> list[str]:
    """Names a module imports when it is imported: statements at module level (also inside
    if/try/with blocks there), not inside functions or classes, nor under `if TYPE_CHECKING:`.
    `from a import b` yields both "a" and "a.b" (b may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                names.append(source)
                names.extend(f"{source}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                visit(node.body)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)).body)
    return names


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_cycles_among_kvtier_modules() -> None:
    """No kvtier module imports, at module level, a module that imports it back (directly or
    through others): a cycle makes import order matter and half-initialised modules possible.
    Imports inside functions and under `if TYPE_CHECKING:` do not count."""
    modules = _module_names()
    graph = {
        name: {dep for dep in _top_level_imports(path, name) if dep in modules and dep != name}
        for name, path in modules.items()
    }
    assert sum(map(len, graph.values())) > 50, "the import graph looks empty: is the parser broken?"
    assert "kvtier.sched.output" in graph["kvtier.sched.scheduler"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
