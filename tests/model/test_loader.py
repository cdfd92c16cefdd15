"""Checkpoint parsing and loading: ArchConfig, weight routing, errors users hit, fingerprints, builder."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.model import runner as runner_module
from kvtier.model.builder import REFERENCE_MODEL, build_random_llama
from kvtier.model.hf_config import (
    SUPPORTED_ARCHITECTURES,
    ArchConfig,
    ModelLoadError,
    RopeScaling,
)
from kvtier.model.loader import model_fingerprint, safetensors_files
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput


def load(model_dir: Path, **kwargs) -> ModelRunner:
    return ModelRunner(model_dir, device="cpu", block_size=4, num_blocks=16, **kwargs)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- ArchConfig ------------------------------------------------------------------------------------


def test_arch_config_reads_each_family(tiny_model_dirs):
    archs = {family: ArchConfig.from_dir(d) for family, d in tiny_model_dirs.items()}
    llama = archs["llama"]
    assert (llama.architecture, llama.hidden_size, llama.num_layers) == ("LlamaForCausalLM", 64, 2)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.num_queries_per_kv) == (4, 2, 16, 2)
    assert llama.rope_scaling is None and not llama.qkv_bias and not llama.qk_norm
    assert llama.dtype == "float32" and llama.eos_token_ids == (2,) and llama.bos_token_id == 1
    assert archs["llama3_rope"].rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert archs["llama3_rope"].rope_theta == 500000.0
    assert archs["llama_tied"].tie_word_embeddings
    assert archs["qwen2"].qkv_bias and not archs["qwen2"].o_bias
    assert archs["qwen3"].qk_norm and archs["qwen3"].head_dim == 32  # explicit head_dim != hidden / heads
    assert archs["mistral"].architecture == "MistralForCausalLM" and archs["mistral"].sliding_window is None


def _llama_config(**overrides) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
    }
    return config | overrides


def test_legacy_rope_keys_parse_like_transformers_5_rope_parameters():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    legacy = ArchConfig.from_dict(_llama_config(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **scaling}))
    legacy_type_key = ArchConfig.from_dict(_llama_config(rope_theta=5e5, rope_scaling={"type": "llama3", **scaling}))
    v5 = ArchConfig.from_dict(_llama_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling}))
    assert legacy == legacy_type_key == v5
    assert v5.rope_theta == 5e5 and v5.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    plain = ArchConfig.from_dict(_llama_config(rope_theta=1e6, rope_scaling=None))
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    linear = ArchConfig.from_dict(_llama_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == RopeScaling("linear", 2.0) and linear.rope_theta == 10000.0


def test_eos_ids_accept_lists_and_merge_generation_config():
    arch = ArchConfig.from_dict(
        _llama_config(eos_token_id=[128001, 128009], torch_dtype="bfloat16"),
        generation_config={"eos_token_id": [128001, 128008]},
    )
    assert arch.eos_token_ids == (128001, 128009, 128008)
    assert arch.dtype == "bfloat16"


def test_unsupported_rope_type_and_activation_are_rejected():
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        ArchConfig.from_dict(_llama_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu'"):
        ArchConfig.from_dict(_llama_config(hidden_act="gelu"))


# -- errors users hit ----------------------------------------------------------------------------------


def test_missing_directory_says_what_to_pass(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load(tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json") as info:
        ArchConfig.from_dir(tmp_path)
    assert isinstance(info.value, FileNotFoundError)


def test_unsupported_architecture_lists_supported_ones(tmp_path, tiny_llama_dir):
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"], config["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture GPT2LMHeadModel") as info:
        load(model_dir)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_no_safetensors_files(tmp_path, tiny_llama_dir):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", model_dir)
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors") as info:
        load(model_dir)
    assert isinstance(info.value, FileNotFoundError)


def test_missing_tensor_is_named(tmp_path, tiny_llama_dir):
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj\.weight"):
        load(model_dir)


def test_tensor_shape_disagreeing_with_config(tmp_path, tiny_llama_dir):
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape .* config\.json implies"):
        load(model_dir)


def test_missing_shard_of_sharded_checkpoint(tmp_path, tiny_model_dirs):
    model_dir = copy_checkpoint(tiny_model_dirs["qwen2"], tmp_path / "m")
    shards = safetensors_files(model_dir)
    assert len(shards) > 1 and (model_dir / "model.safetensors.index.json").is_file()
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=r"shards listed in model\.safetensors\.index\.json are missing"):
        load(model_dir)


# -- weights ---------------------------------------------------------------------------------------------


def test_tied_checkpoint_shares_lm_head_with_embeddings(tiny_model_dirs):
    model = load(tiny_model_dirs["llama_tied"]).model
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    untied = load(tiny_model_dirs["llama"]).model
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()


def test_absent_lm_head_falls_back_to_embeddings(tmp_path, tiny_llama_dir):
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    model = load(model_dir).model
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_fused_projections_hold_checkpoint_rows(tiny_model_dirs):
    """q|k|v and gate|up are concatenated row-wise; Qwen2's biases and Qwen3's norms go with them."""
    qwen2 = load(tiny_model_dirs["qwen2"]).model.layers[0]
    shards = {k: v for f in safetensors_files(tiny_model_dirs["qwen2"]) for k, v in load_file(f).items()}
    p = "model.layers.0."
    expected_bias = torch.cat([shards[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(qwen2.self_attn.qkv_proj.bias, expected_bias)
    expected_gate_up = torch.cat([shards[p + "mlp.gate_proj.weight"], shards[p + "mlp.up_proj.weight"]])
    assert torch.equal(qwen2.mlp.gate_up_proj.weight, expected_gate_up)
    qwen3 = load(tiny_model_dirs["qwen3"]).model.layers[1].self_attn
    tensors = load_file(tiny_model_dirs["qwen3"] / "model.safetensors")
    assert torch.equal(qwen3.qk_norm.weight[0], tensors["model.layers.1.self_attn.q_norm.weight"])
    assert torch.equal(qwen3.qk_norm.weight[-1], tensors["model.layers.1.self_attn.k_norm.weight"])


def test_dtype_auto_follows_checkpoint_and_casts_on_request(tiny_llama_dir):
    assert load(tiny_llama_dir).dtype == torch.float32
    runner = load(tiny_llama_dir, dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.kv_pool.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in runner.model.parameters())
    # 2 layers * K,V * 2 kv heads * 16 head_dim * 2 bytes
    assert runner.kv_bytes_per_token == 256 and runner.kv_bytes_per_block == 1024
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load(tiny_llama_dir, dtype="int8")


def test_kv_cache_bytes_sizes_the_pool(tiny_llama_dir, monkeypatch):
    runner = ModelRunner(tiny_llama_dir, device="cpu", block_size=4, kv_cache_bytes=10 * 2048 + 100)
    assert runner.kv_bytes_per_block == 2048 and runner.num_blocks == 10
    with pytest.raises(ValueError, match="less than one block"):
        ModelRunner(tiny_llama_dir, device="cpu", block_size=4, kv_cache_bytes=1000)
    # the default is a share of free memory under a cap; a small cap keeps the test light
    monkeypatch.setattr(runner_module, "DEFAULT_KV_CACHE_MAX_BYTES", 1 << 20)
    default = ModelRunner(tiny_llama_dir, device="cpu", block_size=4)
    assert default.num_blocks == (1 << 20) // 2048


# -- fingerprint -----------------------------------------------------------------------------------------


def test_fingerprint_is_stable_and_tracks_dtype_block_size_and_weights(tmp_path, tiny_llama_dir):
    fp = model_fingerprint(tiny_llama_dir, torch.float32, torch.float32, 16)
    assert len(fp) == 16
    assert load(tiny_llama_dir).fingerprint == load(tiny_llama_dir).fingerprint
    assert model_fingerprint(tiny_llama_dir, "float32", "float32", 16) == fp
    assert model_fingerprint(tiny_llama_dir, torch.bfloat16, torch.bfloat16, 16) != fp
    assert model_fingerprint(tiny_llama_dir, torch.float32, torch.bfloat16, 16) != fp
    assert model_fingerprint(tiny_llama_dir, torch.float32, torch.float32, 32) != fp
    assert (
        load(tiny_llama_dir).fingerprint
        != ModelRunner(tiny_llama_dir, device="cpu", block_size=8, num_blocks=8).fingerprint
    )

    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.embed_tokens.weight"][0, 0] += 1.0
    save_file(tensors, model_dir / "model.safetensors")
    assert model_fingerprint(model_dir, torch.float32, torch.float32, 16) != fp


# -- builder ------------------------------------------------------------------------------------------------


def test_built_random_llama_loads_in_kvtier_and_transformers_alike(tmp_path, reference_model):
    model_dir = build_random_llama(
        tmp_path / "m",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        vocab_size=300,
        dtype="float32",
        seed=3,
        rope_theta=50000.0,
    )
    arch = ArchConfig.from_dir(model_dir)
    assert (arch.intermediate_size, arch.vocab_size, arch.rope_theta) == (96, 300, 50000.0)
    ids = [5, 17, 200, 3, 99, 42, 7]
    logits = load(model_dir).execute(SchedulerOutput(seqs=[ScheduledSeq("a", ids, 0, [0, 1], sample=True)]))
    with torch.inference_mode():
        ref = reference_model(model_dir)(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=0)


def test_built_tied_bf16_llama_has_no_lm_head(tmp_path):
    model_dir = build_random_llama(
        tmp_path / "m",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    tensors = load_file(model_dir / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    runner = load(model_dir)
    assert runner.dtype == torch.bfloat16 and runner.arch.tie_word_embeddings


def test_reference_model_kwargs_fit_the_builder():
    inspect.signature(build_random_llama).bind("/unused", **REFERENCE_MODEL)
    assert REFERENCE_MODEL["hidden_size"] // REFERENCE_MODEL["num_heads"] == 64
