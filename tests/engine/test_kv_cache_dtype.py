"""The engine with a quantized KV cache: a prefix hit and a host-tier restore give the same tokens
as the same quantized engine computing everything, tiers hold the quantized bytes, and a tier
entry written under one KV dtype is a miss (never garbage) for an engine of another."""

from __future__ import annotations

import random

import pytest

from kvtier import LLM, SamplingParams

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvtier.model.builder import build_random_llama

    d = tmp_path_factory.mktemp("kvq_model")
    build_random_llama(
        d,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=1024,
        dtype="float32",
        seed=5,
    )
    return d


def prompts(seed: int, n: int, length: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def engine(model_dir, kv_cache_dtype: str, **kw) -> LLM:
    args = dict(
        dtype="float32",
        num_device_blocks=48,
        block_size=BS,
        restore_policy="always",
        kv_cache_dtype=kv_cache_dtype,
        skip_tokenizer_init=True,
    )
    args.update(kw)
    return LLM(str(model_dir), **args)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def done(llm: LLM) -> None:
    llm.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    llm.close()


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_device_hit_and_host_restore_give_the_tokens_of_no_cache(model_dir, name):
    ps = prompts(1, 3)
    plain = engine(model_dir, name, enable_prefix_caching=False)
    want = tokens(plain.generate(ps, SP))
    plain.close()

    llm = engine(model_dir, name, host_cache_bytes=16 << 20)
    assert llm.engine.runner.kv_cache_dtype == name
    assert tokens(llm.generate(ps, SP)) == want
    hit = llm.generate(ps[0], SP)[0]
    assert hit.cached_tokens_by_tier["device"] == 59 and hit.outputs[0].token_ids == want[0]
    llm.generate(prompts(99, 5), SP)  # push the first prompts out of the device pool
    restored = llm.generate(ps[1], SP)[0]
    assert restored.cached_tokens_by_tier.get("host") == 56, restored.cached_tokens_by_tier
    assert restored.outputs[0].token_ids == want[1]
    # the host tier holds the packed quantized blocks: data + scales, about half of bfloat16
    runner = llm.engine.runner
    host = llm.engine.tiers.tiers["host"]
    kv = host.get(next(iter(host.keys()))).kv  # the entry: a HostEntry
    assert kv.numel() * kv.element_size() == runner.kv_bytes_per_block
    assert runner.kv_bytes_per_block == runner.kv_data_bytes_per_block + runner.kv_scale_bytes_per_block
    done(llm)


def test_disk_entries_of_another_kv_dtype_are_misses(model_dir, tmp_path):
    """fp8 and full-precision engines share a disk directory: neither restores the other's blocks,
    and each one's output is what it computes alone."""
    disk = str(tmp_path / "disk")
    p = prompts(2, 1)[0]
    alone = {}
    for name in ("fp8_e4m3", "auto"):
        e = engine(model_dir, name, enable_prefix_caching=False)
        alone[name] = tokens(e.generate(p, SP))[0]
        e.close()

    fp8 = engine(model_dir, "fp8_e4m3", disk_cache_dir=disk)
    assert tokens(fp8.generate(p, SP))[0] == alone["fp8_e4m3"]
    fp8.engine.tiers.flush()
    fp8.close()

    full = engine(model_dir, "auto", disk_cache_dir=disk)
    out = full.generate(p, SP)[0]
    assert out.cached_tokens_by_tier.get("disk", 0) == 0 and out.outputs[0].token_ids == alone["auto"]
    full.engine.tiers.flush()
    full.close()

    # each engine finds its own entries: the fp8 ones are still there, and so are the new ones
    for name in ("fp8_e4m3", "auto"):
        again = engine(model_dir, name, disk_cache_dir=disk)
        out = again.generate(p, SP)[0]
        assert out.cached_tokens_by_tier.get("disk") == 56, (name, out.cached_tokens_by_tier)
        assert out.outputs[0].token_ids == alone[name]
        done(again)


def test_cli_flag_reaches_the_engine():
    from kvtier.cli.main import KV_CACHE_DTYPES, _Parser, add_engine_args, engine_kwargs
    from kvtier.model.kv_quant import KV_CACHE_DTYPES as RUNTIME_DTYPES

    assert KV_CACHE_DTYPES == RUNTIME_DTYPES
    parser = _Parser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"]))["kv_cache_dtype"] == "fp8_e5m2"
    assert "kv_cache_dtype" not in engine_kwargs(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])
