"""kvtier.heap: freed activations stay with the process (no page faults to touch them again).
Each case runs in a subprocess, since the thresholds are process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kvtier import heap

_SCRIPT = r"""
import ctypes, json, resource, sys
from kvtier import heap
ok = heap.retain_freed_memory() if sys.argv[1] == "retain" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
for _ in range(5):  # a 64 MiB activation, allocated, written and freed each step
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"ok": ok, "faults": faults}))
"""


def _run(mode: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120, env=env or dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_freed_activations_are_reused_without_page_faults():
    pages = (64 << 20) // 4096
    default = _run("default")
    assert not default["ok"] and min(default["faults"][1:]) > pages // 2  # mapped anew each time
    kept = _run("retain")
    assert kept["ok"] and max(kept["faults"][1:]) < pages // 20  # the same pages again


def test_env_turns_it_off(monkeypatch):
    monkeypatch.setattr(heap, "_done", False)
    assert not heap.retain_freed_memory({heap.RETAIN_ENV: "0"})
    assert not heap._done
