"""Runs vLLM (in the vLLM virtual environment) with LoRA enabled, for test_connector_lora.py.

    python lora_runner.py spec.json out.json

spec: {"model": dir, "dtype": "float32", "kv_cache_bytes": int, "connector": {extra config} | null,
       "block_size": 128, "max_loras": 2, "max_lora_rank": 8,
       "adapters": {name: {"id": int, "path": dir}},
       "phases": [{"prompt": [ids...], "adapter": name | null, "max_tokens": 8,
                   "reset_prefix_cache": bool}, ...]}
out:  {"phases": [{"outputs": [ids...], "cached": n, "metrics": {kvtier metrics after the phase}}],
       "metrics": {...}}

One request a phase, greedy; "reset_prefix_cache" empties vLLM's own prefix cache first (kvtier's
tiers keep their blocks).
"""

from __future__ import annotations

import json
import sys

from vllm_runner import _connector_config, _kvtier_metrics


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    kwargs = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=int(spec["kv_cache_bytes"]),
        max_num_seqs=spec.get("max_num_seqs", 4),
        max_model_len=1024,
        block_size=spec.get("block_size", 128),
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
        enable_lora=True,
        max_loras=spec.get("max_loras", 2),
        max_lora_rank=spec.get("max_lora_rank", 8),
    )
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = _connector_config(spec["connector"])
    llm = LLM(**kwargs)
    adapters = {name: LoRARequest(name, a["id"], a["path"]) for name, a in spec["adapters"].items()}
    out: dict = {"phases": []}
    for phase in spec["phases"]:
        if phase.get("reset_prefix_cache"):
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        params = SamplingParams(
            max_tokens=phase.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
        )
        lora = adapters[phase["adapter"]] if phase.get("adapter") else None
        (result,) = llm.generate([{"prompt_token_ids": phase["prompt"]}], params, lora_request=lora, use_tqdm=False)
        out["phases"].append(
            {
                "outputs": list(result.outputs[0].token_ids),
                "cached": result.num_cached_tokens,
                "metrics": _kvtier_metrics(llm),
            }
        )
    out["metrics"] = _kvtier_metrics(llm)
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
