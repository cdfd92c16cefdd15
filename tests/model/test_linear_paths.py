"""Which GEMM a bfloat16 projection runs on (kvtier.model.linear): the plan chosen from timings, the
override, every method's numerics against float32, the native kernel (csrc/gemm.c) on the shapes
and strides it takes and refuses, and a runner whose prefill and decode rows take different
methods."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.model import linear, native
from kvtier.model.linear import (
    DENSE,
    FP32,
    NATIVE_DP,
    NATIVE_FMA,
    ONEDNN,
    GemmPlan,
    Linear,
    available_methods,
    can_pack_linears,
    choose_plan,
    linear_native,
    plan_override,
)
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput

needs_packing = pytest.mark.skipif(
    not can_pack_linears(torch.bfloat16, torch.device("cpu")),
    reason="oneDNN bf16 weight packing is not available in this torch build",
)
needs_kernel = pytest.mark.skipif(
    native.linear_lib() is None, reason="no native bf16 GEMM here (needs a C compiler and AVX512-BF16)"
)


def test_choose_plan_switches_only_for_a_clear_win_over_the_size_below():
    timings = {
        1: {ONEDNN: 1.0, NATIVE_FMA: 0.5, FP32: 4.0},
        16: {ONEDNN: 1.0, NATIVE_FMA: 0.8, FP32: 2.0},
        64: {ONEDNN: 1.0, NATIVE_FMA: 0.95, FP32: 0.9},  # fp32 best, but within 10% of native: stays
        512: {ONEDNN: 1.0, NATIVE_FMA: 1.5, FP32: 0.6},
        2048: {ONEDNN: 1.0, NATIVE_FMA: 2.0, FP32: 0.62},
    }
    plan = choose_plan(timings, ONEDNN)
    # fp32 was already as fast at 64 rows, and wins clearly at 512: it takes over just above 64
    assert plan.steps == ((1, NATIVE_FMA), (65, FP32))
    assert [plan.method(r) for r in (1, 15, 63, 64, 65, 5000)] == [NATIVE_FMA] * 4 + [FP32] * 2
    assert not {ONEDNN} & plan.methods and plan.needs_dense
    # where the new method was still behind at the lower size, it starts where the speeds cross
    crossing = {
        1: {ONEDNN: 1.0, NATIVE_DP: 0.5},
        512: {ONEDNN: 1.0, NATIVE_DP: 0.8},
        1024: {ONEDNN: 1.0, NATIVE_DP: 1.4},
    }
    assert choose_plan(crossing, ONEDNN).steps == ((1, NATIVE_DP), (683, ONEDNN))
    # a near tie at the first size keeps the baseline
    assert choose_plan({1: {ONEDNN: 1.0, NATIVE_FMA: 0.95}}, ONEDNN).steps == ((1, ONEDNN),)
    assert not GemmPlan(((1, ONEDNN),)).needs_dense


def test_plan_parse_and_override():
    assert plan_override({}) is None
    assert plan_override({linear.PLAN_ENV: "native_fma"}).steps == ((1, NATIVE_FMA),)
    assert plan_override({linear.PLAN_ENV: "1:native_dp, 256:fp32"}).steps == ((1, NATIVE_DP), (256, FP32))
    for bad in ("fastest", "4:fp32", "1:fp32,1:onednn", "1:fp32,x:onednn"):
        with pytest.raises(ValueError, match=linear.PLAN_ENV):
            plan_override({linear.PLAN_ENV: bad})


def _layer(k: int, n: int, bias: bool, seed: int = 0) -> tuple[Linear, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=g) * 0.1)
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    return layer, g


def _within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Rounding float32 sums taken in another order to bf16 moves a value by at most one ulp."""
    ulp = want.float().abs().clamp_min(2**-30) * 2**-7
    return bool(((got.float() - want.float()).abs() <= ulp).all())


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 300])
def test_every_method_agrees_with_float32_rounded_once(bias, rows):
    layer, g = _layer(96, 160, bias)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float() if bias else None).to(torch.bfloat16)
    layer.pack(keep_weight=True)
    for method in available_methods(packed=True):
        layer.plan = GemmPlan(((1, method),))
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 160)
        if method == FP32:
            assert torch.equal(got, want)  # the same float32 product, rounded once
        else:
            assert _within_one_ulp(got, want), method


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [512, 700, 1024])
@pytest.mark.parametrize("mode", ["inference", "no_grad"])
def test_dynamic_row_blocks_give_what_one_call_gives(bias, rows, mode, monkeypatch):
    """Under contention big packed GEMMs run as row blocks on a dynamic schedule
    (kvtier.threads.run_dynamic); each block is the same oneDNN GEMM, so the rows are the same."""
    from kvtier.threads import dynamic

    layer, g = _layer(96, 160, bias)
    layer.pack(keep_weight=False)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    with torch.inference_mode() if mode == "inference" else torch.no_grad():
        want = layer(x)
        monkeypatch.setattr(dynamic, "_dynamic_rows", True)  # the flag linear.py reads
        got = layer(x)
        small = layer(x[:300])  # below DYNAMIC_MIN_ROWS: one call
        direct = linear.linear_packed_dynamic(x, layer.packed_weight, layer.bias, 160)
    assert got.shape == (rows, 160) and torch.equal(got, want)
    assert torch.equal(small, want[:300])
    assert direct is not None and torch.equal(direct, want)
    if bias:  # autograd on: one call, the product recorded
        assert linear.linear_packed_dynamic(x, layer.packed_weight, layer.bias, 160) is None
        assert layer(x).grad_fn is not None


@needs_kernel
def test_native_kernel_takes_strided_rows_and_refuses_what_it_cannot_do():
    layer, g = _layer(64, 32, bias=True)
    wide = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    x = wide[:, 16:80]  # rows with stride 96, unit column stride
    got = linear_native(x, layer.weight, layer.bias, 1)
    assert got is not None
    assert _within_one_ulp(got, F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16))
    odd_k, _ = _layer(40, 32, bias=False)  # K % 32 != 0
    odd_n, _ = _layer(64, 30, bias=False)  # N % 4 != 0
    assert linear_native(torch.ones(2, 40, dtype=torch.bfloat16), odd_k.weight, None, 1) is None
    assert linear_native(torch.ones(2, 64, dtype=torch.bfloat16), odd_n.weight, None, 1) is None
    assert linear_native(x.t().contiguous().t(), layer.weight, None, 1) is None  # column stride != 1
    assert linear_native(x.float(), layer.weight.float(), None, 1) is None  # not bf16
    # a layer whose shape the kernel refuses still answers, on the fallback
    odd_k.plan = GemmPlan(((1, NATIVE_FMA),))
    y = torch.randn(3, 40, generator=g).to(torch.bfloat16)
    assert torch.equal(odd_k(y), F.linear(y, odd_k.weight))


@needs_kernel
def test_runner_takes_one_method_for_prefill_rows_and_another_for_decode(tiny_model_dirs, monkeypatch):
    model_dir = tiny_model_dirs["qwen2"]  # q/k/v biases; hidden 64, heads of 16 columns
    monkeypatch.setenv(linear.PLAN_ENV, "1:native_fma,8:fp32")
    mixed = ModelRunner(model_dir, dtype="bfloat16", device="cpu", block_size=4, num_blocks=16)
    monkeypatch.setenv(linear.PLAN_ENV, "fp32")
    wide = ModelRunner(model_dir, dtype="bfloat16", device="cpu", block_size=4, num_blocks=16)
    proj = mixed.model.layers[0].mlp.gate_up_proj
    assert mixed.gemm_plan.steps == ((1, NATIVE_FMA), (8, FP32))
    assert proj.packed_weight is None and proj.weight is not None  # no method reads a packed copy
    ids = [(7 * i + 3) % 512 for i in range(13)]
    prefill = SchedulerOutput(seqs=[ScheduledSeq("a", ids, 0, [0, 1, 2, 3], sample=True)], block_copies=[])
    decode = SchedulerOutput(seqs=[ScheduledSeq("a", [5], 13, [0, 1, 2, 3], sample=True)], block_copies=[])
    # 13 rows >= 8: both runners take float32 GEMMs: the same bits
    assert torch.equal(mixed.execute(prefill), wide.execute(prefill))
    assert torch.equal(mixed.kv_pool, wide.kv_pool)
    # the decode row takes the native kernel in one and float32 in the other: within bf16 rounding
    a, b = mixed.execute(decode), wide.execute(decode)
    torch.testing.assert_close(a, b, atol=0.05 * b.abs().max().item(), rtol=0)
    assert a.argmax() == b.argmax()


@needs_packing
def test_onednn_plans_keep_only_the_packed_weight(tiny_model_dirs, monkeypatch):
    monkeypatch.setenv(linear.PLAN_ENV, "onednn")
    runner = ModelRunner(tiny_model_dirs["llama"], dtype="bfloat16", device="cpu", block_size=4, num_blocks=8)
    proj = runner.model.layers[0].self_attn.qkv_proj
    assert proj.packed_weight is not None and proj.weight is None
    monkeypatch.setenv(linear.PLAN_ENV, "1:onednn,8:fp32")
    runner = ModelRunner(tiny_model_dirs["llama"], dtype="bfloat16", device="cpu", block_size=4, num_blocks=8)
    proj = runner.model.layers[0].self_attn.qkv_proj
    assert proj.packed_weight is not None and proj.weight is not None  # fp32 reads the dense one


def test_onednn_in_a_plan_without_packing_is_refused(tiny_model_dirs, monkeypatch):
    monkeypatch.setenv(linear.PLAN_ENV, "onednn")
    with pytest.raises(ValueError, match="onednn needs packed weights"):
        ModelRunner(
            tiny_model_dirs["llama"], dtype="bfloat16", device="cpu", block_size=4, num_blocks=8, pack_weights=False
        )
    assert DENSE in available_methods(packed=False)


def test_no_plan_outside_bfloat16_on_cpu(tiny_model_dirs, monkeypatch):
    monkeypatch.setenv(linear.PLAN_ENV, "fp32")
    runner = ModelRunner(tiny_model_dirs["llama"], dtype="float32", device="cpu", block_size=4, num_blocks=8)
    assert runner.gemm_plan is None
    assert all(m.plan is None for m in runner.model.modules() if isinstance(m, Linear))
