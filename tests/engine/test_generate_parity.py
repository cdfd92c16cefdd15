"""Greedy output of LLM.generate is token-identical to transformers (float32), with and without
prefix-cache hits, chunked prefill, preemption and n > 1. Every scenario ends in
check_integrity() and a pool with every block free."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import LLM, SamplingParams

FAMILIES = ["llama", "llama3_rope", "llama_tied", "mistral", "qwen2", "qwen3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference: recompute the whole sequence each step (no cache involved at all)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def prompts(seed: int, lengths: list[int], vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def finish(llm: LLM) -> None:
    llm.check_integrity()
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked after all requests finished"


@pytest.mark.parametrize("family", FAMILIES)
def test_single_and_batch_of_mixed_lengths(family, tiny_model_dirs, reference_model):
    d = tiny_model_dirs[family]
    ref = reference_model(d)
    llm = LLM(str(d), dtype="float32", num_device_blocks=128, block_size=4)
    ps = prompts(1, [5, 17, 1, 33, 8])
    want = [hf_greedy(ref, p, GREEDY.max_tokens) for p in ps]
    assert llm.generate(ps[0], GREEDY)[0].outputs[0].token_ids == want[0]
    outs = llm.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    finish(llm)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefix_hit_full_blocks_and_divergence_inside_a_block(family, tiny_model_dirs, reference_model):
    d = tiny_model_dirs[family]
    ref = reference_model(d)
    llm = LLM(str(d), dtype="float32", num_device_blocks=128, block_size=8)
    base = prompts(2, [40])[0]
    first = llm.generate(base, GREEDY)[0]
    assert first.num_cached_tokens == 0
    # same prompt again: all but the last token come from the cache (39 = 4 blocks + 7 copied)
    again = llm.generate(base, GREEDY)[0]
    assert again.num_cached_tokens == 39
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(ref, base, 12)
    # diverge at token 29, inside the 4th block: 3 full blocks hit + 5 tokens copied
    fork = base[:29] + prompts(3, [9])[0]
    out = llm.generate(fork, GREEDY)[0]
    assert out.num_cached_tokens == 29
    assert out.cached_tokens_by_tier == {"device": 29}
    assert out.outputs[0].token_ids == hf_greedy(ref, fork, 12)
    # a continuation of the first conversation reuses prompt + generated tokens
    convo = base + first.outputs[0].token_ids + prompts(4, [6])[0]
    out = llm.generate(convo, GREEDY)[0]
    assert out.num_cached_tokens >= 48
    assert out.outputs[0].token_ids == hf_greedy(ref, convo, 12)
    finish(llm)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chunked_prefill(family, tiny_model_dirs, reference_model):
    d = tiny_model_dirs[family]
    ref = reference_model(d)
    llm = LLM(str(d), dtype="float32", num_device_blocks=128, block_size=4, max_num_batched_tokens=7)
    ps = prompts(5, [30, 19, 3])
    outs = llm.generate(ps, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 12) for p in ps]
    finish(llm)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_forced_preemption_with_a_tiny_pool(family, tiny_model_dirs, reference_model):
    d = tiny_model_dirs[family]
    ref = reference_model(d)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # 4 requests x (14 prompt + 20 output) need 9 blocks each at block_size 4: 14 blocks force
    # preemption and recompute (through the prefix cache).
    llm = LLM(str(d), dtype="float32", num_device_blocks=14, block_size=4)
    ps = prompts(6, [14, 14, 14, 14])
    outs = llm.generate(ps, sp)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 20) for p in ps]
    finish(llm)


def test_n_greedy_and_seeded_sampling(tiny_model_dirs, reference_model):
    d = tiny_model_dirs["llama"]
    ref = reference_model(d)
    llm = LLM(str(d), dtype="float32", num_device_blocks=128, block_size=4)
    p = prompts(7, [10])[0]
    out = llm.generate(p, SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    want = hf_greedy(ref, p, 8)
    assert [c.token_ids for c in out.outputs] == [want] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    sp = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a = [c.token_ids for c in llm.generate(p, sp)[0].outputs]
    # the same seed gives the same samples, also when other requests share the batch
    other = prompts(8, [12, 5])
    outs = llm.generate(
        [other[0], p, other[1]], SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    )
    b = [c.token_ids for c in outs[1].outputs]
    assert a == b
    assert len({tuple(x) for x in a}) > 1, "parallel samples should differ"
    finish(llm)


def test_salt_isolates_cache_entries(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama"]), dtype="float32", num_device_blocks=64, block_size=4)
    p = prompts(9, [24])[0]
    assert llm.generate(p, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 0
    assert llm.generate(p, GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate(p, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 23
    assert llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-b"}, GREEDY)[0].num_cached_tokens == 23
    assert llm.generate(p, GREEDY)[0].num_cached_tokens == 0
    finish(llm)


def test_no_prefix_caching_recomputes(tiny_model_dirs):
    llm = LLM(
        str(tiny_model_dirs["llama"]), dtype="float32", num_device_blocks=64, block_size=4, enable_prefix_caching=False
    )
    p = prompts(10, [24])[0]
    llm.generate(p, GREEDY)
    assert llm.generate(p, GREEDY)[0].num_cached_tokens == 0
    finish(llm)
