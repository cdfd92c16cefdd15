"""LoRA through the engine and the offline API (kvtier.lora, vLLM's `enable_lora` / `lora_request`):
greedy tokens (float32) equal transformers + PEFT for each adapter with two adapters and the base
model in one batch, with chunked prefill, a prefix-cache hit, preemption and n > 1; at most
`max_loras` distinct adapters run at once (a request waits for a slot); adapters are loaded once
and kept (max_cpu_loras); a request naming an adapter without enable_lora, or an adapter that does
not fit, is a clear error that leaves nothing behind. Every scenario ends with check_integrity()
and every block free."""

from __future__ import annotations

import random
import shutil

import pytest
from engineutil import clean
from lorautil import make_adapter, peft_greedy

from kvtier import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft", reason="PEFT is the reference (pip install 'kvtier[test]')")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def lora_a(model_dir, tmp_path_factory) -> LoRARequest:
    path = make_adapter(model_dir, tmp_path_factory.mktemp("lora") / "a", seed=1)
    return LoRARequest("a", 1, str(path))


@pytest.fixture(scope="module")
def lora_b(model_dir, tmp_path_factory) -> LoRARequest:
    path = make_adapter(
        model_dir, tmp_path_factory.mktemp("lora") / "b", targets=["q_proj", "v_proj", "down_proj"], seed=2
    )
    return LoRARequest("b", 2, str(path))


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def want(model_dir, lora: LoRARequest | None, prompt: list[int], max_tokens: int = 10) -> list[int]:
    return peft_greedy(model_dir, None if lora is None else lora.lora_path, prompt, max_tokens)


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_two_adapters_and_the_base_model_in_one_batch_match_peft(model_dir, lora_a, lora_b):
    llm = LLM(str(model_dir), dtype="float32", num_device_blocks=128, block_size=4, enable_lora=True, max_loras=2)
    ps = prompts(1, [9, 17, 5, 12])
    same = ps[0]
    batch = [ps[0], ps[1], ps[2], same, same, ps[3]]
    loras = [lora_a, lora_b, None, lora_b, None, lora_a]
    outs = llm.generate(batch, GREEDY, lora_request=loras)
    assert tokens(outs) == [want(model_dir, lo, p) for p, lo in zip(batch, loras)]
    # the same prompt with a, b and the base model: three different continuations
    assert len({tuple(tokens(outs)[i]) for i in (0, 3, 4)}) == 3
    assert [o.lora_request for o in outs] == loras
    # one request for every prompt
    outs = llm.generate(ps[:2], GREEDY, lora_request=lora_b)
    assert tokens(outs) == [want(model_dir, lora_b, p) for p in ps[:2]]
    clean(llm)


def test_chunked_prefill_prefix_hits_and_n_with_adapters(model_dir, lora_a, lora_b):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_device_blocks=128,
        block_size=4,
        max_num_batched_tokens=7,
        enable_lora=True,
        max_loras=2,
    )
    ps = prompts(2, [30, 19, 3])
    loras = [lora_a, None, lora_b]
    outs = llm.generate(ps, GREEDY, lora_request=loras)
    assert tokens(outs) == [want(model_dir, lo, p) for p, lo in zip(ps, loras)]
    # again with the same adapter: a prefix hit (all but the last token), the same tokens
    again = llm.generate(ps[0], GREEDY, lora_request=lora_a)[0]
    assert again.num_cached_tokens == 29
    assert tokens([again]) == tokens(outs[:1])
    # a continuation of the conversation reuses prompt and output under the adapter
    convo = ps[0] + tokens(outs)[0] + prompts(3, [6])[0]
    out = llm.generate(convo, GREEDY, lora_request=lora_a)[0]
    assert out.num_cached_tokens >= 36
    assert tokens([out]) == [want(model_dir, lora_a, convo)]
    # n > 1: every sample runs the adapter
    out = llm.generate(ps[1], SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True), lora_request=lora_b)
    assert [list(c.token_ids) for c in out[0].outputs] == [want(model_dir, lora_b, ps[1], 8)] * 3
    clean(llm)


def test_preemption_with_adapters(model_dir, lora_a, lora_b):
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # 4 requests x (14 prompt + 20 output) need 9 blocks each at block_size 4: 14 blocks force
    # preemption and recompute (through the prefix cache of each one's adapter)
    llm = LLM(str(model_dir), dtype="float32", num_device_blocks=14, block_size=4, enable_lora=True, max_loras=2)
    ps = prompts(6, [14, 14, 14, 14])
    loras = [lora_a, lora_b, None, lora_a]
    outs = llm.generate(ps, sp, lora_request=loras)
    assert sum(o.num_preemptions for o in outs) > 0
    assert tokens(outs) == [want(model_dir, lo, p, 20) for p, lo in zip(ps, loras)]
    clean(llm)


def test_at_most_max_loras_adapters_run_at_once(model_dir, lora_a, lora_b):
    """max_loras=1: requests of the second adapter wait until the first's are done (base-model
    requests run beside either); checked after every step."""
    llm = LLM(str(model_dir), dtype="float32", num_device_blocks=128, block_size=4, enable_lora=True, max_loras=1)
    engine = llm.engine
    ps = prompts(7, [6, 7, 8, 9, 5])
    loras = [lora_a, lora_b, None, lora_a, lora_b]
    ids = [engine.add_request(p, GREEDY, lora_request=lo) for p, lo in zip(ps, loras)]
    done = {}
    most_running = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        running = engine.scheduler.running
        assert len({r.lora.key for r in running if r.lora is not None}) <= 1
        most_running = max(most_running, len(running))
        engine.check_integrity()
    assert engine.scheduler.num_lora_waits > 0
    assert most_running >= 2  # the base-model request ran beside an adapter's
    assert tokens([done[i] for i in ids]) == [want(model_dir, lo, p) for p, lo in zip(ps, loras)]
    clean(llm)


def test_adapters_are_loaded_once_and_kept_lru(model_dir, lora_a, lora_b, tmp_path):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        num_device_blocks=64,
        block_size=4,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
    )
    loras = llm.engine.loras
    assert loras is not None
    p = prompts(8, [5])[0]
    for lo in (lora_a, lora_b, lora_a, lora_b):
        llm.generate(p, GREEDY, lora_request=lo)
    assert loras.num_loads == 2 and len(loras) == 2
    # a third adapter drops the least recently used one (a), which then loads again
    c = LoRARequest("c", 3, str(tmp_path / "c"))
    shutil.copytree(lora_a.lora_path, c.lora_path)
    llm.generate(p, GREEDY, lora_request=c)
    llm.generate(p, GREEDY, lora_request=lora_a)
    assert loras.num_loads == 4 and len(loras) == 2
    # another adapter written under the same name and path: loaded again, its own KV and tokens
    d = tmp_path / "d"
    shutil.copytree(lora_b.lora_path, d)
    first = llm.generate(p, GREEDY, lora_request=LoRARequest("d", 4, str(d)))[0]
    make_adapter(model_dir, d, seed=9)
    second = llm.generate(p, GREEDY, lora_request=LoRARequest("d", 4, str(d)))[0]
    assert second.num_cached_tokens == 0 < first.num_cached_tokens  # b's copy hit b's blocks
    assert tokens([second]) == [peft_greedy(model_dir, d, p, 10)] != tokens([first])
    clean(llm)


def test_errors_are_clear_and_leave_nothing_behind(model_dir, lora_a, tmp_path):
    llm = LLM(str(model_dir), dtype="float32", num_device_blocks=64, block_size=4)
    with pytest.raises(ValueError, match=r"LoRA is not enabled; start the engine with enable_lora=True"):
        llm.generate(prompts(9, [5, 6]), GREEDY, lora_request=[None, lora_a])
    clean(llm)
    llm = LLM(str(model_dir), dtype="float32", num_device_blocks=64, block_size=4, enable_lora=True, max_lora_rank=8)
    big = LoRARequest("big", 5, str(make_adapter(model_dir, tmp_path / "big", r=16, alpha=16)))
    with pytest.raises(ValueError, match=r"LoRA adapter 'big' .*rank 16, above max_lora_rank=8"):
        llm.generate(prompts(9, [5, 6]), GREEDY, lora_request=[None, big])
    with pytest.raises(ValueError, match=r"got 1 lora_request for 2 prompts"):
        llm.generate(prompts(9, [5, 6]), GREEDY, lora_request=[lora_a])
    with pytest.raises(ValueError, match=r"lora_request must be a kvtier.LoRARequest"):
        llm.generate(prompts(9, [5]), GREEDY, lora_request=[{"lora_name": "a"}])
    assert not llm.engine.has_unfinished
    clean(llm)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LLM(str(model_dir), dtype="float32", num_device_blocks=8, enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_chat_with_an_adapter(byte_model_dir, tmp_path):
    llm = LLM(str(byte_model_dir), dtype="float32", num_device_blocks=96, block_size=4, enable_lora=True)
    lora = LoRARequest("chat", 1, str(make_adapter(byte_model_dir, tmp_path / "chat", seed=4)))
    msgs = [{"role": "user", "content": "hello there"}]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.chat(msgs, sp, lora_request=lora)[0]
    ids = llm.get_tokenizer().encode_chat(msgs, True)
    assert list(out.outputs[0].token_ids) == peft_greedy(byte_model_dir, lora.lora_path, ids, 8)
    assert out.lora_request == lora
    clean(llm)
