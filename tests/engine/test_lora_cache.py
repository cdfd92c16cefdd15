"""KV isolation of LoRA adapters: the adapter is part of every block key (its content digest folded
into the key chain's root), so two adapters, or an adapter and the base model, never share
prefix-cache blocks, on the device or in the tiers below (host, disk); the same adapter does. Every
scenario ends with check_integrity() and every block free."""

from __future__ import annotations

import random

import pytest
from engineutil import clean
from lorautil import make_adapter, peft_greedy

from kvtier import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft", reason="PEFT is the reference (pip install 'kvtier[test]')")

SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def loras(model_dir, tmp_path_factory) -> tuple[LoRARequest, LoRARequest]:
    root = tmp_path_factory.mktemp("lora")
    a = LoRARequest("a", 1, str(make_adapter(model_dir, root / "a", seed=1)))
    b = LoRARequest("b", 2, str(make_adapter(model_dir, root / "b", seed=2, targets=["k_proj", "v_proj"])))
    return a, b


def prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def run(llm: LLM, p: list[int], lora: LoRARequest | None):
    out = llm.generate(p, SP, lora_request=lora)[0]
    llm.check_integrity()
    return out


def test_adapters_and_the_base_model_never_share_device_blocks(model_dir, loras):
    a, b = loras
    llm = LLM(str(model_dir), dtype="float32", num_device_blocks=128, block_size=BS, enable_lora=True, max_loras=2)
    p = prompt(1)
    first = {name: run(llm, p, lora) for name, lora in (("a", a), ("b", b), ("base", None))}
    assert {name: o.num_cached_tokens for name, o in first.items()} == {"a": 0, "b": 0, "base": 0}
    for name, lora in (("a", a), ("b", b), ("base", None)):
        again = run(llm, p, lora)
        assert again.num_cached_tokens == len(p) - 1, name
        assert again.outputs[0].token_ids == first[name].outputs[0].token_ids
        want = peft_greedy(model_dir, None if lora is None else lora.lora_path, p, SP.max_tokens)
        assert list(again.outputs[0].token_ids) == want, name
    # the same adapter under another name and id (the same files): the same KV, a hit
    alias = LoRARequest("a-alias", 9, a.lora_path)
    assert run(llm, p, alias).num_cached_tokens == len(p) - 1
    # a cache salt splits an adapter's space too
    assert llm.generate(p, SP, lora_request=a, cache_salt="s")[0].num_cached_tokens == 0
    clean(llm)


def test_tiers_offer_restored_blocks_only_to_the_same_adapter(model_dir, loras, tmp_path):
    a, b = loras
    disk = str(tmp_path / "disk")

    def engine(**kw) -> LLM:
        return LLM(
            str(model_dir),
            dtype="float32",
            num_device_blocks=40,
            block_size=BS,
            restore_policy="always",
            enable_lora=True,
            max_loras=2,
            disk_cache_dir=disk,
            **kw,
        )

    llm = engine(host_cache_bytes=64 << 20)
    p = prompt(2, 60)
    want_a = list(run(llm, p, a).outputs[0].token_ids)
    for seed in range(3, 8):  # unrelated prompts push a's blocks out of the device pool
        run(llm, prompt(seed, 60), None)
    # b and the base model find nothing of a's in the host tier
    for lora in (b, None):
        out = run(llm, p, lora)
        assert out.num_cached_tokens == 0 and out.cached_tokens_by_tier.get("host", 0) == 0
    for seed in range(3, 8):
        run(llm, prompt(seed, 60), None)
    out = run(llm, p, a)
    assert out.cached_tokens_by_tier.get("host") == 56, out.cached_tokens_by_tier
    assert list(out.outputs[0].token_ids) == want_a
    llm.engine.tiers.flush()
    clean(llm)
    llm.close()
    # a new engine on the same disk directory (no host tier): a's blocks only for a
    llm = engine()
    q = prompt(9, 60)
    out = run(llm, q, b)
    assert out.num_cached_tokens == 0
    out = run(llm, p, b)  # b computed p before: its own blocks come back from the disk
    assert out.cached_tokens_by_tier.get("disk") == 56
    out = run(llm, q, a)
    assert out.num_cached_tokens == 0  # q was only ever computed with b
    out = run(llm, p, a)
    assert out.cached_tokens_by_tier.get("disk") == 56 and list(out.outputs[0].token_ids) == want_a
    clean(llm)
    llm.close()
