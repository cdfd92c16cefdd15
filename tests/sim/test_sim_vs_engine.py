"""The simulator predicts what the engine does: a small trace replayed through `kvtier.sim` and
through the real engine (tiny model, device pool + host tier) gives the same hit counts per tier.

Trace -> tokens: block i of a request holds tokens derived from its hash id, so equal ids give
equal tokens and sibling blocks never share a first token (no token-granular partial hits). The
engine's prompt is the trace's full blocks plus one unique token (the last prompt token is
always computed), so both sides reuse exactly the full blocks. The engine holds that one extra
token's block while a request runs, so the simulator gets one block less of device capacity.
"""

from __future__ import annotations

import random

import pytest

from kvtier import LLM, SamplingParams
from kvtier.sim import load_trace
from kvtier.sim.simulator import TraceSimulator

BS = 4
DEVICE_BLOCKS = 24


def make_trace(seed: int = 0, n: int = 40) -> list[dict]:
    rng = random.Random(seed)
    convs = [[c * 100 + j for j in range(3)] for c in range(4)]  # 4 conversations, growing
    trace, next_id = [], 1000
    for t in range(n):
        c = rng.randrange(len(convs))
        ids = convs[c] + [next_id + k for k in range(rng.randrange(1, 4))]
        next_id += 10
        convs[c] = ids if rng.random() < 0.5 else convs[c]  # sometimes the conversation continues
        trace.append({"timestamp": t, "input_length": len(ids) * BS, "output_length": 1, "hash_ids": ids})
    return trace


def block_tokens(h: int) -> list[int]:
    rng = random.Random(h)
    return [3 + h % 480] + [rng.randrange(3, 500) for _ in range(BS - 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvtier.model.builder import build_random_llama
    d = tmp_path_factory.mktemp("sim_model")
    build_random_llama(d, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                       vocab_size=512, max_position_embeddings=512, dtype="float32")
    return d


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulator_and_engine_agree_on_hits_per_tier(model_dir, seed):
    trace = make_trace(seed)
    sim = TraceSimulator(DEVICE_BLOCKS - 1, "lru", host_blocks=10_000)
    sim.replay(load_trace(trace, block_tokens=BS))
    res = sim.result()

    llm = LLM(str(model_dir), dtype="float32", block_size=BS, num_device_blocks=DEVICE_BLOCKS,
              host_cache_bytes=256 << 20, restore_policy="always")
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    dev = host = 0
    for i, rec in enumerate(trace):
        prompt = [t for h in rec["hash_ids"] for t in block_tokens(h)] + [500 + i % 10]
        out = llm.generate(prompt, sp)[0]
        dev += out.cached_tokens_by_tier.get("device", 0) // BS
        host += out.cached_tokens_by_tier.get("host", 0) // BS
    llm.check_integrity()
    llm.close()
    assert res.host_hit_blocks > 0 and res.device_hit_blocks > 0  # the trace exercises both tiers
    assert (dev, host) == (res.device_hit_blocks, res.host_hit_blocks)
