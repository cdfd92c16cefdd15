"""Which GEMM a bfloat16 projection runs on (kvtier.model.linear): the choice from timings, the
override, the float32 path's numerics against the packed bf16 path, and a runner that takes the
float32 path for its prefill rows and the packed one for its decode rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.model import linear
from kvtier.model.linear import Linear, can_pack_linears, choose_wide_rows, linear_fp32, wide_rows_override
from kvtier.model.runner import ModelRunner
from kvtier.sched.output import ScheduledSeq, SchedulerOutput

needs_packing = pytest.mark.skipif(not can_pack_linears(torch.bfloat16, torch.device("cpu")),
                                   reason="oneDNN bf16 weight packing is not available in this torch build")


def test_choose_wide_rows_takes_the_smallest_size_from_which_fp32_always_wins():
    # fp32 faster by >= 10% from 256 rows up; at 128 too, but 64 loses: 128 is the threshold
    timings = {16: (1.0, 2.0), 64: (1.0, 1.0), 128: (1.3, 1.0), 256: (1.5, 1.0), 2048: (1.4, 1.0)}
    assert choose_wide_rows(timings) == 128
    # a size in between that fp32 does not win breaks the run: only the sizes above it count
    assert choose_wide_rows({**timings, 256: (1.05, 1.0)}) == 2048
    assert choose_wide_rows({16: (1.0, 2.0), 2048: (1.05, 1.0)}) is None  # within the margin: bf16
    assert choose_wide_rows({16: (3.0, 1.0), 2048: (3.0, 1.0)}) == 16     # fp32 everywhere


def test_override_from_the_environment():
    assert wide_rows_override({}) == (False, None)
    assert wide_rows_override({linear.WIDE_ROWS_ENV: "never"}) == (True, None)
    assert wide_rows_override({linear.WIDE_ROWS_ENV: "512"}) == (True, 512)
    for bad in ("0", "lots"):
        with pytest.raises(ValueError, match=linear.WIDE_ROWS_ENV):
            wide_rows_override({linear.WIDE_ROWS_ENV: bad})


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_path_agrees_with_the_packed_bf16_path(bias):
    """Both accumulate exact bf16 products in float32 and round once: outputs within one bf16 ulp,
    and the float32 path equals F.linear in float32 rounded to bfloat16 exactly."""
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 160, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=g) * 0.1)
        if bias:
            layer.bias.copy_(torch.randn(160, generator=g))
    x = torch.randn(300, 96, generator=g).to(torch.bfloat16)
    layer.pack(keep_weight=True)
    packed = layer(x)
    layer.wide_min_rows = 300
    wide = layer(x)
    assert wide.dtype == torch.bfloat16
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float() if bias else None).to(torch.bfloat16)
    assert torch.equal(wide, want)
    assert torch.equal(wide, linear_fp32(x, layer.weight, layer.bias))
    ulp = packed.float().abs().clamp_min(2**-20) * 2**-7
    assert ((wide.float() - packed.float()).abs() <= ulp).all()
    layer.wide_min_rows = 301  # one row short of the threshold: the packed path
    assert torch.equal(layer(x), packed)


@needs_packing
def test_runner_takes_fp32_for_prefill_rows_and_keeps_packed_weights_for_decode(tiny_model_dirs, monkeypatch):
    model_dir = tiny_model_dirs["qwen2"]  # q/k/v biases
    monkeypatch.setenv(linear.WIDE_ROWS_ENV, "8")
    wide = ModelRunner(model_dir, dtype="bfloat16", device="cpu", block_size=4, num_blocks=16)
    monkeypatch.setenv(linear.WIDE_ROWS_ENV, "never")
    packed = ModelRunner(model_dir, dtype="bfloat16", device="cpu", block_size=4, num_blocks=16)
    proj = wide.model.layers[0].mlp.gate_up_proj
    assert wide.fp32_gemm_min_rows == 8 and proj.wide_min_rows == 8
    assert proj.packed_weight is not None and proj.weight is not None  # both kept: the fp32 path reads the dense one
    assert packed.fp32_gemm_min_rows is None
    assert packed.model.layers[0].mlp.gate_up_proj.weight is None      # packed only: no second copy
    assert wide.model.lm_head.wide_min_rows is None                    # sampled rows only: packed
    ids = [(7 * i + 3) % 512 for i in range(13)]
    prefill = SchedulerOutput(seqs=[ScheduledSeq("a", ids, 0, [0, 1, 2, 3], sample=True)], block_copies=[])
    decode = SchedulerOutput(seqs=[ScheduledSeq("a", [5], 13, [0, 1, 2, 3], sample=True)], block_copies=[])
    first_wide, first_packed = wide.execute(prefill), packed.execute(prefill)
    # 13 rows >= 8: float32 GEMMs; close to the packed run, not bit-equal (another summation order)
    torch.testing.assert_close(first_wide, first_packed, atol=0.05 * first_packed.abs().max().item(), rtol=0)
    assert first_wide.argmax() == first_packed.argmax()
    # the decode row (1 < 8) runs the packed path in both: same KV in, same logits out
    wide.kv_pool.copy_(packed.kv_pool)
    assert torch.equal(wide.execute(decode), packed.execute(decode))


def test_no_choice_outside_bfloat16_on_cpu(tiny_model_dirs, monkeypatch):
    monkeypatch.setenv(linear.WIDE_ROWS_ENV, "8")
    runner = ModelRunner(tiny_model_dirs["llama"], dtype="float32", device="cpu", block_size=4, num_blocks=8)
    assert runner.fp32_gemm_min_rows is None
    assert all(m.wide_min_rows is None for m in runner.model.modules() if isinstance(m, Linear))
