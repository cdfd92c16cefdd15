"""GGUF Q6_K weights served quantized (the q8s16 format of kvtier.model.quant_linear and
csrc/quant_gemm.c): the kernel against the dense product of the weight gguf.py dequantizes, fused
projections whose parts mix Q6_K with other block types, and a model whose projections include
Q6_K tensors, quantized against the same file dequantized, on the native kernels and without."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quantutil import spy_fused_decode

from kvtier import LLM, SamplingParams
from kvtier.model import gguf as kgguf
from kvtier.model import native, quant_linear
from kvtier.model.quant_linear import Q4, Q8, Q8S16, QuantLinear, QuantWeight, from_gguf
from kvtier.model.runner import ModelRunner
from tests.model.test_quant_linear import _decode_batches, last_logits, random_blocks

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'kvtier[gguf]') reads GGUF files")


def q6_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random Q6_K super-blocks: every byte of ql, qh and the scales random, d a finite float16
    (test_quant_linear.FP16_FIELDS)."""
    return random_blocks("Q6_K", n, k, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_on_q6_k_blocks_computes_the_product_of_the_file_weight(dtype):
    """Against torch's matmul on the weight gguf.py dequantizes (the loader's dense path), for tiles
    of 4, 2 and 1 rows (q8s16's tiles) and their mixes, and above KERNEL_MAX_ROWS (dequantize +
    dense GEMM)."""
    g = torch.Generator().manual_seed(1)
    for n, k in ((70, 256), (33, 768), (9, 1536)):  # 1, 3 and 6 groups of 8 blocks; n off the chunk of 32
        data = q6_k_blocks(n, k, seed=k)
        file_weight = kgguf.dequantize("Q6_K", data).reshape(n, k)
        w = from_gguf("Q6_K", torch.from_numpy(data), n, k)
        assert w.fmt == Q8S16 and w.nbytes == n * k // 32 * 36  # 34 bytes a block and its float16 d
        layer = QuantLinear(w, torch.randn(n, generator=g), dtype=dtype)
        assert torch.equal(layer.weight_q.dequantize(), file_weight)  # the values, bit for bit
        for rows in (1, 3, 8, 16, quant_linear.KERNEL_MAX_ROWS, 200):
            x = torch.randn(rows, k, generator=g).to(dtype)
            want = F.linear(x.double(), file_weight.double(), layer.bias.double())
            # float32: x's int16 rounding (a relative 3e-5 per block); bfloat16: one rounding of the output
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            got = layer(x)
            assert got.dtype == dtype and got.shape == (rows, n)
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
            with native.disabled("quant_gemm"):  # the torch path on the same values
                torch.testing.assert_close(layer(x).double(), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_fused_projections_mixing_q6_k_with_other_types_join_exactly():
    """q | k | v of Q8_0, Q4_K and Q6_K parts: one q8s16 weight holding each part's values (the
    Q4_K part's float16-folded scales as its own repacking has them), whose kernel computes the
    dense product. Then a K with tail blocks (k-quants need K % 256 == 0, so a Q4_1 part beside a
    q8s16 one of Q6_K's value range)."""
    g = torch.Generator().manual_seed(2)
    k = 512
    types = {"Q8_0": 24, "Q4_K": 8, "Q6_K": 8}  # rows of q, k, v
    data = {t: random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(types.items())}
    parts = [from_gguf(t, torch.from_numpy(data[t]), n, k) for t, n in types.items()]
    assert [p.fmt for p in parts] == [Q8, Q4, Q8S16]
    fused = QuantWeight.cat(parts)
    assert fused.fmt == Q8S16 and fused.n == 40
    want_w = torch.cat(
        [
            kgguf.dequantize("Q8_0", data["Q8_0"]).reshape(24, k),
            parts[1].dequantize(),  # Q4_K: d sc and m min rounded to float16 at repacking
            kgguf.dequantize("Q6_K", data["Q6_K"]).reshape(8, k),
        ]
    )
    assert torch.equal(fused.dequantize(), want_w)
    layer = QuantLinear(fused, torch.randn(40, generator=g), dtype=torch.float32)
    for rows in (1, 3, 8, 16, 200):
        x = torch.randn(rows, k, generator=g)
        want = F.linear(x.double(), want_w.double(), layer.bias.double())
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # K = 320: one group of 8 blocks and 2 tail blocks in GGUF order, q4 (offsets) beside q8s16
    k = 320
    a = from_gguf("Q4_1", torch.from_numpy(random_blocks("Q4_1", 16, k, seed=5)), 16, k)
    s = torch.randint(-128, 128, (8, k // 32, 2), generator=g, dtype=torch.int16).to(torch.int8)
    ints = torch.randint(-32, 32, (8, k), generator=g, dtype=torch.int16).to(torch.int8)
    d = (torch.rand(8, k // 32, generator=g) * 0.01).half()
    b = QuantWeight(Q8S16, QuantWeight._s16_pack(ints, s, interleaved=False), d, None, 8, k)
    fused = QuantWeight.cat([a, b])
    assert fused.fmt == Q8S16 and fused.m is not None
    want_w = torch.cat([a.dequantize(), b.dequantize()])
    layer = QuantLinear(fused, None, dtype=torch.float32)
    assert torch.equal(layer.weight_q.dequantize(), want_w)
    for rows in (1, 2, 5, 8, 16):
        x = torch.randn(rows, k, generator=g)
        want = x.double() @ want_w.double().T
        torch.testing.assert_close(layer(x).double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


# ---------------------------------------------------------------------------------- a model with Q6_K
def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[n, k] float32 (k % 256 == 0) -> Q6_K super-blocks [n k / 256, 210] uint8, rounded to nearest:
    each 16 elements' scale max|w| / 31, the super-block's d the largest of them / 127 (the gguf
    package quantizes no k-quant type; llama.cpp searches its scales, which only changes the values)."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    sub = np.abs(x).max(axis=-1) / 31  # [S, 16]
    d = (sub.max(axis=-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.round(np.divide(sub, df, out=np.zeros_like(sub), where=df > 0)).clip(-128, 127).astype(np.int8)
    scale = (df * sc.astype(np.float32))[..., None]
    q = np.round(np.divide(x, scale, out=np.zeros_like(x), where=scale != 0)).clip(-32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 256).astype(np.uint8)  # 0..63
    low = (q & 0x0F).reshape(-1, 2, 2, 64)  # element 128 h + 64 s + i: ql byte 64 h + i, nibble s
    ql = low[:, :, 0] | (low[:, :, 1] << 4)
    high = (q >> 4).reshape(-1, 2, 4, 32)  # element 128 h + 32 s + i: qh byte 32 h + i, bits 2 s
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1
    )


def test_the_q6_k_test_quantizer_writes_blocks_gguf_reads():
    w = np.random.default_rng(0).normal(0, 0.1, (6, 512)).astype(np.float32)
    got = kgguf.dequantize("Q6_K", quantize_q6_k(w)).reshape(6, 512).numpy()
    step = np.abs(w.reshape(-1, 16)).max(axis=-1) / 31
    assert (np.abs(got - w).reshape(-1, 16) <= step[:, None] * 0.6 + 1e-4).all()


# GGUF type of each projection per layer, as llama.cpp's mixes do (Q6_K on attn_v and ffn_down):
# layer 0 joins q | k | v and gate | up as q8s16 from mixed parts, layer 1 as q8s16 of three Q6_K
# parts and as q8 (Q4_0 + Q8_0, no Q6_K)
LAYER_TYPES = (
    {"attn_q": "Q8_0", "attn_k": "Q4_1", "attn_v": "Q6_K", "attn_output": "Q6_K"}
    | {"ffn_gate": "Q6_K", "ffn_up": "Q4_0", "ffn_down": "Q6_K"},
    {"attn_q": "Q6_K", "attn_k": "Q6_K", "attn_v": "Q6_K", "attn_output": "Q5_0"}
    | {"ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K"},
)
WIDE_DIMS = dict(
    hidden_size=256,  # k-quants need rows of a multiple of 256
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    vocab_size=512,
    max_position_embeddings=512,
    initializer_range=0.05,
)


def tensor_type(name: str) -> str:
    if name == "output.weight":
        return "Q6_K"
    if name == "token_embd.weight":
        return "Q8_0"
    _, layer, kind, _ = name.split(".")
    return LAYER_TYPES[int(layer)][kind]


@pytest.fixture(scope="module")
def q6_k_gguf(tmp_path_factory) -> Path:
    """A tiny Llama (hidden 256, intermediate 512) written by transformers, as a GGUF file of the
    types of LAYER_TYPES: written in float32 by test_gguf's writer, then requantized tensor by tensor."""
    transformers = pytest.importorskip("transformers")
    from tests.model.test_gguf import write_gguf

    root = tmp_path_factory.mktemp("q6_k")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(**WIDE_DIMS, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(root / "hf")
    assert not json.loads((root / "hf" / "config.json").read_text())["tie_word_embeddings"]
    f32 = write_gguf(root / "hf", root / "f32.gguf", "llama")
    reader = gguf.GGUFReader(str(f32))
    out = root / "q6_k.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header, and what the writer adds itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        values = np.array(t.data, dtype=np.float32)  # [n, k] as GGUF lays it out (q, k permuted)
        if values.ndim != 2:
            writer.add_tensor(t.name, values)
            continue
        type_name = tensor_type(t.name)
        qtype = gguf.GGMLQuantizationType[type_name]
        blocks = quantize_q6_k(values) if type_name == "Q6_K" else gguf.quants.quantize(values, qtype)
        writer.add_tensor(t.name, blocks.reshape(values.shape[0], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_gguf_file_with_q6_k_projections_serves_them_quantized(q6_k_gguf):
    """Every projection quantized (none dense in the model dtype), the Q6_K ones and the fused ones
    beside them as q8s16; the logits those of the same file dequantized (quantization='none')."""
    kw = dict(dtype="float32", device="cpu", block_size=4, num_blocks=16)
    quantized = ModelRunner(q6_k_gguf, **kw)
    dense = ModelRunner(q6_k_gguf, quantization="none", **kw)
    fmts = {name: m.fmt for name, m in quantized.model.named_modules() if isinstance(m, QuantLinear)}
    assert fmts == {
        "layers.0.self_attn.qkv_proj": Q8S16,  # Q8_0 | Q4_1 | Q6_K
        "layers.0.self_attn.o_proj": Q8S16,
        "layers.0.mlp.gate_up_proj": Q8S16,  # Q6_K | Q4_0
        "layers.0.mlp.down_proj": Q8S16,
        "layers.1.self_attn.qkv_proj": Q8S16,
        "layers.1.self_attn.o_proj": Q8,  # Q5_0
        "layers.1.mlp.gate_up_proj": Q8,  # Q4_0 | Q8_0
        "layers.1.mlp.down_proj": Q8S16,
        "lm_head": Q8S16,
    }
    for name, m in quantized.model.named_modules():
        if isinstance(m, QuantLinear):
            dense_w = dense.model.get_submodule(name).weight
            assert torch.equal(m.weight_q.dequantize(), dense_w), name  # the values gguf.py gives
    ids = [(13 * i + 7) % 500 for i in range(11)]
    a, b = last_logits(quantized, ids), last_logits(dense, ids)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * float(b.abs().max()))


def test_greedy_tokens_of_q6_k_projections_equal_the_dequantized_model(q6_k_gguf):
    """End to end through LLM: the quantized model (the native kernels, a decode step in one call),
    the same with every native kernel off (what KVTIER_NO_NATIVE=1 runs: QuantLinear dequantizes
    and multiplies with torch) and the file dequantized to float32 give the same greedy tokens."""
    prompts = [[(7 * i + j) % 500 for i in range(10)] for j in range(3)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens(**kw) -> list[list[int]]:
        llm = LLM(str(q6_k_gguf), num_device_blocks=32, block_size=4, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]

    quantized = tokens()
    with native.disabled():
        fallback = tokens()
    dense = tokens(quantization="none")
    assert quantized == dense and fallback == dense
    assert all(len(t) == 8 for t in dense)


def test_the_one_call_decode_step_runs_q6_k_projections(q6_k_gguf, monkeypatch):
    """csrc/decode_model_f32.c passes q8s16 projections to the same kernel as the per-op path: the
    same logits bit for bit where both attend with csrc/decode_attention_f32.c."""
    from kvtier.model.fused_decode import FusedDecode

    if native.decode_model_f32_lib() is None:
        pytest.skip("no C compiler or no AVX2/FMA/F16C here")
    calls = spy_fused_decode(monkeypatch)

    def run() -> list[torch.Tensor]:
        runner = ModelRunner(q6_k_gguf, dtype="float32", device="cpu", block_size=4, num_blocks=32)
        fused = runner.model.fused_decode
        assert isinstance(fused, FusedDecode)
        return _decode_batches(runner)

    with native.disabled("paged_attention"):
        one_call = run()
        assert calls == [True] * 3  # every decode step ran in the one call
        with native.disabled("decode_model_f32"):
            per_op = run()
    assert calls == [True] * 3 + [False] * 3
    for a, b in zip(one_call, per_op, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
