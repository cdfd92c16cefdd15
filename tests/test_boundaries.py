"""Layer boundaries: the bookkeeping layers import no torch, FastAPI, Prometheus client or redis.

The simulator and the property tests drive kvcache/, sched/, cost/, the tier base and the tier
hierarchy with no model, so importing them must not pull in heavy or server-side packages
(docs/architecture.md, "Layers and packages"); redis belongs to kvtier/tiers/remote.py alone."""

from __future__ import annotations

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
    """kvtier/cli/bench.py adds `kvtier bench` from kvtier/bench/cli.py, never the other way round:
    the flag types they share live in kvtier/cli/args.py."""
    assert "kvtier.cli.main" not in _new_kvtier_modules("import kvtier.bench.cli")
