"""What the vLLM connector tests share: the vLLM environment's Python, a tiny float32 Llama
checkpoint, and a runner of vllm_runner.py scenarios (one vLLM process per scenario)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_runner.py")
sys.path.insert(0, str(REPO / "tests" / "server"))


def _vllm_python() -> str | None:
    candidate = os.environ.get("KVTIER_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(candidate).exists():
        return None
    probe = subprocess.run([candidate, "-c", "import vllm, kvtier.integrations.vllm"], capture_output=True, timeout=300)
    return candidate if probe.returncode == 0 else None


VLLM_PY = _vllm_python()
if VLLM_PY is None and os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
    raise RuntimeError("KVTIER_REQUIRE_VLLM=1 but no working vLLM environment (KVTIER_VLLM_PYTHON / .venv-vllm)")
requires_vllm = pytest.mark.skipif(
    VLLM_PY is None, reason="no vLLM environment (scripts/vllm-venv.sh builds .venv-vllm; or set KVTIER_VLLM_PYTHON)"
)

BLOCK = 128
POOL_BYTES = 3 << 20


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def _build_model(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return out


def _run(tmp: Path, name: str, spec: dict, env: dict[str, str] | None = None, runner: Path = RUNNER) -> dict:
    spec_path, out_path, log_path = tmp / f"{name}.json", tmp / f"{name}.out.json", tmp / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = str(REPO)  # this checkout's kvtier, not the one installed in vLLM's environment
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [VLLM_PY, str(runner), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            timeout=900,
            cwd=tmp,
        )
    text = log_path.read_text()
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{text[-6000:]}"
    out = json.loads(out_path.read_text())
    out["log"] = text
    return out


def _spec(model: Path, phases: list[dict], connector: dict | None, dtype: str = "float32") -> dict:
    return {
        "model": str(model),
        "dtype": dtype,
        "kv_cache_bytes": POOL_BYTES,
        "connector": connector,
        "max_num_seqs": 4,
        "block_size": BLOCK,
        "phases": phases,
    }


def _word_tokenizer(model_dir: Path, vocab_size: int = 512) -> None:
    """Token i is the word w{i} (0-2 special): text round-trips exactly (ANCHORS.md's recipe)."""
    from kvtier.model.tokenizer import build_word_tokenizer

    build_word_tokenizer(model_dir, vocab_size)
