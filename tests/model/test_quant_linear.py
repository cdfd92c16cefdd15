"""Weights kept quantized (kvtier.model.quant_linear, csrc/quant_gemm.c): GGUF blocks repacked
without changing a value, the kernels against the dense product of the same weights, and models
served from a quantized GGUF file or quantized to int8 at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from quantutil import FP16_FIELDS, spy_fused_decode

from kvtier import LLM, SamplingParams
from kvtier.model import gguf as kgguf
from kvtier.model import native, quant_linear
from kvtier.model.quant_linear import Q4, Q8, Q8S16, QuantLinear, QuantWeight, from_gguf, quantize_int8
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'kvtier[gguf]') reads GGUF files")


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = kgguf._BLOCK_BYTES[type_name]
    per_row = k // (256 if type_name.endswith("_K") else 32)
    data = rng.integers(0, 256, size=(n * per_row, size), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        data[:, offset : offset + 2] = (
            rng.normal(0, 0.05, len(data)).astype(np.float16).view(np.uint8).reshape(len(data), 2)
        )
    return data


@pytest.mark.parametrize("type_name", quant_linear.GGUF_REPACKED)
def test_repacked_gguf_blocks_hold_the_values_the_file_holds(type_name):
    n, k = 6, 512
    data = random_blocks(type_name, n, k, quant_linear.GGUF_REPACKED.index(type_name))
    want = kgguf.dequantize(type_name, data).reshape(n, k)
    w = from_gguf(type_name, torch.from_numpy(data), n, k)
    assert w.fmt == (Q4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else Q8S16 if type_name == "Q6_K" else Q8)
    assert w.nbytes < n * k * 2  # smaller than bfloat16
    # Q4_K / Q5_K fold each sub-block's 6-bit scale into a float16 scale: relative error <= 2^-11
    # (Q6_K keeps its int8 16-element scales beside d: exact)
    exact = type_name not in ("Q4_K", "Q5_K")
    for native_on in (True, False):
        if native_on:
            got = w.dequantize()
        else:
            with native.disabled("quant_gemm"):
                got = w.dequantize()
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(got, want, rtol=2e-3, atol=float(want.abs().max()) * 2e-3)


def make_weight(fmt: str, n: int, k: int, affine: bool, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half() if affine else None
    if fmt == Q8:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8).view(torch.uint8)
    elif fmt == Q8S16:  # every int8 value and half-block scale
        ints = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
        s = torch.randint(-128, 128, (n, k // 32, 2), generator=g, dtype=torch.int16).to(torch.int8)
        q = QuantWeight._s16_pack(ints, s, interleaved=False)
    else:
        q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int16).to(torch.uint8)
    return QuantWeight(fmt, q, d, m, n, k)


@pytest.mark.parametrize("fmt,affine", [(Q8, False), (Q8, True), (Q4, True), (Q8S16, False), (Q8S16, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [96, 320])  # 3 blocks: no whole group; 10: one interleaved group and a tail
def test_the_kernel_computes_the_dense_product_of_the_same_weights(fmt, affine, dtype, k):
    n = 72
    w = make_weight(fmt, n, k, affine)
    bias = torch.randn(n)
    layer = QuantLinear(w, bias, dtype=dtype)
    dense = w.dequantize(torch.float64)
    for rows in (1, 2, 3, 4, 5, 9, 16, 23, quant_linear.KERNEL_MAX_ROWS, quant_linear.KERNEL_MAX_ROWS + 3):
        x = torch.randn(rows, k).to(dtype)
        want = F.linear(x.double(), dense, layer.bias.double())
        got = layer(x)
        assert got.dtype == dtype and got.shape == (rows, n)
        # float32: x's int16 rounding (a relative 3e-5 per block); bfloat16: one rounding of the output
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
        with native.disabled("quant_gemm"):  # the torch path: the same weights
            torch.testing.assert_close(layer(x).double(), want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("fmt,affine", [(Q8, False), (Q4, True), (Q8S16, False)])
def test_integer_activations_stay_within_their_rounding(fmt, affine):
    """x quantized per block of 32 to int16: the error is x's rounding, about 1/65534 of each
    block's largest value, not a wrong product, on every path of the kernel (tiles of 8, 4, 2 and 1
    rows and their mixes)."""
    if native.quant_linear_lib() is None:
        pytest.skip("no native quantized kernel on this machine (AVX2, FMA and F16C)")
    bound = 1e-4
    g = torch.Generator().manual_seed(6)
    # n not a multiple of the kernel's chunk of 32 rows; k of 3, 8, 10 and 18 blocks (groups of 8
    # interleaved blocks, with and without a tail)
    for n, k in ((70, 256), (40, 96), (33, 320), (9, 576)):
        w = make_weight(fmt, n, k, affine, seed=5)
        layer = QuantLinear(w, None, dtype=torch.float32)
        dense = w.dequantize()
        for rows in (1, 2, 3, 4, 7, 8, 15, 16):
            x = torch.randn(rows, k, generator=g)
            got, want = layer(x), x @ dense.T
            rel = float((got - want).norm() / want.norm())
            assert 0 < rel < bound, (n, k, rows, rel)
    # bfloat16 x and output: one more rounding, of the output
    layer = QuantLinear(w, torch.randn(n, generator=g), dtype=torch.bfloat16)
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), dense, layer.bias.float())
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).norm() / want.norm()) < bound + 1e-2


def test_int8_weight_quantization_is_within_half_a_step():
    w = torch.randn(40, 128) * torch.logspace(-3, 0, 40).unsqueeze(1)
    q = quantize_int8(w)
    step = q.d.float().repeat_interleave(32, dim=1)
    assert (q.dequantize() - w).abs().le(step / 2 + 1e-7).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int8(torch.randn(4, 40))


def test_fused_parts_of_different_layouts_join_exactly():
    a, b = make_weight(Q4, 8, 64, True, 1), make_weight(Q8, 6, 64, False, 2)
    both = QuantWeight.cat([a, b])
    assert both.fmt == Q8 and both.n == 14
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), rtol=0, atol=0)
    # beside a part with 16-element scales: q8s16 with s = 1, in either layout
    c = make_weight(Q8S16, 5, 64, False, 3)
    for interleaved in (False, True):
        parts = [p.interleave() if interleaved else p for p in (a, b, c)]
        joined = QuantWeight.cat(parts)
        assert joined.fmt == Q8S16 and joined.n == 19 and joined.interleaved == interleaved
        want = torch.cat([p.dequantize() for p in parts])
        torch.testing.assert_close(joined.dequantize(), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="joins others as q8s16"):
        c.as_q8()
    order = torch.tensor([3, 1, 0, 2])
    torch.testing.assert_close(a.rows(order).dequantize(), a.dequantize()[order], rtol=0, atol=0)


def last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    out = SchedulerOutput(
        seqs=[ScheduledSeq("a", ids, 0, list(range(-(-len(ids) // 4))), sample=True)], block_copies=[]
    )
    return runner.execute(out)[0]


def write_quantized_gguf(hf_dir, out, matrix_type):
    from tests.model.test_gguf import write_gguf

    return write_gguf(hf_dir, out, "llama", matrix_type=matrix_type)


@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q8_0", "Q5_1"])
def test_a_quantized_gguf_file_is_served_from_its_blocks(matrix_type, tiny_model_dirs, tmp_path):
    path = write_quantized_gguf(tiny_model_dirs["llama"], tmp_path / f"m-{matrix_type}.gguf", matrix_type)
    kw = dict(dtype="float32", device="cpu", block_size=4, num_blocks=16)
    quantized = ModelRunner(path, **kw)  # the default for a GGUF file on CPU
    dense = ModelRunner(path, quantization="none", **kw)
    assert quantized.weights == "gguf" and dense.weights == "dense"
    projections = [m for m in quantized.model.modules() if isinstance(m, QuantLinear)]
    assert len(projections) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the lm_head
    assert not any(isinstance(m, QuantLinear) for m in dense.model.modules())
    ids = [(13 * i + 7) % 500 for i in range(11)]
    a, b = last_logits(quantized, ids), last_logits(dense, ids)
    # the same weights; x meets them as int16 in the decode kernel (a relative 3e-5 per block)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-3 * float(b.abs().max()))
    # other weights compute other KV: the two never share stored KV
    assert quantized.fingerprint != dense.fingerprint


def test_int8_quantization_of_a_float_checkpoint(tiny_model_dirs):
    hf_dir = tiny_model_dirs["qwen2"]  # biases on q/k/v: they stay float
    kw = dict(dtype="float32", device="cpu", block_size=4, num_blocks=16)
    q8 = ModelRunner(hf_dir, quantization="int8", **kw)
    dense = ModelRunner(hf_dir, **kw)
    assert q8.weights == "int8" and dense.weights == "dense"
    qkv = q8.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.bias is not None
    ids = [(11 * i + 5) % 500 for i in range(9)]
    a, b = last_logits(q8, ids), last_logits(dense, ids)
    # 8-bit weights of a tiny random model (init 0.1, peaked attention): a few percent of the logits
    assert float((a - b).norm() / b.norm()) < 5e-2
    assert q8.fingerprint != dense.fingerprint


def test_serving_from_quantized_weights_end_to_end(tiny_model_dirs, tmp_path):
    path = write_quantized_gguf(tiny_model_dirs["llama"], tmp_path / "m.gguf", "Q4_1")
    llm = LLM(str(path), num_device_blocks=32, block_size=4)
    prompts = [[(7 * i + j) % 500 for i in range(10)] for j in range(3)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]  # prefix-cache hits
    assert first == again and all(len(t) == 8 for t in first)
    llm.check_integrity()


def test_bad_quantization_choices_are_clear_errors(tiny_model_dirs):
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        ModelRunner(tiny_model_dirs["llama"], quantization="awq", device="cpu", num_blocks=4)
    with pytest.raises(ValueError, match="needs a GGUF file"):
        ModelRunner(tiny_model_dirs["llama"], quantization="gguf", device="cpu", num_blocks=4)


def test_an_unknown_activation_mode_is_a_clear_error_at_load(monkeypatch):
    for value in ("int4", "float", "int8"):
        monkeypatch.setenv("KVTIER_QUANT_ACTIVATIONS", value)
        with pytest.raises(ValueError, match=f"KVTIER_QUANT_ACTIVATIONS='{value}': .* int16 blocks only"):
            QuantLinear(make_weight(Q8, 8, 32, False), dtype=torch.float32)
    monkeypatch.setenv("KVTIER_QUANT_ACTIVATIONS", "int16")
    QuantLinear(make_weight(Q8, 8, 32, False), dtype=torch.float32)


@pytest.mark.parametrize("fmt,affine", [(Q8, False), (Q4, True), (Q8S16, True)])
def test_the_interleaved_layout_holds_the_same_values(fmt, affine):
    """QuantLinear keeps its weight interleaved (groups of 8 blocks in the kernel's order, the
    tail blocks as they were): the values, their q8 form and the native dequantization are the
    file's, for rows with no whole group, one group and a tail, and only whole groups."""
    for k in (96, 320, 512):
        w = make_weight(fmt, 5, k, affine, seed=k)
        inter = w.interleave()
        assert inter.interleaved and inter.interleave() is not inter  # idempotent, a new view
        assert inter.nbytes == w.nbytes
        assert torch.equal(inter.values(), w.values())
        wide = inter.as_q8s16() if fmt == Q8S16 else inter.as_q8()
        assert torch.equal(wide.values(), w.values()) and wide.interleaved
        assert torch.equal(inter.as_q8s16().dequantize(), w.dequantize())
        assert torch.equal(inter.dequantize(), w.dequantize())  # native where it runs, torch otherwise
        with native.disabled("quant_gemm"):
            assert torch.equal(inter.dequantize(torch.bfloat16), w.dequantize(torch.bfloat16))
        assert torch.equal(inter.rows(torch.tensor([3, 1])).values(), w.values()[[3, 1]])
        if k >= 256 and fmt != Q4:  # the layout moved bytes (q4: nibbles)
            assert not torch.equal(inter.q, w.q)


def test_the_fused_float32_layer_ops_match_their_torch_twins():
    """csrc/layer_ops_f32.c (models with quantized weights): the norm's mean in another order and
    the C library's exp, otherwise the same roundings."""
    from kvtier.model import layer_ops
    from kvtier.model.llama import RMSNorm, apply_rope

    if native.layer_ops_f32_lib() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5, torch.float32)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    for rows in (1, 5):
        x, res = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g)
        want_normed, want_res = norm.add_norm(x, res.clone())
        res_native = res.clone()
        got = layer_ops.add_rms_norm_f32(x, res_native, norm.weight, norm.eps)
        assert got is not None
        torch.testing.assert_close(res_native, want_res, rtol=0, atol=0)
        torch.testing.assert_close(got, want_normed, rtol=1e-6, atol=1e-6)
        qk = torch.randn(rows, 6, 32, generator=g)
        cos, sin = torch.rand(rows, 1, 16, generator=g), torch.rand(rows, 1, 16, generator=g)
        want = apply_rope(qk.clone(), cos, sin)
        got_qk = qk.clone()
        assert layer_ops.rope_f32_(got_qk, cos, sin)
        torch.testing.assert_close(got_qk, want, rtol=0, atol=0)
        gate_up = torch.randn(rows, 2 * 64, generator=g) * 4
        want_act = F.silu(gate_up[:, :64]) * gate_up[:, 64:]
        torch.testing.assert_close(layer_ops.silu_mul_f32(gate_up, 64), want_act, rtol=1e-6, atol=1e-6)


def test_decode_steps_on_the_float32_native_paths_match_the_torch_ops(tiny_model_dirs, tmp_path):
    """A model with quantized weights decodes with csrc/decode_attention_f32.c (paged, GQA, several
    sequences of different lengths) and the fused float32 layer ops: the logits of the torch ops
    to float32 rounding (which x's int16 rounding in the projections carries on now and then)."""
    path = write_quantized_gguf(tiny_model_dirs["llama"], tmp_path / "m.gguf", "Q8_0")
    if native.decode_attention_f32_lib() is None:
        pytest.skip("no C compiler here")

    def decode_logits() -> torch.Tensor:
        runner = ModelRunner(path, dtype="float32", device="cpu", block_size=4, num_blocks=32)
        assert runner.attn_backend.native_f32  # type: ignore[attr-defined]
        seqs = [[(5 * i + 3 * j) % 500 for i in range(n)] for j, n in enumerate((9, 14, 3))]
        tables = [list(range(8 * j, 8 * j + 8)) for j in range(3)]
        for j, s in enumerate(seqs):
            runner.execute(SchedulerOutput(seqs=[ScheduledSeq(f"s{j}", s[:-1], 0, tables[j], False)]))
        batch = [ScheduledSeq(f"s{j}", [s[-1]], len(s) - 1, tables[j], True) for j, s in enumerate(seqs)]
        return runner.execute(SchedulerOutput(seqs=batch))

    native_logits = decode_logits()
    with native.disabled("decode_attention_f32", "layer_ops_f32"):
        torch_logits = decode_logits()
    torch.testing.assert_close(native_logits, torch_logits, rtol=0, atol=1e-3 * float(torch_logits.abs().max()))


def _decode_batches(runner: ModelRunner, steps: int = 3) -> list[torch.Tensor]:
    """Three sequences of different lengths (some across block boundaries) prefilled, then `steps`
    decode steps of all three at once: the logits of each step."""
    seqs = [[(5 * i + 3 * j) % 500 for i in range(n)] for j, n in enumerate((9, 14, 3))]
    tables = [list(range(8 * j, 8 * j + 8)) for j in range(3)]
    for j, s in enumerate(seqs):
        runner.execute(SchedulerOutput(seqs=[ScheduledSeq(f"s{j}", s[:-1], 0, tables[j], False)]))
    out = []
    for step in range(steps):
        batch = [ScheduledSeq(f"s{j}", [s[-1]], len(s) - 1, tables[j], True) for j, s in enumerate(seqs)]
        logits = runner.execute(SchedulerOutput(seqs=batch))
        out.append(logits)
        for j, s in enumerate(seqs):
            s.append((int(logits[j].argmax()) + step) % 500)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_decode_step_in_one_native_call_equals_the_per_op_path(family, tiny_model_dirs, tmp_path, monkeypatch):
    """csrc/decode_model_f32.c runs every layer of a decode step with the kernels the per-op path
    calls, in the same order: the same logits bit for bit where both attend with
    csrc/decode_attention_f32.c (qwen2: q/k/v biases, int8 weights quantized at load)."""
    from kvtier.model.fused_decode import FusedDecode

    if family == "llama":
        path, kw = write_quantized_gguf(tiny_model_dirs["llama"], tmp_path / "m.gguf", "Q4_1"), {}
    else:
        path, kw = tiny_model_dirs["qwen2"], {"quantization": "int8"}
    if native.decode_model_f32_lib() is None:
        pytest.skip("no C compiler or no AVX2/FMA/F16C here")
    calls = spy_fused_decode(monkeypatch)

    def run() -> list[torch.Tensor]:
        runner = ModelRunner(path, dtype="float32", device="cpu", block_size=4, num_blocks=32, **kw)
        assert isinstance(runner.model.fused_decode, FusedDecode)
        return _decode_batches(runner)

    with native.disabled("paged_attention"):  # both sides attend with decode_attention_f32.c
        fused = run()
        assert calls == [True] * 3
        with native.disabled("decode_model_f32"):
            per_op = run()
    assert calls == [True] * 3 + [False] * 3  # the second run's calls fell back
    for a, b in zip(fused, per_op, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and beside the AVX-512 attention of the per-op path, where the CPU has it: float32 rounding
    # (which x's int16 rounding carries on to a neighbouring step now and then)
    tol = 1e-3 * float(per_op[0].abs().max())
    with native.disabled("decode_model_f32"):
        per_op_avx512 = run() if native.paged_attention_lib() is not None else per_op
    for a, b in zip(fused, per_op_avx512, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


def test_the_fused_decode_step_applies_only_where_it_computes_the_same(tiny_model_dirs, tmp_path, monkeypatch):
    """Not for a model with per-head q/k norms (Qwen3), dense weights or a quantized KV pool; an
    out-of-pool block id is an IndexError, as on the per-op path."""
    from kvtier.model.fused_decode import FusedDecode

    if native.decode_model_f32_lib() is None:
        pytest.skip("no C compiler or no AVX2/FMA/F16C here")
    calls = []
    real_call = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(real_call(self, *a)) or calls[-1])
    kw = dict(dtype="float32", device="cpu", block_size=4, num_blocks=32)
    assert ModelRunner(tiny_model_dirs["qwen3"], quantization="int8", **kw).model.fused_decode is None
    assert ModelRunner(tiny_model_dirs["llama"], **kw).model.fused_decode is None  # dense float32
    path = write_quantized_gguf(tiny_model_dirs["llama"], tmp_path / "m.gguf", "Q8_0")
    fp8 = ModelRunner(path, kv_cache_dtype="fp8_e4m3", **kw)
    assert isinstance(fp8.model.fused_decode, FusedDecode)
    plain = ModelRunner(path, **kw)
    a = _decode_batches(fp8, steps=1)[0]
    assert calls == [None]  # the fp8 pool: the per-op path
    b = _decode_batches(plain, steps=1)[0]
    assert len(calls) == 2 and calls[1] is not None
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    runner = ModelRunner(path, **kw)
    runner.execute(SchedulerOutput(seqs=[ScheduledSeq("a", [1, 2, 3], 0, [0], False)]))
    with pytest.raises(IndexError, match="outside the pool"):
        runner.execute(SchedulerOutput(seqs=[ScheduledSeq("a", [4], 3, [40], True)]))
